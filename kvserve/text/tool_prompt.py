"""How tools and tool calls reach a chat prompt, for the server and ``LLM.chat`` alike.

A template that renders tools gets them as Hugging Face's ``apply_chat_template`` passes them: ``tools`` beside
the messages, an assistant's ``tool_calls`` with their arguments as objects, a tool message's ``tool_call_id``.
A template that renders none gets them as text kvserve writes, in one of two syntaxes (``prompt_syntax``):

- ``hermes`` (SmolLM2's template, and any other): the format Qwen2.5 and Hermes models are trained on, the tools
  in the system message in Qwen2.5's wording, calls as ``<tool_call>`` blocks in the assistant's content,
  results as ``<tool_response>`` blocks in a user turn;
- ``pythonic`` (a Gemma template): the format Google documents for Gemma, calls as a Python list
  ``[get_weather(city='Paris')]``, results as ``tool_output`` blocks in a user turn.

Results go in a user turn, not a ``tool`` one, since templates such as Gemma's accept only alternating user and
assistant turns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvserve.text.tokenizer import Tokenizer

SYNTAXES = ("hermes", "pythonic")  # what kvserve can write for a template that renders no tools


def chat_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[dict],
    add_generation_prompt: bool,
    tools: Sequence[dict] | None,
    syntax: str | None = None,
) -> str:
    """The rendered chat; ``messages`` as Hugging Face templates read them, ``tools`` OpenAI's function tools;
    ``syntax``: kvserve's tool prompt for a template that renders no tools (default: ``prompt_syntax``)."""
    template = tokenizer.chat_template
    if not renders_tools(template):
        syntax = syntax or prompt_syntax(template)
        if syntax not in SYNTAXES:
            raise ValueError(f"kvserve writes tool prompts in {' or '.join(SYNTAXES)} syntax, not {syntax!r}")
        write = pythonic_messages if syntax == "pythonic" else hermes_messages
        messages, tools = write(messages, tools or ()), None
    return tokenizer.apply_chat_template(messages, add_generation_prompt, tools)


def prompt_syntax(chat_template: str | None) -> str:
    """The syntax of kvserve's tool prompt for a template that renders no tools: Gemma's for a Gemma template."""
    return "pythonic" if chat_template and "<start_of_turn>" in chat_template else "hermes"


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template writes tools and tool calls itself (it reads ``tools`` or ``tool_calls``)."""
    return chat_template is not None and ("tools" in chat_template or "tool_calls" in chat_template)


HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


PYTHONIC_TOOLS_PROMPT = (
    "You have access to functions. To call one or more of them, answer with nothing but a Python list of calls "
    "with keyword arguments, in the format\n[func_name1(param_name1=value1, param_name2=value2), func_name2(...)]\n"
    "Write no other text in an answer that calls a function. The functions:\n{tools}"
)


def hermes_messages(messages: list[dict], tools: Sequence[dict]) -> list[dict]:
    """The messages with their tools, calls and results written out as Hermes-style text."""
    tools_text = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return _as_text(
        messages,
        HERMES_TOOLS_PROMPT.format(tools=tools_text) if tools else None,
        lambda calls: "\n".join(
            f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"
            for name, args in calls
        ),
        lambda result: f"<tool_response>\n{result}\n</tool_response>",
    )


def pythonic_messages(messages: list[dict], tools: Sequence[dict]) -> list[dict]:
    """The messages with their tools, calls and results written out in Gemma's Python-list style."""
    tools_text = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)
    return _as_text(
        messages,
        PYTHONIC_TOOLS_PROMPT.format(tools=tools_text) if tools else None,
        lambda calls: "[" + ", ".join(
            f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})" for name, args in calls
        ) + "]",
        lambda result: f"```tool_output\n{result}\n```",
    )  # fmt: skip


def _as_text(messages: list[dict], prompt: str | None, write_calls, write_result) -> list[dict]:  # noqa: ANN001
    """``messages`` with the tools' ``prompt`` in the system message, each assistant's calls written by
    ``write_calls([(name, arguments)])`` after its content, each result by ``write_result`` in a user turn."""
    out: list[dict] = []
    if prompt is not None:
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": (messages[0].get("content") or "") + "\n\n" + prompt})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": prompt})
    results_turn = None  # the user turn holding the results of one turn's calls
    for m in messages:
        if m["role"] == "tool":
            if results_turn is None:
                results_turn = {"role": "user", "content": write_result(m["content"])}
                out.append(results_turn)
            else:
                results_turn["content"] += "\n" + write_result(m["content"])
            continue
        results_turn = None
        calls = [(c["function"]["name"], _arguments(c["function"])) for c in m.get("tool_calls") or ()]
        written = write_calls(calls) if calls else None
        out.append({"role": m["role"], "content": "\n".join(filter(None, [m.get("content"), written]))})
    return out


def _arguments(function: dict) -> dict:
    arguments = function["arguments"]
    return json.loads(arguments) if isinstance(arguments, str) else arguments  # OpenAI's shape: JSON text
