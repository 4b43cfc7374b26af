"""The server's limits on the real default model (SmolLM2-135M-Instruct): a prompt near the body limit
goes through the real tokenizer while /health and an open stream keep going; stop token ids are checked
against its 49,152-token vocabulary."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from tests.server.conftest import start_server

pytestmark = pytest.mark.real_model

NAME = "SmolLM2-135M-Instruct"
VOCAB = 49152


@pytest.fixture(scope="module")
def server(default_model):
    running = start_server(LLMEngine(EngineConfig(kv_cache_memory="64MiB", swap_space=0), default_model), name=NAME)
    yield running
    running.stop()


def test_a_large_chat_does_not_stall_health_or_an_open_stream(server):
    text = "the quick brown fox jumps over the lazy dog. " * (DEFAULT_MAX_REQUEST_BYTES // 46)
    body = {"model": NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    kwargs = dict(model=NAME, prompt="Once upon a time", max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
    stream = server.client().completions.create(**kwargs, stream=True)
    next(iter(stream))  # the stream is running
    result: dict = {}

    def big() -> None:
        result["response"] = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)

    thread = threading.Thread(target=big)
    thread.start()
    health, gaps, last = [], [], time.monotonic()
    for _ in stream:
        now = time.monotonic()
        gaps.append(now - last)
        sent = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        health.append(time.monotonic() - sent)
        last = time.monotonic()
        if not thread.is_alive():
            break
    stream.close()
    thread.join()
    assert result["response"].status_code == 400 and result["response"].json()["error"]["param"] == "messages"
    assert max(gaps) < 1.0, f"an open stream stalled for {max(gaps):.2f} s while a chat was tokenised"
    assert max(health) < 1.0, f"/health took up to {max(health):.2f} s while a chat was tokenised"
    assert len(gaps) >= 3, "the large chat was answered too soon to test anything"


def test_stop_token_ids_beyond_the_vocabulary_are_a_400(server):
    body = {"model": NAME, "prompt": "hello", "max_tokens": 2, "stop_token_ids": [2, VOCAB]}
    response = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop_token_ids"
    assert str(VOCAB) in error["message"] and f"vocabulary of {VOCAB} tokens" in error["message"]
