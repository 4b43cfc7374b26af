"""The server on the real default model (SmolLM2-135M-Instruct): it answers, and greedy text equals ``LLM``."""

from __future__ import annotations

import pytest

import kvserve.entrypoints.llm
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from tests.server.conftest import start_server

pytestmark = pytest.mark.real_model

NAME = "SmolLM2-135M-Instruct"
OPTIONS = dict(kv_cache_memory="64MiB", swap_space=0)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_model):
    running = start_server(LLMEngine(EngineConfig(**OPTIONS), default_model), name=NAME)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def llm(default_model) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvserve.entrypoints.llm, "LLMEngine", lambda config: LLMEngine(config, loaded=default_model))
        return LLM(**OPTIONS)


def test_chat_knows_the_capital_of_france(server):
    response = server.client().chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in response.choices[0].message.content


def test_greedy_completions_equal_the_offline_api(server, llm):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    expected = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    response = server.client().completions.create(model=NAME, prompt=prompts, max_tokens=16, temperature=0)
    assert [c.text for c in response.choices] == [out.outputs[0].text for out in expected]
    assert response.usage.completion_tokens == sum(len(out.outputs[0].token_ids) for out in expected)


def test_streaming_chat(server):
    client = server.client()
    kwargs = dict(model=NAME, messages=QUESTION, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
