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
        candidates: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], scores: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """After a decode row: keep everything while the group is within its target, else the policy's choice
        among its candidates, every one in its slot (the new key included). ``candidates(index)`` reads the keys
        and values of candidates ``index`` (k,): only those that move are read and written, since the kept ones
        before the first dropped candidate are already where compaction puts them (with their scores)."""
        c = self.cache
        n = c.step.held_after[seq][layer] + 1
        target = meta.group_targets[seq][layer]
        if n <= target:
            c.step.held_after[seq][layer] = n
            return
        scores = None if scores is None else scores[:n]
        frozen = meta.group_frozen[seq][layer] if meta.group_frozen[seq] else 0
        policy, num_tokens = meta.policies[seq], meta.context_lens[seq] + 1
        kept = self.choose(layer, policy, scores, n, target, num_tokens, frozen)
        c.step.held_after[seq][layer] = target
        if kept.dim() == 2:  # per-head choices: each head's tokens move apart
            keys, values = candidates(torch.arange(n))
            self.write_kept(meta.block_tables[seq][layer], keys, values, scores, kept, frozen)
            return
        # kept is ascending, so kept[j] == j holds exactly for a prefix: those slots stay.
        stay = int((kept == torch.arange(target, device=kept.device)).sum())
        moved = kept[stay:]
        keys, values = candidates(moved)
        dst = c.slot_ids(meta.block_tables[seq][layer], stay, target, keys.device)
        c.write(dst, keys, values)
        if scores is not None:
            c.scores.index_copy_(0, dst, self.slot(scores.index_select(0, moved.to(scores.device))))

    def candidates(
        self, table: tuple[int, ...], count: int
    ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """A reader of the keys and values of a group's first ``count`` slots, by candidate index (for
        ``compress_decoded``)."""
        c = self.cache
        return lambda index: c.read(c.slot_ids(table, 0, count, c.device).index_select(0, index.to(c.device)))

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
        else:  # each head's rows picked from the (n * Hkv, D) rows: index_select copies whole rows of D
            heads = kept.shape[1]
            rows = (kept * heads + torch.arange(heads, device=kept.device)).view(-1)  # (k * Hkv,)
            shape = (kept.shape[0], heads, keys.shape[-1])
            c.write(
                dst,
                keys.flatten(0, 1).index_select(0, rows).view(shape),
                values.flatten(0, 1).index_select(0, rows).view(shape),
            )
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
