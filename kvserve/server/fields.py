"""The rule for request fields kvserve does not implement: a 400 naming the field, never silently ignored.

A field kvserve implements is declared on its request model (``server/protocol.py``). Of the rest:

- metadata about the caller (``METADATA_FIELDS``) changes no answer, so it is accepted with any value;
- a field OpenAI or vLLM documents that kvserve does not implement (``UNSUPPORTED_FIELDS``) is accepted
  only with a value that asks for nothing (null, or the value that switches it off), so clients that send
  every default keep working; any other value is a 400;
- a field nobody documents (a misspelt ``max_token``) is a 400 as well: vLLM ignores it with a warning in
  its own log, which the client never sees, and answers as if it had not been sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

# What each value means is the provider's business; it never reaches the model or the sampler.
METADATA_FIELDS = frozenset(
    {
        "metadata",  # OpenAI: tags for a stored completion (kvserve stores none, see ``store``)
        "safety_identifier",  # OpenAI: an end-user id for abuse monitoring (the newer ``user``)
        "prompt_cache_key",  # OpenAI: a routing hint for its prompt cache; kvserve's prefix cache needs none
    }
)

# Field -> the values that ask for nothing (the field's "off"); anything else is a 400.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    # OpenAI
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    # vLLM
    "spaces_between_special_tokens": (None, True),
    "bad_words": (None, []),
    "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "add_special_tokens": (None, False),  # chat only: completions implement it
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "priority": (None, 0),
    "request_id": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    # llama.cpp's server: kvserve's prefix cache always reuses a cached prompt prefix
    "cache_prompt": (None, True),
}


def drop_ignorable(body: Mapping, declared: Mapping) -> dict:
    """``body`` without the fields that change nothing: metadata, and unsupported fields sent switched off.
    What is left and not ``declared`` is refused by the request model (``extra="forbid"``)."""
    return {name: value for name, value in body.items() if name in declared or not _ignorable(name, value)}


def _ignorable(name: str, value: object) -> bool:
    if name in METADATA_FIELDS:
        return True
    return any(_same(value, off) for off in UNSUPPORTED_FIELDS.get(name, ()))


def _same(value: object, off: object) -> bool:
    """Equal and of the same type (``0 == False`` in Python, not in JSON)."""
    return type(value) is type(off) and value == off


# Fields whose refusal points to what kvserve offers instead.
_INSTEAD = {
    name: "OpenAI's deprecated function calling; send tools and tool_choice instead"
    for name in ("functions", "function_call")
}


def unsupported_message(name: str) -> str:
    """The 400's message for a field kvserve refused (``name`` may be a path: ``stream_options.x``)."""
    if name in _INSTEAD:
        return f"'{name}' is not supported by kvserve: {_INSTEAD[name]}"
    offs = UNSUPPORTED_FIELDS.get(name.rsplit(".", 1)[-1])
    if offs is None:
        return f"'{name}' is not supported by kvserve: this endpoint has no such field"
    accepted = " or ".join(json.dumps(off) for off in offs)
    return f"'{name}' is not supported by kvserve (it is accepted only as {accepted}, which asks for nothing)"
