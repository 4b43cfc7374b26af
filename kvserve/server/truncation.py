"""``truncate_prompt_tokens`` (vLLM's): keep only a prompt's last k tokens, so a long document fits the context.

The newest tokens are the ones kept (vLLM's default side): that is where a chat's question and a
completion's continuation point are. A PML prompt is laid out by its schema's positions and is never cut.
"""

from __future__ import annotations

from kvserve.server.errors import bad_request

FIELD = "truncate_prompt_tokens"


def check_keep(keep: int | None, max_model_len: int) -> None:
    """A 400 unless ``keep`` leaves at least one token of the context to generate."""
    if keep is not None and not 1 <= keep < max_model_len:
        raise bad_request(
            f"{FIELD} must be from 1 to {max_model_len - 1} (the context is {max_model_len} tokens and one must be "
            f"left to generate), got {keep}",
            FIELD,
        )


def truncate(ids: list[int], keep: int | None) -> list[int]:
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def refuse_pml(keep: int | None) -> None:
    if keep is not None:
        raise bad_request(f"{FIELD} cannot cut a PML prompt: its modules sit at their schema's positions", FIELD)
