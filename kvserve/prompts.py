"""What ``LLM.generate`` takes as prompts: text, token ids, or vLLM's ``TextPrompt`` / ``TokensPrompt`` dicts."""

from __future__ import annotations

from collections.abc import Sequence

PROMPT_KEYS = ("prompt", "prompt_token_ids")  # {"prompt": text} (TextPrompt), {"prompt_token_ids": [...]}

Prompt = str | Sequence[int] | dict[str, object]


def parse_prompts(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """One prompt or a list of them -> text or token ids per prompt; a bad prompt is a ValueError naming it."""
    if isinstance(prompts, str | dict) or _is_token_ids(prompts):
        prompts = [prompts]
    return [_parse_one(prompt, index) for index, prompt in enumerate(prompts)]


def _is_token_ids(value: object) -> bool:
    return isinstance(value, Sequence) and len(value) > 0 and isinstance(value[0], int)


def _parse_one(prompt: object, index: int) -> str | list[int]:
    if isinstance(prompt, dict):
        return _parse_dict(prompt, index)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        return _token_ids(prompt, index)
    raise ValueError(f"prompt {index} is a {type(prompt).__name__}; expected text, token ids or a prompt dict")


def _parse_dict(prompt: dict[str, object], index: int) -> str | list[int]:
    unknown = sorted(str(key) for key in prompt if key not in PROMPT_KEYS)
    if unknown:
        raise ValueError(f"prompt {index} has unknown keys {unknown}; a prompt dict takes one of {list(PROMPT_KEYS)}")
    if len(prompt) != 1:
        given = "both" if prompt else "neither"
        raise ValueError(f"prompt {index} has {given} of {list(PROMPT_KEYS)}; a prompt dict takes exactly one")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompt {index}: 'prompt' must be text, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    return _token_ids(prompt["prompt_token_ids"], index)


def _token_ids(ids: object, index: int) -> list[int]:
    if isinstance(ids, str) or not isinstance(ids, Sequence):
        raise ValueError(f"prompt {index}: token ids must be a list of integers, got {type(ids).__name__}")
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool)]
    if bad:
        raise ValueError(f"prompt {index}: token ids must be integers, got {bad[:5]!r}")
    return list(ids)
