"""How tools and tool calls reach a chat prompt, for the server and ``LLM.chat`` alike.

A template that renders tools gets them as Hugging Face's ``apply_chat_template`` passes them: ``tools`` beside
the messages, an assistant's ``tool_calls`` with their arguments as objects, a tool message's ``tool_call_id``.
A template that renders none (SmolLM2's, Gemma 3's) gets them as Hermes-style text instead, the format Qwen2.5
and Hermes models are trained on: the tools in the system message in Qwen2.5's wording, calls as ``<tool_call>``
blocks in the assistant's content, results as ``<tool_response>`` blocks in a user turn (a user turn, not a
``tool`` one, since templates such as Gemma's accept only alternating user and assistant turns).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvserve.tokenizer import Tokenizer


def chat_prompt(
    tokenizer: Tokenizer, messages: Sequence[dict], add_generation_prompt: bool, tools: Sequence[dict] | None
) -> str:
    """The rendered chat; ``messages`` as Hugging Face templates read them, ``tools`` OpenAI's function tools."""
    if not renders_tools(tokenizer.chat_template):
        messages, tools = hermes_messages(messages, tools or ()), None
    return tokenizer.apply_chat_template(messages, add_generation_prompt, tools)


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


def hermes_messages(messages: list[dict], tools: Sequence[dict]) -> list[dict]:
    """The messages with their tools, calls and results written out as Hermes-style text."""
    out: list[dict] = []
    if tools:
        prompt = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": (messages[0].get("content") or "") + "\n\n" + prompt})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": prompt})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # results of one turn's calls share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        calls = [_hermes_call(c["function"]) for c in m.get("tool_calls") or ()]
        out.append({"role": m["role"], "content": "\n".join(filter(None, [m.get("content"), *calls]))})
    for m in out:
        m.pop("tool_results", None)
    return out


def _hermes_call(function: dict) -> str:
    arguments = function["arguments"]
    if isinstance(arguments, str):  # OpenAI's shape: the arguments' JSON text
        arguments = json.loads(arguments)
    call = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"
