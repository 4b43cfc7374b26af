"""The engine with ``prefill_parallel``: a long prompt's prefill runs over worker processes, the KV lands in
the paged cache, and decoding continues as usual: the greedy continuation equals single-process prefill's.
A failing worker makes the engine fall back to single-process prefill without losing the request."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.eval.data import AUSTEN
from tests.parallel.conftest import prompt

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def continuation(llm: LLM, ids: list[int]) -> list[int]:
    return llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("procs", [2, 3])
@pytest.mark.parametrize("partition", ["even", "tsp"])
def test_parallel_prefill_continues_like_single_process(tiny, partition, procs) -> None:
    folder, _ = tiny
    ids = prompt(91)  # not divisible by 2 or 3
    expected = continuation(LLM(model=str(folder), dtype="float32"), ids)
    llm = LLM(model=str(folder), dtype="float32", prefill_parallel=procs, prefill_partition=partition)
    group = llm.engine.parallel_prefill.group
    try:
        assert continuation(llm, ids) == expected
        # Too short to split (fewer than 16 tokens a process): prefilled locally, same result.
        assert continuation(llm, ids[:20]) == continuation(LLM(model=str(folder), dtype="float32"), ids[:20])
        assert llm.engine.parallel_prefill.available  # nothing failed
    finally:
        llm.engine.close()
    assert not any(w.is_alive() for w in group.workers)


@pytest.mark.slow
def test_dead_worker_falls_back_to_single_process_prefill(tiny, caplog) -> None:
    folder, _ = tiny
    ids = prompt(80)
    expected = continuation(LLM(model=str(folder), dtype="float32"), ids)
    llm = LLM(model=str(folder), dtype="float32", prefill_parallel=2, prefill_partition="even")
    llm.engine.parallel_prefill.supervisor.first_delay_s = 3600  # no restart in this test: test_worker_lifecycle
    group = llm.engine.parallel_prefill.group
    try:
        os.kill(group.workers[0].pid, signal.SIGKILL)
        group.workers[0].join(timeout=10)
        assert continuation(llm, ids) == expected  # the request completes, prefilled locally
        assert not llm.engine.parallel_prefill.available
        assert "falling back to single-process prefill" in caplog.text
    finally:
        llm.engine.close()
    assert not any(w.is_alive() for w in group.workers)


@pytest.mark.real_model
def test_worker_killed_mid_prefill_is_noticed_within_seconds(tiny) -> None:
    """A worker that dies while a prefill waits on it fails that prefill within seconds (not at the 60 s
    timeout); the step is recomputed locally and the request completes."""
    folder, _ = tiny
    ids = prompt(80)
    expected = continuation(LLM(model=str(folder), dtype="float32"), ids)
    llm = LLM(model=str(folder), dtype="float32", prefill_parallel=2, prefill_partition="even")
    parallel = llm.engine.parallel_prefill
    parallel.supervisor.first_delay_s = 3600  # no restart in this test
    group = parallel.group
    worker = group.workers[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)  # it gets the job but computes nothing: the prefill waits on it
        threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        assert continuation(llm, ids) == expected
        assert time.monotonic() - start < 10
        assert "the parallel prefill failed" in parallel.last_route.reason and not parallel.available
    finally:
        llm.engine.close()
    assert not any(w.is_alive() for w in group.workers)


@pytest.mark.real_model
def test_real_model_parallel_prefill_same_greedy_continuation(default_model, shared_real_loads) -> None:
    ids = default_model.tokenizer.encode(AUSTEN.read_text()[:4000])[:600]
    expected = continuation(LLM(dtype="float32"), ids)
    llm = LLM(dtype="float32", prefill_parallel=2, prefill_partition="even")
    try:
        assert continuation(llm, ids) == expected
    finally:
        llm.engine.close()
