"""Per-sequence grammar state: one xgrammar GrammarMatcher per sequence, its allowed tokens as a bitmask row."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar


def new_matcher(compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
    return xgrammar.GrammarMatcher(compiled)


def fill_bitmasks(matchers: Sequence[xgrammar.GrammarMatcher | None], vocab_size: int) -> list[torch.Tensor | None]:
    """The next-token bitmask (1, ceil(vocab / 32)) int32 of each row that has a matcher; None for the rest."""
    constrained = [i for i, m in enumerate(matchers) if m is not None]
    masks: list[torch.Tensor | None] = [None] * len(matchers)
    if not constrained:
        return masks
    bitmask = xgrammar.allocate_token_bitmask(len(constrained), vocab_size)  # (k, words)
    for j, i in enumerate(constrained):
        matchers[i].fill_next_token_bitmask(bitmask, j)
        masks[i] = bitmask[j : j + 1]
    return masks


def apply_bitmasks(logits: torch.Tensor, rows: Sequence[int], bitmasks: Sequence[torch.Tensor]) -> None:
    """Set to -inf, in place, the logits (B, V) float32 of tokens the grammar forbids, in ``rows`` only."""
    sub = logits[list(rows)]  # (k, V): a copy, so unconstrained rows are never touched
    xgrammar.apply_token_bitmask_inplace(sub, torch.cat(list(bitmasks)), vocab_size=logits.shape[-1])
    logits[list(rows)] = sub


def accept(matcher: xgrammar.GrammarMatcher, token_id: int) -> bool:
    """Advance the matcher by a sampled token; True once the grammar is complete (the sequence ends)."""
    if not matcher.accept_token(token_id):
        raise RuntimeError(f"the grammar matcher refused token {token_id}, which its own mask allowed")
    return matcher.is_terminated()
