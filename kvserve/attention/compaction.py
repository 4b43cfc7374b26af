"""A compressing cache's compaction: past its target, a layer's group keeps the policy's choice of its candidates
(a sliding-window layer its latest), written to the group's first slots in position order with their scores;
the first ``frozen`` slots (shared Prompt Cache module blocks) stay as they are."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvserve.policies.base import KVPolicy

if TYPE_CHECKING:
    from kvserve.attention.compressed_metadata import CompressedAttentionMetadata, CompressedSlab


class Compaction:
    """Which candidates a layer's group keeps past its target, written to its first slots with their scores."""

    def __init__(self, cache: CompressedSlab) -> None:
        self.cache = cache

    def compress_decoded(
        self, layer: int, meta: CompressedAttentionMetadata, seq: int,
        candidates: Callable[[], tuple[torch.Tensor, torch.Tensor]], scores: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """After a decode row: keep everything while the group is within its target, else the policy's choice
        among its ``candidates()`` (keys and values, read only then)."""
        c = self.cache
        n = c.step.held_after[seq][layer] + 1
        target = meta.group_targets[seq][layer]
        if n <= target:
            c.step.held_after[seq][layer] = n
            return
        keys, values = candidates()
        scores = None if scores is None else scores[:n]
        frozen = meta.group_frozen[seq][layer] if meta.group_frozen[seq] else 0
        policy, num_tokens = meta.policies[seq], meta.context_lens[seq] + 1
        kept = self.choose(layer, policy, scores, n, target, num_tokens, frozen).to(keys.device)
        self.write_kept(meta.block_tables[seq][layer], keys[:n], values[:n], scores, kept, frozen)
        c.step.held_after[seq][layer] = target

    def write_kept(
        self,
        table: tuple[int, ...],
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor | None,
        kept: torch.Tensor,
        frozen: int = 0,
    ) -> None:
        """Candidates ``kept`` (ascending) into the group's first slots; keys/values (n, Hkv, D) are copies. The
        first ``frozen`` (shared module slots, which ``kept`` starts with) are already in place and never written.
        ``kept`` (k,) keeps the same candidates in every KV head; (k, Hkv) each head's own (per-head policies, with
        per-head ``scores`` (n, Hkv)), so a slot holds different tokens in different heads."""
        c = self.cache
        kept = kept[frozen:]
        dst = c.slot_ids(table, frozen, frozen + kept.shape[0], keys.device)
        if kept.dim() == 1:
            c.write(dst, keys.index_select(0, kept), values.index_select(0, kept))
        else:
            rows = kept[:, :, None].expand(-1, -1, keys.shape[-1])  # (k, Hkv, D)
            c.write(dst, keys.gather(0, rows), values.gather(0, rows))
        if scores is not None:
            chosen = scores.index_select(0, kept) if kept.dim() == 1 else scores.gather(0, kept)
            c.scores.index_copy_(0, dst, self.slot(chosen))

    def choose(
        self, layer: int, policy: KVPolicy, scores: torch.Tensor | None, num_candidates: int, keep: int,
        num_tokens: int, frozen: int,
    ) -> torch.Tensor:  # fmt: skip
        """Which candidates ``layer`` keeps: a sliding-window layer its latest ``keep`` (all a window can see
        again), any other the policy's choice."""
        c = self.cache
        if c.layer_windows[layer] is not None:
            return torch.arange(num_candidates - keep, num_candidates)
        return _select(policy, scores, num_candidates, keep, num_tokens, frozen)

    def slot(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores as the per-slot record: (n,) as they are; per-head (n, Hkv) averaged over every rank's heads
        (what decoding folds each step's head-averaged attention into)."""
        c = self.cache
        if scores.dim() == 1:
            return scores
        mean = scores.mean(dim=1)
        return mean if c.rank_mean is None else c.rank_mean(mean)


def _select(
    policy: KVPolicy, scores: torch.Tensor | None, num_candidates: int, keep: int, num_tokens: int, frozen: int
) -> torch.Tensor:
    """The policy's choice of ``keep`` of a group's candidates (ascending), keeping the first ``frozen`` (shared
    Prompt Cache module slots, compressed when the module was encoded) and choosing among the rest."""
    if not frozen:
        return policy.select(scores, num_candidates, keep, num_tokens)
    rest_scores = None if scores is None else scores[frozen:]
    rest = policy.select(rest_scores, num_candidates - frozen, keep - frozen, num_tokens)
    shared = torch.arange(frozen, device=rest.device)
    return torch.cat((shared if rest.dim() == 1 else shared[:, None].expand(-1, rest.shape[1]), rest + frozen))
