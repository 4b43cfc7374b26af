"""A compressing cache's decode rows: one new row per sequence, batched per layer through the paged decode kernel
over each group's blocks (the device slab in place, or the blocks fetched from the tier); the step's attention
folds into the slots' scores, and a group past its target is compacted. A decode-only step on the device slab can
run its layers as one call (``models/decode_chain.py``): ``in_place_decode`` hands it every layer's tables, and
``finish_in_place_decode`` does the rest for every layer at once."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.attention.backend import AttentionMetadata, InPlaceDecode
from kvserve.attention.decode import merge_attention, paged_decode, paged_decode_lse
from kvserve.attention.head_budgets import packed_slots
from kvserve.attention.softcap import cap_logits
from kvserve.attention.step_layout import pad_tables
from kvserve.platform.cpu_kernels import cpu_kernels_available
from kvserve.policies.base import SCORES_NONE, KVPolicy, update_scores

if TYPE_CHECKING:
    from kvserve.attention.compressed_metadata import CompressedAttentionMetadata, CompressedSlab


class CompressedDecode:
    """A compressing cache's decode rows, batched per layer, and a decode step's layers run as one call."""

    def __init__(self, cache: CompressedSlab) -> None:
        self.cache = cache

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: CompressedAttentionMetadata,
        seqs: list[int],
    ) -> torch.Tensor:
        """One new row per sequence in ``seqs``: q (B, H, D), k/v (B, Hkv, D) -> (B, H, D)."""
        c = self.cache
        batch = q.shape[0]
        bs, device = c.block_size, q.device
        held = [c.step.held_after[i][layer] for i in seqs]
        tables = [meta.block_tables[i][layer] for i in seqs]
        policies = [meta.policies[i] for i in seqs]
        window = c.layer_windows[layer]
        scoring = window is None and any(p.scores != SCORES_NONE for p in policies)
        # The new token goes to slot h first (the scheduler reserved it even where the layer then compresses),
        # so one pass reads the whole candidate set.
        new_slots = torch.tensor([t[h // bs] * bs + h % bs for t, h in zip(tables, held, strict=True)], device=device)
        c.write(new_slots, k, v)
        if scoring:
            c.scores.index_fill_(0, new_slots, 0.0)  # a new slot has no history (the entry is stale)
        width = max(h // bs + 1 for h in held)
        padded = pad_tables(tables, width, device)  # (B, W) int32; padding (block 0) is past each row's end
        ends = torch.tensor(held, dtype=torch.int32, device=device) + 1
        starts = torch.zeros_like(ends) if window is None else (ends - window).clamp(min=0)  # the window's first
        k_slab, v_slab, read_tables = self.decode_source(padded)
        out, weights = paged_decode(
            q, k_slab, v_slab, read_tables, starts, ends, want_weights=scoring, softcap=c.softcap
        )
        scores = self.fold_scores(policies, padded, ends, weights) if scoring else None
        length = width * bs
        fetched = (
            None
            if c.tier is None
            else (k_slab.view(batch, length, *k.shape[1:]), v_slab.view(batch, length, *v.shape[1:]))
        )

        def fetched_rows(b: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # row b's candidates
            index = index.to(fetched[0].device)  # already fetched from the tier for the attention above
            return fetched[0][b].index_select(0, index), fetched[1][b].index_select(0, index)

        for b, seq in enumerate(seqs):
            row_scores = None if scores is None else scores[b]
            if fetched is None:
                rows = c.compaction.candidates(tables[b], held[b] + 1)
            else:
                rows = partial(fetched_rows, b)
            c.compaction.compress_decoded(layer, meta, seq, rows, row_scores)
        return out

    def decode_heads(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: CompressedAttentionMetadata,
        seqs: list[int],
    ) -> torch.Tensor:
        """One new row per sequence in ``seqs`` whose KV heads are packed at ``layer``: q (B, H, D), k/v (B, Hkv, D)
        -> (B, H, D). Two kernel calls read the slab in place: the later slots (every head the same token, the new
        one included) as usual, and each KV head's packed run with the slab seen as runs of one head ((blocks,
        block_size * Hkv, 1, D): the packing's order); their softmaxes merge by log-sum-exp. The later slots' scores
        fold in the step's attention (as ``_fold_scores``); past the target, they evict among themselves by it (as
        SnapKV's decode) and the packed tokens stay."""
        c = self.cache
        batch, heads, dim = q.shape[0], c.num_kv_heads, c.head_dim
        group, bs, device = q.shape[1] // heads, c.block_size, q.device
        held = [c.step.held_after[i][layer] for i in seqs]
        tables = [meta.block_tables[i][layer] for i in seqs]
        counts = [c.step.heads_after[i][layer] for i in seqs]
        packed = [packed_slots(c) for c in counts]
        policies = [meta.policies[i] for i in seqs]
        new_slots = torch.tensor([t[h // bs] * bs + h % bs for t, h in zip(tables, held, strict=True)], device=device)
        c.write(new_slots, k, v)
        c.scores.index_fill_(0, new_slots, 0.0)  # a new slot has no history (the entry is stale)
        width = max(h // bs + 1 for h in held)
        padded = pad_tables(tables, width, device)
        k_slab, v_slab, read_tables = self.decode_source(padded)
        ends = torch.tensor(held, dtype=torch.int32, device=device) + 1
        firsts = torch.tensor(packed, dtype=torch.int32, device=device)
        later, later_lse = paged_decode_lse(q, k_slab, v_slab, read_tables, firsts, ends, c.softcap)
        run_starts = torch.tensor([[sum(c[:h]) for h in range(heads)] for c in counts], dtype=torch.int32)
        run_ends = run_starts + torch.tensor(counts, dtype=torch.int32)
        run_view = (k_slab.shape[0], bs * heads, 1, dim)
        runs, runs_lse = paged_decode_lse(
            q.reshape(batch * heads, group, dim), k_slab.view(run_view), v_slab.view(run_view),
            read_tables.repeat_interleave(heads, dim=0), run_starts.view(-1).to(device), run_ends.view(-1).to(device),
            c.softcap,
        )  # fmt: skip
        runs, runs_lse = runs.view_as(q), runs_lse.view(batch, -1)
        out = merge_attention(later, later_lse, runs, runs_lse)
        # The later slots' attention averaged over query heads, folded into their scores.
        length = max(e - p for e, p in zip(ends.tolist(), packed, strict=True))
        offsets = torch.arange(length, device=device)
        position = firsts.long()[:, None] + offsets  # (B, L)
        valid = offsets[None, :] < (ends - firsts).long()[:, None]
        position = torch.where(valid, position, 0)
        block = position // bs
        slots = padded.long().gather(1, block) * bs + position % bs  # in the slab
        read = read_tables.long().gather(1, block) * bs + position % bs  # in what was read
        keys = k_slab.reshape(-1, heads, dim).index_select(0, read.view(-1)).view(batch, length, heads, dim)
        scale = 1.0 / dim**0.5
        logits = torch.einsum("bhgd,blhd->bhgl", q.view(batch, heads, group, dim).float() * scale, keys.float())
        logits = cap_logits(logits, c.softcap)
        lse = torch.logaddexp(later_lse, runs_lse).view(batch, heads, group, 1)
        weights = torch.exp(logits - lse).mean(dim=(1, 2)) * valid  # (B, L)
        scores = update_scores(policies, c.scores.index_select(0, slots.view(-1)).view_as(slots), weights)
        c.scores.index_copy_(0, slots[valid], scores[valid])
        for b, seq in enumerate(seqs):
            n, target, table = held[b] + 1, meta.group_targets[seq][layer], tables[b]
            if n <= target:
                c.step.held_after[seq][layer] = n
            elif target > packed[b]:  # evict among the later slots
                count = n - packed[b]
                rest = policies[b].select(scores[b, :count], count, target - packed[b], meta.context_lens[seq] + 1)
                kept = slots[b].index_select(0, rest.to(device))
                dst = c.slot_ids(table, packed[b], target, device)
                c.write(dst, *c.read(kept))
                c.scores.index_copy_(0, dst, c.scores.index_select(0, kept))
                c.step.held_after[seq][layer] = target
            else:  # nothing but packed slots fits: allocate the heads anew (the row attends again, rarely)
                out[b] = c.prefill.attend_heads(layer, q[b : b + 1], k[b : b + 1], v[b : b + 1], meta, seq)[0]
        return out

    def fold_scores(
        self, policies: Sequence[KVPolicy], tables: torch.Tensor, ends: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Fold a decode step's attention ``weights`` (R, T), each slot's probability averaged over heads, into the
        running scores of the slots rows read through ``tables`` (R, W) up to ``ends`` (R,), policy by policy
        (``policies`` (R,)); returns the rows' new scores (R, T; only each row's first ``ends`` are meaningful), also
        stored per slot. One compiled op on the CPU (``csrc/slot_scores.cpp``); these torch ops elsewhere."""
        c = self.cache
        if c.rank_mean is not None:
            weights = c.rank_mean(weights)
        rows, width = tables.shape
        bs = c.block_size
        on_cpu = c.scores.device.type == "cpu" and weights.device.type == "cpu"
        if on_cpu and weights.dtype == torch.float32 and cpu_kernels_available():
            updates = {p: p.score_update() for p in set(policies)}
            coefficients = torch.tensor([updates[p] for p in policies], dtype=torch.float32)  # (R, 2)
            return torch.ops.kvserve.fold_slot_scores(c.scores, tables, ends, weights, coefficients, bs)
        slots = (tables.long()[:, :, None] * bs + torch.arange(bs, device=tables.device)).view(rows, width * bs)
        valid = torch.arange(width * bs, device=tables.device)[None, :] < ends[:, None]
        scores = update_scores(policies, c.scores.index_select(0, slots.view(-1)).view_as(slots), weights)
        c.scores.index_copy_(0, slots.masked_select(valid), scores.masked_select(valid))
        return scores

    def in_place_decode(self, metadata: AttentionMetadata) -> InPlaceDecode | None:
        """Every layer's table, new slot and visible range for a decode-only step on the device slab: (L, B, W)
        tables, (L, B) slots, starts and ends. Not for a slab in a slower tier (each layer fetches what it reads)
        or under tensor parallelism (scores are averaged across ranks between layers)."""
        c = self.cache
        meta = c.check_metadata(metadata)
        if not meta.decode_only or c.tier is not None or c.rank_mean is not None or c.softcap:
            return None
        if c.num_kv_heads > 1 and any(p.head_budgets for p in meta.policies):  # heads attend apart
            return None
        bs, layers, batch = c.block_size, c.num_layers, len(meta.seq_ids)
        held = np.array(c.step.held_after, dtype=np.int64).T  # (L, B)
        used = held // bs + 1  # blocks each row reads
        rows = np.zeros((layers, batch, int(used.max())), dtype=np.int32)  # padding (block 0) is past a row's end
        for b, tables in enumerate(meta.block_tables):  # one numpy row copy per (layer, sequence)
            for layer, table in enumerate(tables):
                rows[layer, b, : used[layer, b]] = table[: used[layer, b]]
        last = np.take_along_axis(rows, (used - 1)[:, :, None], axis=2)[:, :, 0].astype(np.int64)
        slots = last * bs + held % bs  # where each row's new key goes
        windows = np.array([w or 0 for w in c.layer_windows], dtype=np.int64)[:, None]
        starts = np.where(windows > 0, np.maximum(held + 1 - windows, 0), 0)  # a window's first visible slot
        c.step.in_place = InPlaceDecode(
            c.k,
            c.v,
            (0,) * layers,
            torch.from_numpy(slots),
            torch.from_numpy(rows),
            torch.from_numpy(starts.astype(np.int32)),
            torch.from_numpy((held + 1).astype(np.int32)),
            want_weights=bool(self.scored_layers(meta)),
        )
        return c.step.in_place

    def finish_in_place_decode(self, metadata: AttentionMetadata, weights: torch.Tensor | None) -> None:
        """What ``_decode`` does after attending, for every layer at once: the new slots' scores folded in, then
        each group past its target compacted."""
        c = self.cache
        meta = c.check_metadata(metadata)
        decode = c.step.in_place
        batch = len(meta.seq_ids)
        scored = self.scored_layers(meta)
        scores: dict[int, torch.Tensor] = {}
        if scored:
            index = torch.tensor(scored, dtype=torch.long)
            c.scores.index_fill_(0, decode.slots.index_select(0, index).view(-1), 0.0)  # new slots: no history
            width = decode.tables.shape[-1]
            folded = self.fold_scores(
                list(meta.policies) * len(scored),
                decode.tables.index_select(0, index).view(-1, width),
                decode.ends.index_select(0, index).view(-1),
                weights.index_select(0, index).view(len(scored) * batch, -1),
            ).view(len(scored), batch, -1)
            scores = {layer: folded[i] for i, layer in enumerate(scored)}
        ends = decode.ends.numpy()  # (L, B): slots held with the new key
        targets = np.array(meta.group_targets, dtype=np.int64).T
        for layer, b in zip(*np.nonzero(ends > targets), strict=True):  # only these groups compact
            table, h = meta.block_tables[b][layer], c.step.held_after[b][layer]
            row = scores[layer][b] if layer in scores else None
            c.compaction.compress_decoded(layer, meta, b, c.compaction.candidates(table, h + 1), row)
        c.step.held_after = np.minimum(ends, targets).T.tolist()

    def scored_layers(self, meta: CompressedAttentionMetadata) -> list[int]:
        """Layers whose decode scores slots: global-attention layers, when a sequence's policy scores."""
        c = self.cache
        if all(p.scores == SCORES_NONE for p in meta.policies):
            return []
        return [layer for layer, window in enumerate(c.layer_windows) if window is None]

    def decode_source(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The K and V blocks a decode reads (num_blocks, block_size, Hkv, D) and the block tables into them: the
        device slab in place, or the rows' blocks fetched from the tier (counted as moved) and numbered anew."""
        c = self.cache
        if c.tier is None:
            return c.k[0], c.v[0], tables
        keys, values = c.read(tables.view(-1).long(), blocks=True)  # (B * W, block_size, Hkv, D)
        renumbered = torch.arange(tables.numel(), dtype=torch.int32, device=keys.device).view_as(tables)
        return keys, values, renumbered
