"""Which chat messages the server takes, and what of them reaches the chat template.

The roles are OpenAI's: ``system``, ``developer`` (its newer name for system instructions, rendered as
``system``: chat templates know no ``developer``), ``user``, ``assistant`` and ``tool``. Content may be
null only for an assistant message (OpenAI's assistant turn that holds only tool calls); anything else
gets a 400 naming the message, rather than reaching the template as an empty or unknown turn.

Tool calls reach the template as Hugging Face passes them (``kvserve/text/tool_prompt.py``): an assistant's
``tool_calls`` with their arguments as objects, a tool message's ``tool_call_id``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from jinja2.exceptions import TemplateError

from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatMessage
from kvserve.text.tokenizer import Tokenizer
from kvserve.text.tool_prompt import chat_prompt

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
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    tools: Sequence[dict] | None,
    syntax: str | None = None,
) -> str:
    """The chat as the model reads it (one rendering for chat completions and ``/tokenize``); a 400 if the
    template refuses it. ``syntax``: the tool calls' (``server/tool_parsers.py``), for a template without tools."""
    try:
        return chat_prompt(tokenizer, template_messages(messages), add_generation_prompt, tools, syntax)
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
