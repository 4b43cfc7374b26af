"""Tool calls read out of model text: each syntax whole, and streamed a character at a time (content never taken
back, argument fragments that add up to the final arguments), and what is not a call stays content."""

from __future__ import annotations

import json

import pytest

from kvserve.server.tool_parsers import check_parser, detect_parser, parse
from kvserve.text.tokenizer import Tokenizer
from kvserve.text.tool_prompt import chat_prompt, hermes_messages, renders_tools
from tests.tiny_models import build_tiny_tokenizer

CASES = {
    "hermes": (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
        '</tool_call>\n<tool_call>{"name": "f", "arguments": {"s": "}<tool_call>\\"{"}}</tool_call>',
        "Let me check. \n",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}; '
        '{"name": "f", "parameters": {"s": "}<tool_call>\\"{"}}',
        "",
    ),
    "mistral": (
        'Sure[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, '
        '{"name": "f", "arguments": {"s": "}<tool_call>\\"{"}}]',
        "Sure",
    ),
    "pythonic": ('\n```tool_code\n[get_weather(city="Paris", days=[1, 2]), f(s="}<tool_call>\\"{")]\n```', ""),
    "json": (
        '[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, '
        '{"name": "f", "arguments": {"s": "}<tool_call>\\"{"}}]',
        "",
    ),
}
SMOLLM2_LIKE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
EXPECTED = [("get_weather", {"city": "Paris", "days": [1, 2]}), ("f", {"s": '}<tool_call>"{'})]


@pytest.mark.parametrize("parser", CASES)
def test_every_syntax_reads_both_calls_and_the_content(parser):
    text, content = CASES[parser]
    parsed = parse(parser, text, final=True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == EXPECTED
    assert all(c.complete for c in parsed.calls)


@pytest.mark.parametrize("parser", CASES)
def test_streamed_a_character_at_a_time_the_pieces_add_up_to_the_whole(parser):
    text, _ = CASES[parser]
    final = parse(parser, text, final=True)
    content, arguments, names = "", {}, {}
    for end in range(len(text) + 1):
        parsed = parse(parser, text[:end], final=end == len(text))
        assert parsed.content.startswith(content), "content already sent was taken back"
        content = parsed.content
        for i, call in enumerate(parsed.calls):
            assert call.arguments.startswith(arguments.get(i, "")), "an argument fragment was taken back"
            arguments[i] = call.arguments
            if call.name is not None:
                assert names.setdefault(i, call.name) == call.name
    assert content == final.content
    assert [arguments[i] for i in range(len(final.calls))] == [c.arguments for c in final.calls]
    assert [names[i] for i in range(len(final.calls))] == [c.name for c in final.calls]


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", "The weather is fine, no <tool_call> needed"),
        ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
        ("llama3_json", 'Sure: {"name": "f", "parameters": {}}'),
        ("llama3_json", '{"name": "f", "parameters": {'),
        ("mistral", "[1] is a citation"),
        ("json", '[{"name": "f", "arguments": 3}]'),
        ("pythonic", "[1] is a citation"),
        ("pythonic", "[get_weather(city=paris)]"),
        ("pythonic", '[get_weather("Paris")]'),
    ],
)
def test_what_is_not_a_whole_call_stays_content(parser, text):
    parsed = parse(parser, text, final=True)
    assert parsed.calls == []
    assert parsed.content == text


def test_a_possible_start_of_a_call_is_held_back_while_streaming():
    assert parse("hermes", "Hello <tool_c", final=False).content == "Hello "
    assert parse("hermes", "Hello <tool_c", final=True).content == "Hello <tool_c"
    assert parse("mistral", "Hi [TOOL", final=False).content == "Hi "


def test_the_syntax_comes_from_the_template():
    assert detect_parser("{% if tools %}{{ '[TOOL_CALLS]' }}{% endif %}") == "mistral"
    assert detect_parser("{{ '<|python_tag|>' }}{% if tools %}{% endif %}") == "llama3_json"
    assert detect_parser("{% for tool in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_parser("{% if tools %}[func_name1(params_name1=params_value1){% endif %}") == "pythonic"
    # a template that renders no tools: the syntax of kvserve's own prompt, Gemma's for a Gemma template
    assert detect_parser("{{ '<start_of_turn>user' }}") == "pythonic"
    assert detect_parser(SMOLLM2_LIKE) == "hermes"
    assert detect_parser(None) == "hermes"


def test_a_parser_the_template_cannot_take_is_refused():
    check_parser("pythonic", SMOLLM2_LIKE)
    check_parser("mistral", "{% if tools %}[TOOL_CALLS]{% endif %}")
    with pytest.raises(ValueError, match="renders no tools, so kvserve writes the tool prompt itself"):
        check_parser("llama3_json", SMOLLM2_LIKE)
    with pytest.raises(ValueError, match="is not one of"):
        check_parser("json", SMOLLM2_LIKE)


QWEN_LIKE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    ]},
    {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
]  # fmt: skip


def test_a_template_that_renders_tools_gets_them_as_hugging_face_passes_them():
    tokenizer = Tokenizer(backend=build_tiny_tokenizer(), chat_template=QWEN_LIKE)
    assert renders_tools(QWEN_LIKE)
    text = tokenizer.apply_chat_template(TURN, add_generation_prompt=False, tools=TOOLS)
    # (the template environment trims the newline after a block tag, as Hugging Face's does)
    call = '<call get_weather {"city": "Paris"}>'
    assert text == f"TOOLS:get_weather;user:Weather in Paris?assistant:{call}tool:18 C[call_1]"


def test_a_template_that_renders_no_tools_gets_hermes_text():
    system = {"role": "system", "content": "Be brief."}
    messages = hermes_messages([system, *TURN, dict(TURN[2], content="19 C")], TOOLS)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in messages[0]["content"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[2]["content"] == call
    assert messages[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n19 C\n</tool_response>"
    assert not renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")


GEMMA_LIKE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}"
)


def test_a_gemma_template_gets_gemmas_python_list_style():
    tokenizer = Tokenizer(backend=build_tiny_tokenizer(), chat_template=GEMMA_LIKE)
    text = chat_prompt(tokenizer, TURN, add_generation_prompt=False, tools=TOOLS)
    assert "a Python list of calls with keyword arguments" in text and '"name": "get_weather"' in text
    assert "<start_of_turn>model\n[get_weather(city='Paris')]<end_of_turn>" in text
    assert "<start_of_turn>user\n```tool_output\n18 C\n```<end_of_turn>" in text
    assert parse("pythonic", "[get_weather(city='Paris')]", final=True).calls[0].arguments == '{"city": "Paris"}'
