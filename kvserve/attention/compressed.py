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
2. the policy scores the ``h + m`` candidates (when it scores), and if they exceed the group's target
   for the step (``ScheduledSequence.group_targets``), chooses which to keep;
3. the kept keys, values and scores are written to the group's first slots, in position order (or,
   with nothing to drop, the new rows are appended at slot ``h``);
4. for a row-dropping policy (PyramidInfer), rows whose key the layer dropped leave the hidden states,
   so the next layer computes only the survivors (never for a sequence that needs every row's logits).

What each group holds after the step is left in the metadata for the engine, which shrinks the block
tables to it (freeing blocks) and remembers the counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.paged import PagedKVCache, attend_prefill
from kvserve.policies.base import SCORES_ACCUMULATED, SCORES_NONE, SCORES_RECENT, KVPolicy

_SCORE_CHUNK = 256  # query rows per chunk when scoring a prefill (bounds the (H, rows, keys) weights)


@dataclass
class _StepState:
    """What changes while the layers run: rows still live per sequence, slots each group keeps."""

    rows: list[int]  # per sequence: its rows in the current hidden states
    held_after: list[list[int]]  # per sequence, per layer: slots held after the step
    survivors: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> rows going on


@dataclass(frozen=True)
class CompressedAttentionMetadata(AttentionMetadata):
    """Per sequence: its policy, and per layer its block table, held slots and target after the step."""

    policies: tuple[KVPolicy, ...] = ()
    group_slots: tuple[tuple[int, ...], ...] = ()  # [seq][layer] slots holding keys before the step
    group_targets: tuple[tuple[int, ...], ...] = ()  # [seq][layer] most slots kept after the step
    block_tables: tuple[tuple[tuple[int, ...], ...], ...] = ()  # [seq][layer] block ids
    keep_all_rows: tuple[bool, ...] = ()  # [seq] every row's logits are needed: drop no rows
    block_size: int = 16
    state: _StepState = field(default=None)  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        super().__post_init__()
        n = len(self.seq_ids)
        for name in ("policies", "group_slots", "group_targets", "block_tables", "keep_all_rows"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} sequences")
        state = _StepState(list(self.query_lens), [list(s) for s in self.group_slots])
        object.__setattr__(self, "state", state)

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @property
    def final_rows(self) -> list[int]:
        """Rows per sequence in the model's output (after every layer's drops)."""
        return list(self.state.rows)


class CompressedKVCache(PagedKVCache):
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
    ) -> None:
        super().__init__(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, pin_memory)
        self.model_layers = num_layers
        self.scores = torch.zeros(num_blocks * block_size, dtype=torch.float32, device=device, pin_memory=pin_memory)

    def make_host_cache(self, num_blocks: int | None = None) -> CompressedKVCache:
        return CompressedKVCache(
            self.model_layers, num_blocks or self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
            self.k.dtype, "cpu", pin_memory=self.k.is_cuda,
        )  # fmt: skip

    # Blocks carry their slots' scores with them.
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        super().copy_blocks(pairs)
        self._move_scores(self, self, pairs)

    def swap_out(self, pairs: Sequence[tuple[int, int]], host_cache: PagedKVCache) -> None:
        super().swap_out(pairs, host_cache)
        self._move_scores(self, host_cache, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]], host_cache: PagedKVCache) -> None:
        super().swap_in(pairs, host_cache)
        self._move_scores(host_cache, self, pairs)

    def _move_scores(self, src: PagedKVCache, dst: PagedKVCache, pairs: Sequence[tuple[int, int]]) -> None:
        if not isinstance(src, CompressedKVCache) or not isinstance(dst, CompressedKVCache):
            raise TypeError("per-layer KV groups swap to and from a CompressedKVCache (it holds the slot scores)")
        if not pairs:
            return
        bs = self.block_size
        s = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        d = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        rows = src.scores.view(-1, bs).index_select(0, s.to(src.scores.device))
        dst.scores.view(-1, bs).index_copy_(0, d.to(dst.scores.device), rows.to(dst.scores.device))

    # ----- attention -----

    def surviving_rows(self, layer: int, metadata: AttentionMetadata) -> torch.Tensor | None:
        if not isinstance(metadata, CompressedAttentionMetadata):
            return None
        return metadata.state.survivors.get(layer)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if not isinstance(metadata, CompressedAttentionMetadata):
            raise TypeError(f"CompressedKVCache needs CompressedAttentionMetadata, got {type(metadata).__name__}")
        state = metadata.state
        if metadata.decode_only:  # rows are already one per sequence, in order
            return self._decode(layer, q, k, v, metadata, list(range(len(state.rows))))
        starts = [0]
        for n in state.rows:
            starts.append(starts[-1] + n)
        out = torch.empty_like(q)  # (N_layer, H, D)
        decodes = [i for i, n in enumerate(metadata.query_lens) if n == 1]
        if decodes:
            rows = torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=q.device)
            out.index_copy_(0, rows, self._decode(layer, q[rows], k[rows], v[rows], metadata, decodes))
        kept_rows: list[torch.Tensor] = []
        dropped = False
        for i, n in enumerate(state.rows):
            everything = torch.arange(starts[i], starts[i] + n, device=q.device)
            if metadata.query_lens[i] == 1:
                kept_rows.append(everything)
                continue
            rows = slice(starts[i], starts[i] + n)
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
        m = q.shape[0]
        k_flat, v_flat = self._flat()
        ctx = self._slot_ids(table, 0, held, q.device)
        keys = torch.cat((k_flat.index_select(0, ctx), k)) if held else k  # (h + m, Hkv, D)
        values = torch.cat((v_flat.index_select(0, ctx), v)) if held else v
        out = attend_prefill(q, keys, values, held)
        num_candidates = held + m
        num_tokens = meta.context_lens[i] + meta.query_lens[i]
        scores = None
        if policy.scores != SCORES_NONE:
            previous = self.scores.index_select(0, ctx) if held else None
            scores = _prefill_scores(policy, q, keys, held, num_tokens, previous)  # (h + m,)
        if num_candidates <= target:
            new = self._slot_ids(table, held, num_candidates, q.device)
            k_flat.index_copy_(0, new, k)
            v_flat.index_copy_(0, new, v)
            if scores is not None:
                self.scores.index_copy_(0, self._slot_ids(table, 0, num_candidates, q.device), scores)
            meta.state.held_after[i][layer] = num_candidates
            return out, None
        kept = policy.select(scores, num_candidates, target, num_tokens).to(q.device)  # (target,) ascending
        self._write_kept(table, keys, values, scores, kept)
        meta.state.held_after[i][layer] = target
        if not policy.drops_rows or meta.keep_all_rows[i]:
            return out, None
        return out, kept[kept >= held] - held

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
        batch, num_heads, head_dim = q.shape
        hkv, bs, device = self.num_kv_heads, self.block_size, q.device
        held = [meta.state.held_after[i][layer] for i in seqs]
        targets = [meta.group_targets[i][layer] for i in seqs]
        tables = [meta.block_tables[i][layer] for i in seqs]
        policies = [meta.policies[i] for i in seqs]
        scoring = any(p.scores != SCORES_NONE for p in policies)
        # The new token goes to slot h first (the scheduler reserved it even where the layer then compresses),
        # so one gather reads the whole candidate set.
        k_flat, v_flat = self._flat()
        new_slots = torch.tensor([t[h // bs] * bs + h % bs for t, h in zip(tables, held, strict=True)], device=device)
        k_flat.index_copy_(0, new_slots, k)
        v_flat.index_copy_(0, new_slots, v)
        if scoring:
            self.scores.index_fill_(0, new_slots, 0.0)  # a new slot has no history (the entry is stale)
        width = max(h // bs + 1 for h in held)
        length = width * bs
        padded = torch.tensor([list(t[:width]) + [0] * (width - len(t)) for t in tables], device=device)  # (B, W)
        # Blocks past a sequence's own (padding: block 0) are read only past its length, then masked.
        keys = self.k[0].index_select(0, padded.view(-1)).view(batch, length, hkv, head_dim)  # a copy
        values = self.v[0].index_select(0, padded.view(-1)).view(batch, length, hkv, head_dim)
        lengths = torch.tensor(held, device=device) + 1
        valid = torch.arange(length, device=device)[None, :] < lengths[:, None]  # (B, T)
        mask = valid[:, None, None, :]  # (B, 1, 1, T)
        qg = q.view(batch, hkv, num_heads // hkv, head_dim)  # (B, Hkv, G, D): query head h reads KV head h // G
        kh, vh = keys.transpose(1, 2), values.transpose(1, 2)  # (B, Hkv, T, D)
        scores = None
        if scoring:  # the weights are needed too: attention by hand, over head-major copies (3-5x faster
            # products than strided views; the probabilities are rounded to the cache dtype for the second)
            kh, vh = kh.contiguous(), vh.contiguous()
            weights = torch.softmax(_scaled_logits(qg, kh).masked_fill_(~mask, float("-inf")), dim=-1)
            out = torch.matmul(weights.to(vh.dtype), vh)  # (B, Hkv, G, D)
            slots = (padded[:, :, None] * bs + torch.arange(bs, device=device)).view(batch, length)  # (B, T)
            scores = self.scores.index_select(0, slots.view(-1)).view(batch, length)
            scores = self._update_scores(policies, scores, weights.mean(dim=(1, 2)))  # (B, T)
            self.scores.index_copy_(0, slots.masked_select(valid), scores.masked_select(valid))
        else:
            out = F.scaled_dot_product_attention(qg, kh, vh, attn_mask=mask)  # (B, Hkv, G, D)
        for b, seq in enumerate(seqs):
            n = held[b] + 1
            if n <= targets[b]:
                meta.state.held_after[seq][layer] = n
                continue
            num_tokens = meta.context_lens[seq] + 1
            kept = policies[b].select(scores[b, :n] if scoring else None, n, targets[b], num_tokens).to(device)
            self._write_kept(tables[b], keys[b, :n], values[b, :n], scores[b, :n] if scoring else None, kept)
            meta.state.held_after[seq][layer] = targets[b]
        return out.reshape(batch, num_heads, head_dim)

    @staticmethod
    def _update_scores(policies: list[KVPolicy], scores: torch.Tensor, step_weights: torch.Tensor) -> torch.Tensor:
        """Each sequence's running scores (B, T) folded with its step's weights, batched per policy."""
        if all(p == policies[0] for p in policies):
            return policies[0].update(scores, step_weights)
        out = scores.clone()
        for policy in set(policies):
            rows = torch.tensor([b for b, p in enumerate(policies) if p == policy], device=scores.device)
            out[rows] = policy.update(scores[rows], step_weights[rows])
        return out

    def _write_kept(
        self,
        table: tuple[int, ...],
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor | None,
        kept: torch.Tensor,
    ) -> None:
        """Candidates ``kept`` (ascending) into the group's first slots; keys/values (n, Hkv, D) are copies."""
        k_flat, v_flat = self._flat()
        dst = self._slot_ids(table, 0, kept.numel(), keys.device)
        k_flat.index_copy_(0, dst, keys.index_select(0, kept))
        v_flat.index_copy_(0, dst, values.index_select(0, kept))
        if scores is not None:
            self.scores.index_copy_(0, dst, scores.index_select(0, kept))

    def _flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as (slots, Hkv, D) views."""
        return self.k.view(-1, self.num_kv_heads, self.head_dim), self.v.view(-1, self.num_kv_heads, self.head_dim)

    def _slot_ids(self, table: tuple[int, ...], begin: int, end: int, device: torch.device) -> torch.Tensor:
        """(end - begin,) long slot ids of a group's positions begin..end-1."""
        bs = self.block_size
        first, last = begin // bs, math.ceil(end / bs)
        blocks = torch.tensor(table[first:last], dtype=torch.long, device=device)
        ids = (blocks[:, None] * bs + torch.arange(bs, device=device)).view(-1)
        return ids[begin - first * bs : end - first * bs]


def _prefill_scores(
    policy: KVPolicy, q: torch.Tensor, keys: torch.Tensor, held: int, num_tokens: int, previous: torch.Tensor | None
) -> torch.Tensor:
    """Scores (h + m,) float32 of a sequence's candidates from its m new queries q (m, H, D) over keys (h + m, Hkv, D).

    PyramidInfer: the ensemble of S_r's attention (its last |S_r| queries, weighted towards the most
    recent, mean over heads). H2O: attention summed over all the step's queries (mean over heads),
    added to the scores the cached slots had.
    """
    m, num_heads, head_dim = q.shape
    n, num_kv_heads = keys.shape[:2]
    group = num_heads // num_kv_heads
    kh = keys.transpose(0, 1)[:, None]  # (Hkv, 1, n, D): query head h reads KV head h // group
    if policy.scores == SCORES_RECENT:
        first = m - min(policy.recent_count(num_tokens), m)
        row_weights = policy.query_weights(m - first).to(q.device)
    elif policy.scores == SCORES_ACCUMULATED:
        first, row_weights = 0, torch.ones(m, device=q.device)
    else:
        raise ValueError(f"policy {policy.name!r} scores by {policy.scores!r}, which prefill cannot compute")
    total = torch.zeros(n, dtype=torch.float32, device=q.device)
    for begin in range(first, m, _SCORE_CHUNK):
        end = min(begin + _SCORE_CHUNK, m)
        qh = q[begin:end].transpose(0, 1).reshape(num_kv_heads, group, end - begin, head_dim)  # (Hkv, G, c, D)
        logits = _scaled_logits(qh, kh).view(num_heads, end - begin, n)  # (H, c, n) float32
        # Query j of the chunk sits at candidate index held + begin + j and sees keys up to there.
        visible = (
            torch.arange(n, device=q.device)[None, :] <= (held + torch.arange(begin, end, device=q.device))[:, None]
        )
        weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).mean(dim=0)  # (c, n)
        total += row_weights[begin - first : end - first] @ weights
    if policy.scores == SCORES_ACCUMULATED and previous is not None:
        total[:held] += previous
    return total


def _scaled_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q k^T / sqrt(D) as float32, multiplied in the cache dtype (bfloat16 runs on AMX; the scores that
    rank tokens need no more precision). q (..., r, D), k (..., n, D) -> (..., r, n)."""
    return torch.matmul(q, k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
