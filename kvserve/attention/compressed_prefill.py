"""A compressing cache's prefill: a sequence's m new rows attend over its group's h cached slots plus themselves;
the policy scores the h + m candidates (its voting rows' attention, formed once for their output and the scores)
and, past the group's target, chooses which the layer keeps. With per-head budgets (Ada-KV) each KV head attends
over and keeps its own candidates (``head_budgets.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import UnsupportedKVOperation
from kvserve.attention.flash_prefill import flash_prefill_votes, use_flash_prefill
from kvserve.attention.head_budgets import head_candidates, pack, packed_slots
from kvserve.attention.paged import attend_prefill
from kvserve.policies.scoring import attend_voting_rows

if TYPE_CHECKING:
    from kvserve.attention.compressed_metadata import CompressedAttentionMetadata, CompressedSlab


class CompressedPrefill:
    """Attention of a sequence's several new rows in a compressing cache, and what its layer keeps of them."""

    def __init__(self, cache: CompressedSlab) -> None:
        self.cache = cache

    def run(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CompressedAttentionMetadata, i: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sequence's m rows: q (m, H, D), k/v (m, Hkv, D) -> output (m, H, D) and the rows going on."""
        c = self.cache
        policy, table = meta.policies[i], meta.block_tables[i][layer]
        held, target = c.step.held_after[i][layer], meta.group_targets[i][layer]
        window = c.layer_windows[layer]
        m = q.shape[0]
        ctx = c.slot_ids(table, 0, held, q.device)
        if held:
            cached_k, cached_v = c.read(ctx)
            keys, values = torch.cat((cached_k.to(q.dtype), k)), torch.cat((cached_v.to(q.dtype), v))  # (h + m, Hkv, D)
        else:
            keys, values = k, v
        num_candidates = held + m
        num_tokens = meta.context_lens[i] + meta.query_lens[i]
        votes = policy.votes(m, num_tokens) if window is None else None
        if votes is None:
            out, scores = attend_prefill(q, keys, values, held, window, c.softcap), None  # a window's: its latest
        else:
            out, head_sums = attend_voting(q, keys, values, held, *votes, c.softcap)
            previous = c.scores.index_select(0, ctx) if held else None
            scores = policy.scores_from(head_sums, held, previous)
        if scores is not None and scores.dim() == 1 and c.rank_mean is not None:  # the same on every rank
            scores = c.rank_mean(scores)
        if num_candidates <= target:
            c.write(c.slot_ids(table, held, num_candidates, q.device), k, v)
            if scores is not None:
                c.scores.index_copy_(0, c.slot_ids(table, 0, num_candidates, q.device), c.compaction.slot(scores))
            c.step.held_after[i][layer] = num_candidates
            return out, None
        frozen = meta.group_frozen[i][layer] if meta.group_frozen[i] else 0
        kept = c.compaction.choose(layer, policy, scores, num_candidates, target, num_tokens, frozen).to(q.device)
        c.compaction.write_kept(table, keys, values, scores, kept, frozen)
        c.step.held_after[i][layer] = target
        # Windows count positions: with sliding-window layers no row leaves the hidden states.
        if not policy.drops_rows or meta.keep_all_rows[i] or c.windowed:
            return out, None
        return out, kept[kept >= held] - held  # a row-dropping policy keeps the same tokens in every head

    def attend_heads(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CompressedAttentionMetadata, i: int
    ) -> torch.Tensor:
        """One sequence's m rows where its KV heads keep their own budgets (Ada-KV, ``attention/head_budgets.py``):
        q (m, H, D), k/v (m, Hkv, D) -> (m, H, D). Each KV head attends over its own candidates, and the rows' votes
        (the last ``window`` of a chunk; a lone decode row's own attention) rank them. A chunk within the layer's
        target is appended; past it, the heads' budgets are allocated anew and packed. Decode rows come here only
        when the packed tokens fill the target (``_decode_heads`` evicts among the later slots otherwise)."""
        c = self.cache
        policy, table = meta.policies[i], meta.block_tables[i][layer]
        if meta.group_frozen[i] and meta.group_frozen[i][layer]:
            raise UnsupportedKVOperation(f"kv_policy {policy.name!r} does not compress Prompt Cache modules' slots")
        held, target = c.step.held_after[i][layer], meta.group_targets[i][layer]
        counts = c.step.heads_after[i][layer]
        m, heads = q.shape[0], c.num_kv_heads
        group = q.shape[1] // heads
        ctx = c.slot_ids(table, 0, held, q.device)
        cached_k, cached_v = c.read(ctx) if held else (k[:0], v[:0])
        keys = head_candidates(cached_k.to(q.dtype), k, counts)
        values = head_candidates(cached_v.to(q.dtype), v, counts)
        first, row_weights = policy.votes(m, meta.context_lens[i] + m)
        out = torch.empty_like(q)
        votes = []  # per head: the votes its candidates got, (n_h,)
        for h in range(heads):
            qh, kh, vh = q[:, h * group : (h + 1) * group], keys[h][:, None], values[h][:, None]
            before = kh.shape[0] - m
            out[:, h * group : (h + 1) * group], sums = attend_voting(qh, kh, vh, before, first, row_weights, c.softcap)
            votes.append(sums[:, 0])
        if held + m <= target:  # a chunk that fits: appended as later slots, every head the same token
            later = torch.stack([votes[h][counts[h] if counts else 0 :] for h in range(heads)], dim=1).mean(dim=1)
            c.write(c.slot_ids(table, held, held + m, q.device), k, v)
            c.scores.index_copy_(0, c.slot_ids(table, packed_slots(counts), held + m, q.device), later)
            c.step.held_after[i][layer] = held + m
            return out
        chosen = policy.select_heads(votes, target)
        c.write(
            c.slot_ids(table, 0, target, q.device),
            pack([keys[h].index_select(0, kept.to(q.device)) for h, kept in enumerate(chosen)]),
            pack([values[h].index_select(0, kept.to(q.device)) for h, kept in enumerate(chosen)]),
        )
        c.step.heads_after[i][layer] = tuple(kept.numel() for kept in chosen)
        c.step.held_after[i][layer] = target
        return out


def attend_voting(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: int,
    first: int,
    row_weights: torch.Tensor,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's causal attention, q (m, H, D) over its h cached candidates and its own keys/values (h + m, Hkv, D),
    and its voting rows first..'s attention summed per KV head (h + m, Hkv) float32 (``scoring.head_column_sums``):
    in bfloat16 every row through the prefill kernel, which sums the votes from the same logits; otherwise the rows
    before the votes through ``attend_prefill`` and the voting rows' weights formed once, for their output and the
    sums (``scoring.attend_voting_rows``)."""
    if use_flash_prefill(q, keys):
        return flash_prefill_votes(q, keys, values, held, first, row_weights, softcap)
    out = torch.empty_like(q)
    if first:
        out[:first] = attend_prefill(q[:first], keys[: held + first], values[: held + first], held, softcap=softcap)
    out[first:], head_sums = attend_voting_rows(q, keys, values, held, first, row_weights, softcap)
    return out, head_sums
