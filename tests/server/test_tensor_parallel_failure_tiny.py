"""A tensor-parallel server (size 2, tiny model) whose worker is killed mid-request: the running request ends
with a clear error, ``/health`` answers 503 with the reason, the Prometheus gauge drops to 0, new requests are
refused, and no worker process is left once the server stops."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import openai
import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from tests.server.conftest import TINY_NAME, TINY_OPTIONS, start_server, wait_until


@pytest.mark.slow
def test_a_killed_rank_is_reported_and_nothing_is_left_behind(tiny_folder) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_folder), tensor_parallel_size=2, **TINY_OPTIONS))
    server = start_server(engine)
    worker = engine.tensor_parallel.workers[0]
    try:
        assert server.metrics()["kvserve:tensor_parallel_up"] == 1.0
        client = server.client(timeout=60)
        failure: list[BaseException] = []

        def long_request() -> None:
            try:
                client.completions.create(
                    model=TINY_NAME, prompt="the cat", max_tokens=900, extra_body={"ignore_eos": True}
                )
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                failure.append(exc)

        thread = threading.Thread(target=long_request)
        thread.start()
        wait_until(lambda: engine.scheduler.running, timeout=30)
        os.kill(worker.pid, signal.SIGKILL)
        thread.join(timeout=60)
        assert len(failure) == 1 and isinstance(failure[0], openai.InternalServerError)
        assert "tensor-parallel group is lost" in str(failure[0])

        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "tensor-parallel group is lost" in health.text
        assert server.metrics()["kvserve:tensor_parallel_up"] == 0.0
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=TINY_NAME, prompt="the cat", max_tokens=4)
        assert refused.value.status_code == 503 and "lost" in str(refused.value)
    finally:
        server.stop()
        engine.close()
    assert not worker.is_alive()
