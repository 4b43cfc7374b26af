"""Tool calling on the real default model (SmolLM2-135M-Instruct) over loopback, through the official ``openai``
client and the OpenAI Agents SDK: a call, its result, the next turn.

SmolLM2's chat template renders no tools, so kvserve writes Hermes' tool prompt into the system message and reads
``<tool_call>`` blocks back. At 135M parameters the model does not choose to call a tool on its own (``auto``
answers in text), so the calls here come from a named function or ``required``; its answers to a tool's result
are real, greedy and checked for the result's content.
"""

from __future__ import annotations

import json

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.structured import GuidedDecodingParams
from tests.server.conftest import start_server

pytestmark = pytest.mark.real_model

NAME = "SmolLM2-135M-Instruct"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": PARAMETERS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
RESULT = "It is 21 degrees and sunny in Paris."


@pytest.fixture(scope="module")
def server(default_model):
    running = start_server(LLMEngine(EngineConfig(kv_cache_memory="64MiB", swap_space=0), default_model), name=NAME)
    yield running
    running.stop()


def ask(server, messages=QUESTION, **kwargs):
    kwargs.setdefault("max_tokens", 60)
    return server.client().chat.completions.create(
        model=NAME, messages=messages, tools=[WEATHER, TIME], temperature=0, **kwargs
    )


def test_a_named_function_gets_the_city_from_the_question(server):
    choice = ask(server, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_required_picks_the_weather_tool_and_streams_it(server):
    whole = ask(server, tool_choice="required").choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    names, arguments, ids, finish = [], "", [], []
    for chunk in ask(server, tool_choice="required", stream=True):
        for choice in chunk.choices:
            finish.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                assert delta.index == 0
                ids += [delta.id] if delta.id else []
                names += [delta.function.name] if delta.function.name else []
                arguments += delta.function.arguments or ""
    assert names == ["get_weather"] and len(ids) == 1 and ids[0].startswith("call_")
    assert arguments == whole.message.tool_calls[0].function.arguments
    assert [f for f in finish if f] == ["tool_calls"]


def test_auto_answers_in_text_when_the_model_calls_nothing(server):
    choice = ask(server, tool_choice="auto", max_tokens=24).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.content.startswith("The weather in Paris")
    assert "<tool_call>" not in choice.message.content


def test_the_turn_after_a_tool_result_uses_the_result(server):
    call = ask(server, tool_choice="required").choices[0].message.tool_calls[0]
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    answer = ask(server, messages).choices[0]
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    assert "21 degrees" in answer.message.content


def test_an_agent_calls_the_tool_and_answers_from_its_result(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return RESULT

    client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        model=agents.OpenAIChatCompletionsModel(model=NAME, openai_client=client),
        tools=[get_weather],
        # the SDK resets tool_choice to auto after the call, so the second turn answers in text
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )
    result = agents.Runner.run_sync(agent, QUESTION[0]["content"], max_turns=3)
    assert cities == ["Paris"]
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert "21 degrees" in result.final_output


def test_llm_chat_takes_tools_as_the_server_does(server):
    llm = LLM.from_engine(server.engine.engine)
    params = SamplingParams(max_tokens=20, temperature=0, guided_decoding=GuidedDecodingParams(json=PARAMETERS))
    (out,) = llm.chat(QUESTION, params, use_tqdm=False, tools=[WEATHER, TIME])
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # Hermes' tool prompt: SmolLM2 renders none
    assert json.loads(out.outputs[0].text) == {"city": "Paris"}
    named = ask(server, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=20)
    assert named.usage.prompt_tokens == len(out.prompt_token_ids)  # the same prompt as the server's
