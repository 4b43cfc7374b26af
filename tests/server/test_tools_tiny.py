"""Tool calling on the tiny model through the ``openai`` client: a named function and ``required`` are enforced by
the grammar, so even random weights produce calls whose arguments match their schema; streamed calls add up to
the same calls; bad tool definitions are a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from kvserve.server.api import build_app
from tests.server.conftest import TINY_NAME

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "[A-Za-z]{1,8}"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "[A-Z]{3}"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "A city's weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "what is the weather in paris?"}]


def ask(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("max_tokens", 120)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, tools=TOOLS, **kwargs)


def check_calls(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called_with_arguments_matching_its_schema(tiny_server):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = ask(tiny_server.client(), tool_choice=choice).choices[0]
    assert out.finish_reason == "tool_calls"
    assert out.message.content is None
    (call,) = out.message.tool_calls
    assert call.function.name == "get_weather"
    check_calls([call])


@pytest.mark.slow
def test_required_without_parallel_calls_makes_exactly_one_call(tiny_server):
    # (with parallel calls, random weights may go on adding calls until max_tokens: the real model's test has that)
    for seed in range(3):
        out = ask(tiny_server.client(), tool_choice="required", parallel_tool_calls=False, temperature=1, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1 and choice.message.tool_calls[0].function.name in SCHEMAS
        check_calls(choice.message.tool_calls)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_a_streamed_call_comes_as_openai_streams_it_and_adds_up_to_the_whole(tiny_server, tool_choice):
    client = tiny_server.client()
    kwargs = {"tool_choice": tool_choice, "parallel_tool_calls": False}
    whole = ask(client, **kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = []
    for chunk in ask(client, **kwargs, stream=True):
        for choice in chunk.choices:
            finish.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:  # the first chunk of a call: index, id, type and name
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert [c for c in finish if c] == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_auto_and_none_leave_the_text_as_content(tiny_server):
    client = tiny_server.client()
    for choice in ("auto", "none"):
        out = ask(client, tool_choice=choice, max_tokens=8).choices[0]
        assert out.finish_reason == "length"
        assert out.message.tool_calls is None and out.message.content


def test_a_tool_result_turn_is_accepted(tiny_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 18}'},
    ]
    client = tiny_server.client()
    out = client.chat.completions.create(model=TINY_NAME, messages=messages, tools=TOOLS, max_tokens=4)
    bare = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=4)
    assert out.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # the call and its result are in the prompt


GOOD = TOOLS[0]["function"]


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"tools": [{"type": "function", "function": dict(GOOD, name="get weather")}]}, "tools[0].function.name",
         "letters, digits"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "two tools are named"),
        ({"tools": [{"type": "function", "function": dict(GOOD, parameters={"type": 5})}]},
         "tools[0].function.parameters", "not a valid JSON schema"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0].function: Field required"),
        ({"tools": [{"type": "retrieval", "function": GOOD}]}, "tools", "tools[0].type: Input should be 'function'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "not among the tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice", "drop guided_regex"),
        ({"tools": TOOLS, "functions": [GOOD]}, "functions", "send tools and tool_choice instead"),
    ],
)  # fmt: skip
def test_bad_tool_definitions_are_a_400_naming_the_field(tiny_server, extra, param, words):
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert caught.value.body["param"] == param
    assert words in caught.value.body["message"]
    assert ask(client, tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls  # still serving


def test_a_bad_call_in_the_history_is_a_400_naming_it(tiny_server):
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_server.client().chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=2)
    assert caught.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_tokenize_counts_tools_and_calls_as_chat_does(tiny_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    body = {"model": TINY_NAME, "messages": messages, "tools": TOOLS}
    counted = httpx.post(tiny_server.url + "/tokenize", json=body, timeout=30).json()["count"]
    used = tiny_server.client().chat.completions.create(**body, max_tokens=1).usage.prompt_tokens
    bare = httpx.post(tiny_server.url + "/tokenize", json={"model": TINY_NAME, "messages": MESSAGES}, timeout=30)
    assert counted == used > bare.json()["count"] + 50


def test_tools_with_a_prompt_cache_prompt_are_a_400(tiny_server):
    messages = [{"role": "user", "content": '<prompt schema="doc">what is it?</prompt>'}]
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_server.client().chat.completions.create(model=TINY_NAME, messages=messages, tools=TOOLS, max_tokens=2)
    assert caught.value.body["param"] == "tools" and "Prompt Cache" in caught.value.body["message"]


def test_a_tool_call_parser_the_template_cannot_teach_is_refused_at_start(tiny_server):
    with pytest.raises(ValueError, match="renders no tools, so kvserve writes the tool prompt itself"):
        build_app(tiny_server.engine, TINY_NAME, tool_call_parser="llama3_json")
    with pytest.raises(ValueError, match="is not one of"):
        build_app(tiny_server.engine, TINY_NAME, tool_call_parser="xml")
