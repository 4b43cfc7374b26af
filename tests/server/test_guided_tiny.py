"""Structured output over HTTP: OpenAI's response_format and vLLM's guided_* fields on both endpoints, sent by
the official ``openai`` client to a real server on loopback (tiny random model, so only the constraint makes
the output match); conflicting or bad constraints are a 400 naming the field, and the server goes on serving."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import openai
import pytest

from tests.server.conftest import TINY_NAME

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "[A-Za-z]{1,8}"},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "open": {"type": "boolean"},
    },
    "required": ["city", "rating", "open"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Rate a city as JSON."}]


def chat(client: openai.OpenAI, **kwargs):
    kwargs = {"max_tokens": 60, "seed": 1, **kwargs}
    return client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, **kwargs)


def complete(client: openai.OpenAI, **kwargs):
    kwargs = {"max_tokens": 60, "seed": 1, **kwargs}
    return client.completions.create(model=TINY_NAME, prompt="the answer is", **kwargs)


@pytest.mark.slow
def test_response_format_json_schema_on_chat_and_completions(tiny_server):
    client = tiny_server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "rating", "schema": SCHEMA, "strict": True}}
    reply = chat(client, response_format=fmt, n=2)
    texts = [c.message.content for c in reply.choices]
    texts.append(complete(client, extra_body={"response_format": fmt}).choices[0].text)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, response_format=fmt, stream=True))
    jsonschema.validate(json.loads(streamed), SCHEMA)


@pytest.mark.slow
def test_json_object_and_vllm_guided_fields(tiny_server):
    client = tiny_server.client()
    obj = complete(client, max_tokens=200, extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert obj.text.startswith("{") and (obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict))
    choices = ["sunny", "rainy day"]
    assert chat(client, extra_body={"guided_choice": choices}).choices[0].message.content in choices
    assert complete(client, extra_body={"guided_choice": choices}).choices[0].text in choices
    pattern = r"\d{3}-[a-z]{2,4}"
    assert re.fullmatch(pattern, chat(client, extra_body={"guided_regex": pattern}).choices[0].message.content)
    assert re.fullmatch(pattern, complete(client, extra_body={"guided_regex": pattern}).choices[0].text)
    for guided_json in (SCHEMA, json.dumps(SCHEMA)):  # an object or its JSON text, as vLLM takes it
        jsonschema.validate(
            json.loads(complete(client, extra_body={"guided_json": guided_json}).choices[0].text), SCHEMA
        )
    grammar = 'root ::= "yes" | "no"'
    assert chat(client, extra_body={"guided_grammar": grammar}).choices[0].message.content in ("yes", "no")
    assert chat(client, response_format={"type": "text"}, max_tokens=3).usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex, guided_choice", "only one structured"),
        (
            {"guided_json": SCHEMA, "response_format": {"type": "json_object"}},
            "guided_json, response_format",
            "only one structured output constraint",
        ),
        ({"guided_json": {"type": 5}}, "guided_json", "guided_json: json is not a valid JSON schema"),
        ({"guided_json": "{oops"}, "guided_json", "not a valid JSON schema"),
        ({"guided_regex": "(ab"}, "guided_regex", "not a valid regular expression"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar", "not a valid EBNF grammar"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "needs response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"guided_choice": ["a"], "use_beam_search": True, "n": 2, "temperature": 0}, "guided_choice", "beam search"),
        ({"functions": [{"name": "f"}]}, "functions", "send tools and tool_choice instead"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(tiny_server, extra, param, words):
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra_body=extra)
    assert caught.value.body["param"] == param
    assert words in caught.value.body["message"]
    assert chat(client, extra_body={"guided_choice": ["fine"]}).choices[0].message.content == "fine"


def test_a_server_without_xgrammar_refuses_constraints_naming_the_extra(tiny_server, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # an import of it now fails as if not installed
    with pytest.raises(openai.BadRequestError) as caught:
        chat(tiny_server.client(), extra_body={"guided_regex": "[0-9]+"})
    assert caught.value.body["param"] == "guided_regex"
    assert "pip install 'kvserve[structured]'" in caught.value.body["message"]
    assert chat(tiny_server.client(), max_tokens=2).usage.completion_tokens == 2
