"""Which chat messages the server takes, and what of them reaches the chat template.

The roles are OpenAI's: ``system``, ``developer`` (its newer name for system instructions, rendered as
``system``: chat templates know no ``developer``), ``user``, ``assistant`` and ``tool``. Content may be
null only for an assistant message (OpenAI's assistant turn that holds only tool calls); anything else
gets a 400 naming the message, rather than reaching the template as an empty or unknown turn.

Tool calls reach a template that renders tools as Hugging Face passes them: ``tools`` beside the messages,
an assistant's ``tool_calls`` with their arguments as objects, a tool message's ``tool_call_id``. A template
that renders no tools (SmolLM2's, Gemma 3's) gets them as Hermes-style text instead, the format Qwen2.5 and
Hermes models are trained on: the tools in the system message, calls as ``<tool_call>`` blocks in the
assistant's content, results as ``<tool_response>`` blocks in a user turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from jinja2.exceptions import TemplateError

from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatMessage
from kvserve.tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
_TEMPLATE_ROLE = {"developer": "system"}


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """Raise a 400 naming the first message with a role or a null content the API does not accept."""
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if message.role not in ROLES:
            raise bad_request(f"{where}.role: {message.role!r} is not one of {', '.join(ROLES)}", f"{where}.role")
        if message.content is None and message.role != "assistant":
            raise bad_request(
                f"{where}.content: a {message.role} message needs content (a string or a list of text parts); "
                "only an assistant message may have null content",
                f"{where}.content",
            )
        for j, call in enumerate(message.tool_calls or ()):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                field = f"{where}.tool_calls[{j}].function.arguments"
                raise bad_request(f"{field} must be a JSON object's text, got {call.function.arguments!r}", field)


def render_chat(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool, tools: Sequence[dict] | None
) -> str:
    """The chat as the model reads it (one rendering for chat completions and ``/tokenize``); a 400 if the
    template refuses it."""
    entries = template_messages(messages)
    if not renders_tools(tokenizer.chat_template):
        entries, tools = hermes_messages(entries, tools or ()), None
    try:
        return tokenizer.apply_chat_template(entries, add_generation_prompt, tools)
    except (TemplateError, ValueError) as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None


def template_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """The messages as a chat template reads them: role names it knows, content as one string, tool calls
    and tool results as Hugging Face templates take them."""
    out = []
    for m in messages:
        entry: dict = {"role": _TEMPLATE_ROLE.get(m.role, m.role), "content": m.text()}
        if m.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in m.tool_calls
            ]  # fmt: skip
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            entry["name"] = m.name
        out.append(entry)
    return out


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
    """``template_messages``' output written out as Hermes-style text, for a template that renders no tools."""
    out: list[dict] = []
    if tools:
        prompt = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + prompt})
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
        calls = [
            "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                          ensure_ascii=False) + "\n</tool_call>"
            for c in m.get("tool_calls", ())
        ]  # fmt: skip
        out.append({"role": m["role"], "content": "\n".join(filter(None, [m["content"], *calls]))})
    for m in out:
        m.pop("tool_results", None)
    return out
