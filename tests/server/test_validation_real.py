"""Careless requests against the server on the real default model (SmolLM2-135M-Instruct): its chat template
sees only roles it knows, and a bad role, a null user message or an unreachable schema name is a 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from tests.server.conftest import start_server

pytestmark = pytest.mark.real_model

NAME = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful assistant."
QUESTION = {"role": "user", "content": "What is the capital of France?"}


@pytest.fixture(scope="module")
def server(default_model):
    running = start_server(LLMEngine(EngineConfig(kv_cache_memory="64MiB", swap_space=0), default_model), name=NAME)
    yield running
    running.stop()


def test_a_developer_message_is_the_templates_system_message(server):
    """SmolLM2's template adds its own system prompt unless the first message is a system one."""

    def chat(role: str):
        messages = [{"role": role, "content": SYSTEM}, QUESTION]
        return server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)

    system_messages = [{"role": "system", "content": SYSTEM}, QUESTION]
    developer, system = chat("developer"), chat("system")
    assert developer.usage.prompt_tokens == len(server.engine.engine.tokenizer.encode_chat(system_messages))
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert "Paris" in developer.choices[0].message.content


@pytest.mark.parametrize(
    ("message", "param"),
    [({"role": "wizard", "content": "abracadabra"}, "messages[1].role"), ({"role": "user", "content": None},
      "messages[1].content")],
    ids=["unknown-role", "null-user-content"],
)  # fmt: skip
def test_bad_messages_are_a_400_naming_the_message(server, message, param):
    messages = [{"role": "user", "content": "hi"}, message]
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert caught.value.param == param and caught.value.body["message"].startswith(f"{param}:")


def test_a_schema_name_with_a_slash_is_refused(server):
    response = httpx.post(server.base_url + "/schemas", json={"pml": '<schema name="a/b">text</schema>'}, timeout=60)
    assert response.status_code == 400 and "schema name 'a/b' is not allowed" in response.json()["error"]["message"]
