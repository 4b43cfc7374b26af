"""Incremental detokenisation: text deltas as tokens arrive, never splitting a multi-byte character."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from kvserve.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Wraps ``tokenizers``' ``DecodeStream``, which holds back bytes until they form whole characters.

    The prompt's ids seed the stream so the first generated token decodes with its left context
    (leading spaces survive).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """The text that ``token_id`` completes; "" while a character is still partial."""
        return self._stream.step(self._tokenizer.backend, token_id) or ""
