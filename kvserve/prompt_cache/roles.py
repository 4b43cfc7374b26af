"""PML role tags as the model's own chat format: the text its chat template puts around each role.

The template is rendered with sentinel contents and cut around them, so ``<user>hi</user>`` becomes
exactly what ``apply_chat_template`` writes for a user turn (``<|im_start|>user\\nhi<|im_end|>\\n`` for
ChatML). A role's prefix is taken after a system turn, so a template that adds a default system
prompt to conversations without one does not add it to every role tag. What a template writes before any
turn (Gemma's and Llama 3's ``{{ bos_token }}``) is the sequence's opening, not a role's: it is kept apart
(``opening``), and the schema opens with it once (``SchemaLayout.build``), so ``<system>`` adds no second BOS.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.prompt_cache.pml import PMLError
from kvserve.text.tokenizer import Tokenizer

_SENTINELS = {"system": "\x00SYSTEM\x00", "user": "\x00USER\x00", "assistant": "\x00ASSISTANT\x00"}


@dataclass(frozen=True)
class RoleFrames:
    prefix: dict[str, str]  # role -> text before its content
    suffix: dict[str, str]  # role -> text after its content
    generation_prompt: str  # what opens the model's turn after a user turn
    opening: str = ""  # what the template writes before the first turn (a BOS token's text), or ""

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> RoleFrames | None:
        """None when the model has no chat template (role tags are then an error)."""
        if not tokenizer.chat_template:
            return None
        turns = [{"role": role, "content": sentinel} for role, sentinel in _SENTINELS.items()]
        rendered = [tokenizer.apply_chat_template(turns[:n], add_generation_prompt=False) for n in range(4)]
        prefix, suffix = {}, {}
        # An empty conversation may render a default system prompt (Qwen's) rather than an opening: then none.
        opening = rendered[0] if rendered[1].startswith(rendered[0]) else ""
        for n, (role, sentinel) in enumerate(_SENTINELS.items()):
            before, found, after = rendered[n + 1].partition(sentinel)
            start = rendered[n] if n else opening
            if not found or not before.startswith(start):
                raise PMLError(f"the chat template does not render a {role!r} turn around its content")
            prefix[role] = before[len(start) :]
            suffix[role] = after
        with_prompt = tokenizer.apply_chat_template(turns[:2], add_generation_prompt=True)
        return cls(prefix, suffix, with_prompt[len(rendered[2]) :], opening)
