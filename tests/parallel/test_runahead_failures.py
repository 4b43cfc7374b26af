"""A prefill worker that dies or hangs surfaces as ParallelPrefillError within the timeout, the group is
closed, and no worker process is left running."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvserve.errors import ParallelPrefillError
from kvserve.parallel import ChunkJob, PrefillGroup, WorkerModel
from tests.parallel.conftest import even, prompt


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["killed", "hung"])
def test_worker_failure_is_a_clear_error_and_leaves_no_process(tiny, failure) -> None:
    folder, loaded = tiny
    g = PrefillGroup(loaded.model, WorkerModel(str(folder), "float32", "dequant"), 2, threads_per_proc=1, timeout_s=5)
    try:
        ids = prompt(40)
        g.prefill(ChunkJob("runahead", tuple(ids), even(40, 2)))  # works first
        worker = g.workers[0]
        os.kill(worker.pid, signal.SIGKILL if failure == "killed" else signal.SIGSTOP)
        time.sleep(0.2)
        start = time.monotonic()
        with pytest.raises(ParallelPrefillError):
            g.prefill(ChunkJob("runahead", tuple(ids), even(40, 2)))
        assert time.monotonic() - start < 30
        assert g.closed
        with pytest.raises(ParallelPrefillError, match="closed"):
            g.prefill(ChunkJob("runahead", tuple(ids), even(40, 2)))
    finally:
        g.close()
    assert not any(w.is_alive() for w in g.workers)


@pytest.mark.slow
def test_a_worker_that_dies_before_reporting_is_noticed_within_seconds(tiny) -> None:
    """A worker gone after its sends (nothing left to break on the wire) fails the wait for its report at once,
    not at the 60 s timeout."""
    folder, loaded = tiny
    g = PrefillGroup(loaded.model, WorkerModel(str(folder), "float32", "dequant"), 2, threads_per_proc=1, timeout_s=60)
    try:
        worker = g.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(ParallelPrefillError, match=r"exited before reporting 'done' \(0: exit code -9\)"):
            g._collect("done", g.timeout_s)
        assert time.monotonic() - start < 5
    finally:
        g.close()
