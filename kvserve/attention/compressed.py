"""A paged KV cache with one KV group per layer, for policies that keep different slots in each layer.

Every layer has its own block table per sequence, and all layers draw blocks from one pool: the
storage is a single slab (num_blocks, block_size, Hkv, D) for K and one for V, so a block a deep layer
gives back can be taken by any layer of any sequence. A parallel float32 buffer holds each slot's
policy score (the attention it received), so scores move with the keys when slots are compacted and
decoding updates them for a whole batch in one gather and one scatter.

Per step and layer, for each sequence holding ``h`` slots and receiving ``m`` rows:

1. attention of the rows over the ``h`` cached slots plus their own new keys (causal). A prefill writes
   no key before choosing, so it never needs more slots than it keeps; a decode writes its one new key
   at slot ``h`` first (the scheduler reserves that slot) so a single gather reads every candidate;
2. the policy scores the ``h + m`` candidates (when it scores: a prefill's voting rows are attended explicitly,
   so one softmax gives their output and the scores, ``scoring.attend_voting_rows``), and if they exceed the
   group's target for the step (``ScheduledSequence.group_targets``), chooses which to keep;
3. the kept keys, values and scores are written to the group's first slots, in position order (or,
   with nothing to drop, the new rows are appended at slot ``h``);
4. for a row-dropping policy (PyramidInfer), rows whose key the layer dropped leave the hidden states,
   so the next layer computes only the survivors (never for a sequence that needs every row's logits).

With ``kv_offload`` the slab lives in the host or disk tier (``kv/tiers.py``) instead of the device: a
layer reads the slots it attends over from there and writes its kept ones back, so the policy's
compression is also what spares the transfers (read synchronously, without InfiniGen's prefetch).

What each group holds after the step comes back in the ``StepReport``; the scheduler shrinks the block
tables to it (freeing blocks) and remembers the counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    InPlaceDecode,
    UnsupportedKVOperation,
)
from kvserve.attention.decode import merge_attention, paged_decode, paged_decode_lse
from kvserve.attention.head_budgets import head_candidates, pack, packed_slots
from kvserve.attention.paged import PagedKVCache, attend_prefill
from kvserve.attention.softcap import cap_logits
from kvserve.attention.step_layout import pad_tables, row_starts, slot_ids
from kvserve.core.step import StepReport
from kvserve.kv.tiers import KVTier, RowSpec
from kvserve.platform.cpu_kernels import cpu_kernels_available
from kvserve.policies.base import SCORES_NONE, KVPolicy, update_scores
from kvserve.policies.scoring import attend_voting_rows

if TYPE_CHECKING:
    from kvserve.core.step import SchedulerOutput


@dataclass
class _StepState:
    """What changes while the layers run: rows still live per sequence, slots each group keeps."""

    rows: list[int]  # per sequence: its rows in the current hidden states
    held_after: list[list[int]]  # per sequence, per layer: slots held after the step
    heads_after: list[list[tuple[int, ...]]]  # per sequence, per layer: tokens per KV head packed (Ada-KV), or ()
    survivors: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> rows going on
    in_place: InPlaceDecode | None = None  # the step's layers run as one call: what in_place_decode gave them


@dataclass(frozen=True)
class CompressedAttentionMetadata(AttentionMetadata):
    """Per sequence: its policy, and per layer its block table, held slots and target after the step.

    ``state`` is the step's scratch record (rows still live, slots each layer keeps), made fresh by the
    builder and filled in as the layers run; ``CompressedKVCache.report`` turns it into a ``StepReport``.
    """

    policies: tuple[KVPolicy, ...] = ()
    group_slots: tuple[tuple[int, ...], ...] = ()  # [seq][layer] slots holding keys before the step
    group_targets: tuple[tuple[int, ...], ...] = ()  # [seq][layer] most slots kept after the step
    group_frozen: tuple[tuple[int, ...], ...] = ()  # [seq][layer] leading slots in shared module blocks, or ()
    group_heads: tuple[tuple[tuple[int, ...], ...], ...] = ()  # [seq][layer] tokens per KV head packed, or ()
    block_tables: tuple[tuple[tuple[int, ...], ...], ...] = ()  # [seq][layer] block ids
    keep_all_rows: tuple[bool, ...] = ()  # [seq] every row's logits are needed: drop no rows
    block_size: int = 16
    state: _StepState | None = None  # required: CompressedKVCache.build_metadata makes a fresh one per step

    def __post_init__(self) -> None:
        super().__post_init__()
        n = len(self.seq_ids)
        for name in ("policies", "group_slots", "group_targets", "block_tables", "keep_all_rows"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} sequences")
        if self.state is None:
            raise ValueError("CompressedAttentionMetadata needs its step state: build it with CompressedKVCache")

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class CompressedKVCache(AttentionBackend):
    """Keys/values of every layer in one block pool, each layer with its own tables (see the module doc)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        num_host_blocks: int = 0,
        tier: str = "none",
        path: str | None = None,
        layer_windows: Sequence[int | None] = (),
        softcap: float = 0.0,
    ) -> None:
        """``tier``: where the slab lives, ``none`` (the device) or a slower tier (``host``, ``disk``: kv_offload),
        from which each layer reads the rows it attends over; ``path`` is the disk tier's folder.
        ``layer_windows``: per layer, its sliding window (None: global; (): every layer global). ``softcap``: the
        attention-logit soft cap of every layer (0: none), in the attention and in the scores taken from it."""
        self.device, self.tier = torch.device(device), None
        self.layer_windows = tuple(layer_windows) or (None,) * num_layers
        self.softcap = softcap
        if tier == "none":  # one slab of blocks that any layer's group may hold: a paged store of one "layer"
            self.store = PagedKVCache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, pin_memory)
            self.k, self.v = self.store.k, self.store.v  # (1, num_blocks, block_size, Hkv, D)
        else:
            row = RowSpec((num_kv_heads, head_dim), dtype)
            self.tier = KVTier(tier, 1, num_blocks * block_size, {"k": row, "v": row}, self.device.type == "cuda", path)
            self.store = None
            shape = (1, num_blocks, block_size, num_kv_heads, head_dim)
            self.k, self.v = self.tier.arrays["k"].view(shape), self.tier.arrays["v"].view(shape)
        self.moved = {"fetched": 0, "stored": 0}  # bytes between the tier and the device
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.scores = torch.zeros(num_blocks * block_size, dtype=torch.float32, device=device, pin_memory=pin_memory)
        self.rank_mean: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallelism: set_rank_mean
        self.host_cache = self.make_host_cache(num_host_blocks) if num_host_blocks else None

    def make_host_cache(self, num_blocks: int | None = None) -> CompressedKVCache:
        return CompressedKVCache(
            self.num_layers, num_blocks or self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
            self.k.dtype, "cpu", pin_memory=self.k.is_cuda, layer_windows=self.layer_windows, softcap=self.softcap,
        )  # fmt: skip

    def build_metadata(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> CompressedAttentionMetadata:
        scheduled = out.scheduled
        state = _StepState(
            [len(s.token_ids) for s in scheduled],
            [list(s.group_slots) for s in scheduled],
            [list(s.group_heads) or [()] * self.num_layers for s in scheduled],
        )
        return CompressedAttentionMetadata(
            seq_ids=tuple(s.seq_id for s in scheduled),
            query_lens=tuple(len(s.token_ids) for s in scheduled),
            context_lens=tuple(s.num_computed_tokens for s in scheduled),
            policies=tuple(s.kv_policy for s in scheduled),
            group_slots=tuple(s.group_slots for s in scheduled),
            group_targets=tuple(s.group_targets for s in scheduled),
            group_frozen=tuple(s.group_frozen for s in scheduled),
            group_heads=tuple(s.group_heads for s in scheduled),
            block_tables=tuple(s.block_tables for s in scheduled),
            keep_all_rows=tuple(rows_from.get(s.seq_id, len(s.token_ids)) < len(s.token_ids) - 1 for s in scheduled),
            block_size=self.block_size,
            state=state,
        )

    def report(self, metadata: AttentionMetadata) -> StepReport:
        state = metadata.state
        return StepReport(
            group_slots={seq: tuple(held) for seq, held in zip(metadata.seq_ids, state.held_after, strict=True)},
            group_heads={
                seq: tuple(heads)
                for seq, heads, policy in zip(metadata.seq_ids, state.heads_after, metadata.policies, strict=True)
                if policy.head_budgets
            },
            output_rows=tuple(state.rows),
        )

    # Blocks carry their slots' scores with them; slots mean different tokens in different layers.
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if self.tier is not None:
            self.tier.copy_blocks(list(pairs), self.block_size)
        else:
            self.store.copy_blocks(pairs)
        self._move_scores(self, self, pairs)

    def swap_out(self, pairs: Sequence[tuple[int, int]], host_cache: CompressedKVCache | None = None) -> None:
        host = self._host(host_cache)
        self.store.swap_out(pairs, host.store)
        self._move_scores(self, host, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]], host_cache: CompressedKVCache | None = None) -> None:
        host = self._host(host_cache)
        self.store.swap_in(pairs, host.store)
        self._move_scores(host, self, pairs)

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Single slots (src, dst) of the slab with their scores: a Prompt Cache module's partial last blocks,
        layer by layer (each layer's slots are its own, so the pairs name each layer's separately)."""
        if not pairs:
            return
        if self.tier is not None:
            self.tier.copy_slots(list(pairs))
        else:
            self.store.copy_slots(pairs)
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.scores.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.scores.device)
        self.scores.index_copy_(0, dst, self.scores.index_select(0, src))

    def bytes_moved(self) -> dict[str, int]:
        return dict(self.moved) if self.tier is not None else {}

    def _host(self, host_cache: CompressedKVCache | None) -> CompressedKVCache:
        if self.tier is not None:
            raise UnsupportedKVOperation(
                f"the KV is in the {self.tier.kind} tier already: an offloading engine preempts by recompute"
            )
        host = host_cache or self.host_cache
        if not isinstance(host, CompressedKVCache):
            raise RuntimeError("per-layer KV groups swap to a CompressedKVCache host tier (it holds the slot scores)")
        return host

    def set_rank_mean(self, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.rank_mean = mean

    def _move_scores(self, src: CompressedKVCache, dst: CompressedKVCache, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        bs = self.block_size
        s = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        d = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        rows = src.scores.view(-1, bs).index_select(0, s.to(src.scores.device))
        dst.scores.view(-1, bs).index_copy_(0, d.to(dst.scores.device), rows.to(dst.scores.device))

    def store_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        scores: torch.Tensor | None = None,
    ) -> None:
        """A whole prompt's layer from a parallel prefill, k/v (T, Hkv, D) with the policy's ``scores`` (T,) (its
        votes, added up over the ranks): the layer keeps the policy's choice, as a one-process prefill of the
        prompt would. Every rank computed every row, so no row leaves the hidden states (``drops_rows`` cannot
        hold: which rows a layer drops is known only once the last rank's queries have voted)."""
        meta = self._check_metadata(metadata)
        if len(meta.seq_ids) != 1 or meta.context_lens[0] or meta.query_lens[0] != k.shape[0]:
            raise ValueError("a parallel prefill stores one sequence's whole prompt, with nothing cached before it")
        n, target = k.shape[0], meta.group_targets[0][layer]
        kept = torch.arange(n) if n <= target else meta.policies[0].select(scores, n, target, n)
        device = self.device
        scores = None if scores is None else scores.to(device)
        self._write_kept(meta.block_tables[0][layer], k.to(device), v.to(device), scores, kept.to(device))
        meta.state.held_after[0][layer] = kept.numel()

    # ----- attention -----

    def surviving_rows(self, layer: int, metadata: AttentionMetadata) -> torch.Tensor | None:
        if not isinstance(metadata, CompressedAttentionMetadata):
            return None
        return metadata.state.survivors.get(layer)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        metadata = self._check_metadata(metadata)
        state = metadata.state
        if k.dtype != self.k.dtype:  # a narrower cache rounds them once, here: every query sees them as it holds them
            k, v = k.to(self.k.dtype).to(q.dtype), v.to(self.v.dtype).to(q.dtype)
        apart = {i for i in range(len(state.rows)) if self._heads_apart(layer, metadata, i)}
        if metadata.decode_only and not apart:  # rows are already one per sequence, in order
            return self._decode(layer, q, k, v, metadata, list(range(len(state.rows))))
        starts = row_starts(state.rows)
        out = torch.empty_like(q)  # (N_layer, H, D)
        decodes = [i for i, n in enumerate(metadata.query_lens) if n == 1]
        for decode, seqs in (
            (self._decode, [i for i in decodes if i not in apart]),
            (self._decode_heads, [i for i in decodes if i in apart]),
        ):
            if seqs:
                rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=q.device)
                out.index_copy_(0, rows, decode(layer, q[rows], k[rows], v[rows], metadata, seqs))
        kept_rows: list[torch.Tensor] = []
        dropped = False
        for i, n in enumerate(state.rows):
            everything = torch.arange(starts[i], starts[i] + n, device=q.device)
            rows = slice(starts[i], starts[i] + n)
            if metadata.query_lens[i] == 1:
                kept_rows.append(everything)
                continue
            if i in apart:
                out[rows] = self._attend_heads(layer, q[rows], k[rows], v[rows], metadata, i)
                kept_rows.append(everything)
                continue
            out[rows], survivors = self._prefill(layer, q[rows], k[rows], v[rows], metadata, i)
            if survivors is not None and survivors.numel() < n:
                dropped = True
                state.rows[i] = survivors.numel()
                kept_rows.append(survivors + starts[i])
            else:
                kept_rows.append(everything)
        if dropped:
            state.survivors[layer] = torch.cat(kept_rows)
        return out

    def _prefill(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CompressedAttentionMetadata, i: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sequence's m rows: q (m, H, D), k/v (m, Hkv, D) -> output (m, H, D) and the rows going on."""
        policy, table = meta.policies[i], meta.block_tables[i][layer]
        held, target = meta.state.held_after[i][layer], meta.group_targets[i][layer]
        window = self.layer_windows[layer]
        m = q.shape[0]
        ctx = self._slot_ids(table, 0, held, q.device)
        if held:
            cached_k, cached_v = self._read(ctx)
            keys, values = torch.cat((cached_k.to(q.dtype), k)), torch.cat((cached_v.to(q.dtype), v))  # (h + m, Hkv, D)
        else:
            keys, values = k, v
        num_candidates = held + m
        num_tokens = meta.context_lens[i] + meta.query_lens[i]
        votes = policy.votes(m, num_tokens) if window is None else None
        if votes is None:
            out, scores = attend_prefill(q, keys, values, held, window, self.softcap), None  # a window's: its latest
        else:  # the voting rows' attention weights are formed once, for their output and for the scores
            first, row_weights = votes
            out = torch.empty_like(q)
            if first:
                out[:first] = attend_prefill(
                    q[:first], keys[: held + first], values[: held + first], held, softcap=self.softcap
                )
            out[first:], head_sums = attend_voting_rows(q, keys, values, held, first, row_weights, self.softcap)
            previous = self.scores.index_select(0, ctx) if held else None
            scores = policy.scores_from(head_sums, held, previous)
        if scores is not None and scores.dim() == 1 and self.rank_mean is not None:  # the same on every rank
            scores = self.rank_mean(scores)
        if num_candidates <= target:
            self._write(self._slot_ids(table, held, num_candidates, q.device), k, v)
            if scores is not None:
                self.scores.index_copy_(0, self._slot_ids(table, 0, num_candidates, q.device), self._slot(scores))
            meta.state.held_after[i][layer] = num_candidates
            return out, None
        frozen = meta.group_frozen[i][layer] if meta.group_frozen[i] else 0
        kept = self._choose(layer, policy, scores, num_candidates, target, num_tokens, frozen).to(q.device)
        self._write_kept(table, keys, values, scores, kept, frozen)
        meta.state.held_after[i][layer] = target
        # Windows count positions: with sliding-window layers no row leaves the hidden states.
        if not policy.drops_rows or meta.keep_all_rows[i] or self.windowed:
            return out, None
        return out, kept[kept >= held] - held  # a row-dropping policy keeps the same tokens in every head

    def _heads_apart(self, layer: int, meta: CompressedAttentionMetadata, i: int) -> bool:
        """Whether sequence ``i``'s rows at ``layer`` attend head by head (``_attend_heads``): its policy gives KV
        heads their own budgets (a global layer with several KV heads), and the layer has packed them or this
        step packs them."""
        if not meta.policies[i].head_budgets or self.num_kv_heads == 1 or self.layer_windows[layer] is not None:
            return False
        held, new = meta.state.held_after[i][layer], meta.query_lens[i]
        return bool(meta.state.heads_after[i][layer]) or (new > 1 and held + new > meta.group_targets[i][layer])

    def _attend_heads(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CompressedAttentionMetadata, i: int
    ) -> torch.Tensor:
        """One sequence's m rows where its KV heads keep their own budgets (Ada-KV, ``attention/head_budgets.py``):
        q (m, H, D), k/v (m, Hkv, D) -> (m, H, D). Each KV head attends over its own candidates, and the rows' votes
        (the last ``window`` of a chunk; a lone decode row's own attention) rank them. A chunk within the layer's
        target is appended; past it, the heads' budgets are allocated anew and packed. Decode rows come here only
        when the packed tokens fill the target (``_decode_heads`` evicts among the later slots otherwise)."""
        policy, table = meta.policies[i], meta.block_tables[i][layer]
        if meta.group_frozen[i] and meta.group_frozen[i][layer]:
            raise UnsupportedKVOperation(f"kv_policy {policy.name!r} does not compress Prompt Cache modules' slots")
        held, target = meta.state.held_after[i][layer], meta.group_targets[i][layer]
        counts = meta.state.heads_after[i][layer]
        m, heads = q.shape[0], self.num_kv_heads
        group = q.shape[1] // heads
        ctx = self._slot_ids(table, 0, held, q.device)
        cached_k, cached_v = self._read(ctx) if held else (k[:0], v[:0])
        keys = head_candidates(cached_k.to(q.dtype), k, counts)
        values = head_candidates(cached_v.to(q.dtype), v, counts)
        first, row_weights = policy.votes(m, meta.context_lens[i] + m)
        out = torch.empty_like(q)
        votes = []  # per head: the votes its candidates got, (n_h,)
        for h in range(heads):
            qh, kh, vh = q[:, h * group : (h + 1) * group], keys[h][:, None], values[h][:, None]
            before = kh.shape[0] - m
            if first:
                out[:first, h * group : (h + 1) * group] = attend_prefill(
                    qh[:first], kh[: before + first], vh[: before + first], before, softcap=self.softcap
                )
            out[first:, h * group : (h + 1) * group], sums = attend_voting_rows(
                qh, kh, vh, before, first, row_weights, self.softcap
            )
            votes.append(sums[:, 0])
        if held + m <= target:  # a chunk that fits: appended as later slots, every head the same token
            later = torch.stack([votes[h][counts[h] if counts else 0 :] for h in range(heads)], dim=1).mean(dim=1)
            self._write(self._slot_ids(table, held, held + m, q.device), k, v)
            self.scores.index_copy_(0, self._slot_ids(table, packed_slots(counts), held + m, q.device), later)
            meta.state.held_after[i][layer] = held + m
            return out
        chosen = policy.select_heads(votes, target)
        self._write(
            self._slot_ids(table, 0, target, q.device),
            pack([keys[h].index_select(0, c.to(q.device)) for h, c in enumerate(chosen)]),
            pack([values[h].index_select(0, c.to(q.device)) for h, c in enumerate(chosen)]),
        )
        meta.state.heads_after[i][layer] = tuple(c.numel() for c in chosen)
        meta.state.held_after[i][layer] = target
        return out

    def _decode_heads(
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
        batch, heads, dim = q.shape[0], self.num_kv_heads, self.head_dim
        group, bs, device = q.shape[1] // heads, self.block_size, q.device
        held = [meta.state.held_after[i][layer] for i in seqs]
        tables = [meta.block_tables[i][layer] for i in seqs]
        counts = [meta.state.heads_after[i][layer] for i in seqs]
        packed = [packed_slots(c) for c in counts]
        policies = [meta.policies[i] for i in seqs]
        new_slots = torch.tensor([t[h // bs] * bs + h % bs for t, h in zip(tables, held, strict=True)], device=device)
        self._write(new_slots, k, v)
        self.scores.index_fill_(0, new_slots, 0.0)  # a new slot has no history (the entry is stale)
        width = max(h // bs + 1 for h in held)
        padded = pad_tables(tables, width, device)
        k_slab, v_slab, read_tables = self._decode_source(padded)
        ends = torch.tensor(held, dtype=torch.int32, device=device) + 1
        firsts = torch.tensor(packed, dtype=torch.int32, device=device)
        later, later_lse = paged_decode_lse(q, k_slab, v_slab, read_tables, firsts, ends, self.softcap)
        run_starts = torch.tensor([[sum(c[:h]) for h in range(heads)] for c in counts], dtype=torch.int32)
        run_ends = run_starts + torch.tensor(counts, dtype=torch.int32)
        run_view = (k_slab.shape[0], bs * heads, 1, dim)
        runs, runs_lse = paged_decode_lse(
            q.reshape(batch * heads, group, dim), k_slab.view(run_view), v_slab.view(run_view),
            read_tables.repeat_interleave(heads, dim=0), run_starts.view(-1).to(device), run_ends.view(-1).to(device),
            self.softcap,
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
        logits = cap_logits(logits, self.softcap)
        lse = torch.logaddexp(later_lse, runs_lse).view(batch, heads, group, 1)
        weights = torch.exp(logits - lse).mean(dim=(1, 2)) * valid  # (B, L)
        scores = update_scores(policies, self.scores.index_select(0, slots.view(-1)).view_as(slots), weights)
        self.scores.index_copy_(0, slots[valid], scores[valid])
        for b, seq in enumerate(seqs):
            n, target, table = held[b] + 1, meta.group_targets[seq][layer], tables[b]
            if n <= target:
                meta.state.held_after[seq][layer] = n
            elif target > packed[b]:  # evict among the later slots
                count = n - packed[b]
                rest = policies[b].select(scores[b, :count], count, target - packed[b], meta.context_lens[seq] + 1)
                kept = slots[b].index_select(0, rest.to(device))
                dst = self._slot_ids(table, packed[b], target, device)
                self._write(dst, *self._read(kept))
                self.scores.index_copy_(0, dst, self.scores.index_select(0, kept))
                meta.state.held_after[seq][layer] = target
            else:  # nothing but packed slots fits: allocate the heads anew (the row attends again, rarely)
                out[b] = self._attend_heads(layer, q[b : b + 1], k[b : b + 1], v[b : b + 1], meta, seq)[0]
        return out

    def _decode(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: CompressedAttentionMetadata,
        seqs: list[int],
    ) -> torch.Tensor:
        """One new row per sequence in ``seqs``: q (B, H, D), k/v (B, Hkv, D) -> (B, H, D)."""
        batch = q.shape[0]
        bs, device = self.block_size, q.device
        held = [meta.state.held_after[i][layer] for i in seqs]
        tables = [meta.block_tables[i][layer] for i in seqs]
        policies = [meta.policies[i] for i in seqs]
        window = self.layer_windows[layer]
        scoring = window is None and any(p.scores != SCORES_NONE for p in policies)
        # The new token goes to slot h first (the scheduler reserved it even where the layer then compresses),
        # so one pass reads the whole candidate set.
        new_slots = torch.tensor([t[h // bs] * bs + h % bs for t, h in zip(tables, held, strict=True)], device=device)
        self._write(new_slots, k, v)
        if scoring:
            self.scores.index_fill_(0, new_slots, 0.0)  # a new slot has no history (the entry is stale)
        width = max(h // bs + 1 for h in held)
        padded = pad_tables(tables, width, device)  # (B, W) int32; padding (block 0) is past each row's end
        ends = torch.tensor(held, dtype=torch.int32, device=device) + 1
        starts = torch.zeros_like(ends) if window is None else (ends - window).clamp(min=0)  # the window's first
        k_slab, v_slab, read_tables = self._decode_source(padded)
        out, weights = paged_decode(
            q, k_slab, v_slab, read_tables, starts, ends, want_weights=scoring, softcap=self.softcap
        )
        scores = self._fold_scores(policies, padded, ends, weights) if scoring else None
        length = width * bs
        fetched = (
            None
            if self.tier is None
            else (k_slab.view(batch, length, *k.shape[1:]), v_slab.view(batch, length, *v.shape[1:]))
        )

        def candidates(b: int) -> tuple[torch.Tensor, torch.Tensor]:  # row b's keys and values, (held + 1, Hkv, D)
            if fetched is not None:  # already fetched from the tier for the attention above
                return fetched[0][b, : held[b] + 1], fetched[1][b, : held[b] + 1]
            return self._group_kv(tables[b], held[b] + 1)

        for b, seq in enumerate(seqs):
            row_scores = None if scores is None else scores[b]
            self._compress_decoded(layer, meta, seq, lambda b=b: candidates(b), row_scores)
        return out

    def _fold_scores(
        self, policies: Sequence[KVPolicy], tables: torch.Tensor, ends: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Fold a decode step's attention ``weights`` (R, T), each slot's probability averaged over heads, into the
        running scores of the slots rows read through ``tables`` (R, W) up to ``ends`` (R,), policy by policy
        (``policies`` (R,)); returns the rows' new scores (R, T; only each row's first ``ends`` are meaningful), also
        stored per slot. One compiled op on the CPU (``csrc/slot_scores.cpp``); these torch ops elsewhere."""
        if self.rank_mean is not None:
            weights = self.rank_mean(weights)
        rows, width = tables.shape
        bs = self.block_size
        on_cpu = self.scores.device.type == "cpu" and weights.device.type == "cpu"
        if on_cpu and weights.dtype == torch.float32 and cpu_kernels_available():
            updates = {p: p.score_update() for p in set(policies)}
            coefficients = torch.tensor([updates[p] for p in policies], dtype=torch.float32)  # (R, 2)
            return torch.ops.kvserve.fold_slot_scores(self.scores, tables, ends, weights, coefficients, bs)
        slots = (tables.long()[:, :, None] * bs + torch.arange(bs, device=tables.device)).view(rows, width * bs)
        valid = torch.arange(width * bs, device=tables.device)[None, :] < ends[:, None]
        scores = update_scores(policies, self.scores.index_select(0, slots.view(-1)).view_as(slots), weights)
        self.scores.index_copy_(0, slots.masked_select(valid), scores.masked_select(valid))
        return scores

    # ----- a decode step's layers run as one call (models/decode_chain.py) -----

    def in_place_decode(self, metadata: AttentionMetadata) -> InPlaceDecode | None:
        """Every layer's table, new slot and visible range for a decode-only step on the device slab: (L, B, W)
        tables, (L, B) slots, starts and ends. Not for a slab in a slower tier (each layer fetches what it reads)
        or under tensor parallelism (scores are averaged across ranks between layers)."""
        meta = self._check_metadata(metadata)
        if not meta.decode_only or self.tier is not None or self.rank_mean is not None or self.softcap:
            return None
        if self.num_kv_heads > 1 and any(p.head_budgets for p in meta.policies):  # heads attend apart
            return None
        bs, layers, batch = self.block_size, self.num_layers, len(meta.seq_ids)
        held = np.array(meta.state.held_after, dtype=np.int64).T  # (L, B)
        used = held // bs + 1  # blocks each row reads
        rows = np.zeros((layers, batch, int(used.max())), dtype=np.int32)  # padding (block 0) is past a row's end
        for b, tables in enumerate(meta.block_tables):  # one numpy row copy per (layer, sequence)
            for layer, table in enumerate(tables):
                rows[layer, b, : used[layer, b]] = table[: used[layer, b]]
        last = np.take_along_axis(rows, (used - 1)[:, :, None], axis=2)[:, :, 0].astype(np.int64)
        slots = last * bs + held % bs  # where each row's new key goes
        windows = np.array([w or 0 for w in self.layer_windows], dtype=np.int64)[:, None]
        starts = np.where(windows > 0, np.maximum(held + 1 - windows, 0), 0)  # a window's first visible slot
        meta.state.in_place = InPlaceDecode(
            self.k,
            self.v,
            (0,) * layers,
            torch.from_numpy(slots),
            torch.from_numpy(rows),
            torch.from_numpy(starts.astype(np.int32)),
            torch.from_numpy((held + 1).astype(np.int32)),
            want_weights=bool(self._scored_layers(meta)),
        )
        return meta.state.in_place

    def finish_in_place_decode(self, metadata: AttentionMetadata, weights: torch.Tensor | None) -> None:
        """What ``_decode`` does after attending, for every layer at once: the new slots' scores folded in, then
        each group past its target compacted."""
        meta = self._check_metadata(metadata)
        decode = meta.state.in_place
        batch = len(meta.seq_ids)
        scored = self._scored_layers(meta)
        scores: dict[int, torch.Tensor] = {}
        if scored:
            index = torch.tensor(scored, dtype=torch.long)
            self.scores.index_fill_(0, decode.slots.index_select(0, index).view(-1), 0.0)  # new slots: no history
            width = decode.tables.shape[-1]
            folded = self._fold_scores(
                list(meta.policies) * len(scored),
                decode.tables.index_select(0, index).view(-1, width),
                decode.ends.index_select(0, index).view(-1),
                weights.index_select(0, index).view(len(scored) * batch, -1),
            ).view(len(scored), batch, -1)
            scores = {layer: folded[i] for i, layer in enumerate(scored)}
        ends = decode.ends.numpy()  # (L, B): slots held with the new key
        targets = np.array(meta.group_targets, dtype=np.int64).T
        for layer, b in zip(*np.nonzero(ends > targets), strict=True):  # only these groups compact
            table, h = meta.block_tables[b][layer], meta.state.held_after[b][layer]
            row = scores[layer][b] if layer in scores else None
            self._compress_decoded(layer, meta, b, partial(self._group_kv, table, h + 1), row)
        meta.state.held_after = np.minimum(ends, targets).T.tolist()

    def _group_kv(self, table: tuple[int, ...], count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of a group's first ``count`` slots, (count, Hkv, D) each (copies)."""
        return self._read(self._slot_ids(table, 0, count, self.device))

    def _scored_layers(self, meta: CompressedAttentionMetadata) -> list[int]:
        """Layers whose decode scores slots: global-attention layers, when a sequence's policy scores."""
        if all(p.scores == SCORES_NONE for p in meta.policies):
            return []
        return [layer for layer, window in enumerate(self.layer_windows) if window is None]

    def _decode_source(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The K and V blocks a decode reads (num_blocks, block_size, Hkv, D) and the block tables into them: the
        device slab in place, or the rows' blocks fetched from the tier (counted as moved) and numbered anew."""
        if self.tier is None:
            return self.k[0], self.v[0], tables
        keys, values = self._read(tables.view(-1).long(), blocks=True)  # (B * W, block_size, Hkv, D)
        renumbered = torch.arange(tables.numel(), dtype=torch.int32, device=keys.device).view_as(tables)
        return keys, values, renumbered

    def _compress_decoded(
        self, layer: int, meta: CompressedAttentionMetadata, seq: int,
        candidates: Callable[[], tuple[torch.Tensor, torch.Tensor]], scores: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """After a decode row: keep everything while the group is within its target, else the policy's choice
        among its ``candidates()`` (keys and values, read only then)."""
        n = meta.state.held_after[seq][layer] + 1
        target = meta.group_targets[seq][layer]
        if n <= target:
            meta.state.held_after[seq][layer] = n
            return
        keys, values = candidates()
        scores = None if scores is None else scores[:n]
        frozen = meta.group_frozen[seq][layer] if meta.group_frozen[seq] else 0
        policy, num_tokens = meta.policies[seq], meta.context_lens[seq] + 1
        kept = self._choose(layer, policy, scores, n, target, num_tokens, frozen).to(keys.device)
        self._write_kept(meta.block_tables[seq][layer], keys[:n], values[:n], scores, kept, frozen)
        meta.state.held_after[seq][layer] = target

    def _write_kept(
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
        kept = kept[frozen:]
        dst = self._slot_ids(table, frozen, frozen + kept.shape[0], keys.device)
        if kept.dim() == 1:
            self._write(dst, keys.index_select(0, kept), values.index_select(0, kept))
        else:
            rows = kept[:, :, None].expand(-1, -1, keys.shape[-1])  # (k, Hkv, D)
            self._write(dst, keys.gather(0, rows), values.gather(0, rows))
        if scores is not None:
            chosen = scores.index_select(0, kept) if kept.dim() == 1 else scores.gather(0, kept)
            self.scores.index_copy_(0, dst, self._slot(chosen))

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    def _choose(
        self, layer: int, policy: KVPolicy, scores: torch.Tensor | None, num_candidates: int, keep: int,
        num_tokens: int, frozen: int,
    ) -> torch.Tensor:  # fmt: skip
        """Which candidates ``layer`` keeps: a sliding-window layer its latest ``keep`` (all a window can see
        again), any other the policy's choice."""
        if self.layer_windows[layer] is not None:
            return torch.arange(num_candidates - keep, num_candidates)
        return _select(policy, scores, num_candidates, keep, num_tokens, frozen)

    def _slot(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores as the per-slot record: (n,) as they are; per-head (n, Hkv) averaged over every rank's heads
        (what decoding folds each step's head-averaged attention into)."""
        if scores.dim() == 1:
            return scores
        mean = scores.mean(dim=1)
        return mean if self.rank_mean is None else self.rank_mean(mean)

    @staticmethod
    def _check_metadata(metadata: AttentionMetadata) -> CompressedAttentionMetadata:
        if not isinstance(metadata, CompressedAttentionMetadata):
            raise TypeError(f"CompressedKVCache needs CompressedAttentionMetadata, got {type(metadata).__name__}")
        return metadata

    def _read(self, index: torch.Tensor, blocks: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``index`` (n,) on the compute device, (n, Hkv, D) each, or of whole blocks
        (n, block_size, Hkv, D) with ``blocks``: copies, fetched from the tier when the slab lives there."""
        k, v = (self.k[0], self.v[0]) if blocks else self._flat()
        index = index.to(k.device)
        k, v = k.index_select(0, index), v.index_select(0, index)
        if self.tier is not None:
            self.moved["fetched"] += 2 * k.numel() * k.element_size()
        return k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)

    def _write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values (n, Hkv, D) into ``slots`` (n,), in the tier when the slab lives there."""
        k_flat, v_flat = self._flat()
        slots = slots.to(k_flat.device)
        k_flat.index_copy_(0, slots, k.to(k_flat.device, k_flat.dtype))
        v_flat.index_copy_(0, slots, v.to(v_flat.device, v_flat.dtype))
        if self.tier is not None:
            self.moved["stored"] += 2 * k.numel() * k.element_size()

    def _flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as (slots, Hkv, D) views."""
        return self.k.view(-1, self.num_kv_heads, self.head_dim), self.v.view(-1, self.num_kv_heads, self.head_dim)

    def _slot_ids(self, table: tuple[int, ...], begin: int, end: int, device: torch.device) -> torch.Tensor:
        return slot_ids(table, begin, end, self.block_size, device)


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
