"""Which chat messages the server takes, and what of them reaches the chat template.

The roles are OpenAI's: ``system``, ``developer`` (its newer name for system instructions, rendered as
``system``: chat templates know no ``developer``), ``user``, ``assistant`` and ``tool``. Content may be
null only for an assistant message (OpenAI's assistant turn that holds only tool calls); anything else
gets a 400 naming the message, rather than reaching the template as an empty or unknown turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatMessage

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


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """The messages as a chat template reads them: role names it knows, content as one string."""
    return [{"role": _TEMPLATE_ROLE.get(m.role, m.role), "content": m.text()} for m in messages]
