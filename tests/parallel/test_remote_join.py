"""Workers joined torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): a ``kvserve prefill-worker``
process as rank 0 and the engine as the last rank, as they would run on two machines, here on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import ParallelPrefillError
from tests.parallel.conftest import prompt

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_engine_joins_a_prefill_worker_from_the_environment(tiny, monkeypatch) -> None:
    folder, _ = tiny
    ids = prompt(90)
    expected = LLM(model=str(folder), dtype="float32").generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "prefill-worker", "--model", str(folder), "--dtype", "float32",
         "--threads", "1"],
        env={**os.environ, **env, "RANK": "0"}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for name, value in {**env, "RANK": "1"}.items():
            monkeypatch.setenv(name, value)
        llm = LLM(model=str(folder), dtype="float32", prefill_parallel=2, prefill_partition="even")
        try:
            assert type(llm.engine.parallel_prefill.group).__name__ == "RemotePrefillGroup"
            got = llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            assert got == expected
            assert llm.engine.parallel_prefill.available  # it ran over the group, nothing failed
        finally:
            llm.engine.close()
        assert worker.wait(timeout=60) == 0, worker.stderr.read()  # told to stop, it exits cleanly
    finally:
        if worker.poll() is None:
            worker.kill()


def test_engine_must_be_the_last_rank(tiny, monkeypatch) -> None:
    folder, _ = tiny
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "3", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ParallelPrefillError, match="must be the last rank"):
        LLM(model=str(folder), dtype="float32", prefill_parallel=2, prefill_partition="even")
