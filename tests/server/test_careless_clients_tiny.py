"""What a careless client sends, against a real server on loopback (tiny random model): chat messages with
roles or contents the API does not take, schema names no URL can reach, bad PML, and a client that hangs
up before its answer. Each gets a 400 naming the field, or nothing in the log, and the server keeps serving.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import TINY_NAME

SCHEMA = '<schema name="{name}"><module name="m">Some text to cache.</module></schema>'


def chat_error(server, messages: list[dict]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=2)
    return caught.value


def post_schema(server, name: str) -> httpx.Response:
    return httpx.post(server.base_url + "/schemas", json={"pml": SCHEMA.format(name=name)}, timeout=30)


# ----- chat messages -----


def test_an_unknown_role_is_a_400_naming_the_message(tiny_server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "wizard", "content": "abracadabra"}]  # fmt: skip
    error = chat_error(tiny_server, messages)
    assert error.param == "messages[2].role"
    assert "messages[2].role: 'wizard' is not one of system, developer, user, assistant, tool" in error.message


def test_null_content_is_a_400_except_for_an_assistant(tiny_server):
    error = chat_error(tiny_server, [{"role": "system", "content": "x"}, {"role": "user", "content": None}])
    assert error.param == "messages[1].content" and "a user message needs content" in error.message
    # OpenAI's assistant turn that held only tool calls has null content: it renders as an empty turn.
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]  # fmt: skip
    ok = tiny_server.client().chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_a_developer_message_renders_as_a_system_message(tiny_server):
    def chat(role: str):
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hello"}]
        return tiny_server.client().chat.completions.create(
            model=TINY_NAME, messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )

    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    expected = len(tiny_server.engine.engine.tokenizer.encode_chat(as_system))
    developer, system = chat("developer"), chat("system")
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens == expected
    assert developer.choices[0].message.content == system.choices[0].message.content
