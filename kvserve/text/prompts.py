"""What ``LLM.generate`` takes as prompts: text, token ids, or vLLM's ``TextPrompt`` / ``TokensPrompt`` dicts
(which may carry a ``cache_salt``, as vLLM's do)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core.isolation import check_cache_salt

PROMPT_KEYS = ("prompt", "prompt_token_ids")  # {"prompt": text} (TextPrompt), {"prompt_token_ids": [...]}
OPTION_KEYS = ("cache_salt",)  # beside either: prefix-cache blocks are shared only among prompts of one salt

Prompt = str | Sequence[int] | dict[str, object]


@dataclass(frozen=True)
class ParsedPrompt:
    prompt: str | list[int]
    cache_salt: str | None = None


def parse_prompts(prompts: Prompt | Sequence[Prompt]) -> list[ParsedPrompt]:
    """One prompt or a list of them -> text or token ids per prompt; a bad prompt is a ValueError naming it."""
    if isinstance(prompts, str | dict) or _is_token_ids(prompts):
        prompts = [prompts]
    return [_parse_one(prompt, index) for index, prompt in enumerate(prompts)]


def _is_token_ids(value: object) -> bool:
    return isinstance(value, Sequence) and len(value) > 0 and isinstance(value[0], int)


def _parse_one(prompt: object, index: int) -> ParsedPrompt:
    if isinstance(prompt, dict):
        return _parse_dict(prompt, index)
    if isinstance(prompt, str):
        return ParsedPrompt(prompt)
    if isinstance(prompt, Sequence):
        return ParsedPrompt(_token_ids(prompt, index))
    raise ValueError(f"prompt {index} is a {type(prompt).__name__}; expected text, token ids or a prompt dict")


def _parse_dict(prompt: dict[str, object], index: int) -> ParsedPrompt:
    unknown = sorted(str(key) for key in prompt if key not in PROMPT_KEYS + OPTION_KEYS)
    if unknown:
        raise ValueError(
            f"prompt {index} has unknown keys {unknown}; a prompt dict takes one of {list(PROMPT_KEYS)} "
            f"and optionally {list(OPTION_KEYS)}"
        )
    given = [key for key in PROMPT_KEYS if key in prompt]
    if len(given) != 1:
        which = "both" if given else "neither"
        raise ValueError(f"prompt {index} has {which} of {list(PROMPT_KEYS)}; a prompt dict takes exactly one")
    salt = prompt.get("cache_salt")
    try:
        check_cache_salt(salt)
    except ValueError as exc:
        raise ValueError(f"prompt {index}: {exc}") from None
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompt {index}: 'prompt' must be text, got {type(prompt['prompt']).__name__}")
        return ParsedPrompt(prompt["prompt"], salt)
    return ParsedPrompt(_token_ids(prompt["prompt_token_ids"], index), salt)


def _token_ids(ids: object, index: int) -> list[int]:
    if isinstance(ids, str) or not isinstance(ids, Sequence):
        raise ValueError(f"prompt {index}: token ids must be a list of integers, got {type(ids).__name__}")
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool)]
    if bad:
        raise ValueError(f"prompt {index}: token ids must be integers, got {bad[:5]!r}")
    return list(ids)
