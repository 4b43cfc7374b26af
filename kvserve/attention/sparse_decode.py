"""InfiniGen without offloading: sparse decode attention over the device's paged cache.

With ``kv_policy='infinigen'`` and no ``kv_offload`` the whole KV stays in the paged cache (window groups on a
model with sliding-window layers), and a decode step reads in each speculated layer only the rows InfiniGen's
rehearsal selects (``policies/infinigen.py``: layer i's skewed partial query from layer i - 1's attention input,
or the layer's own query for layer 1, against a partial key cache of the same dimensions; a count per sequence,
each KV head its own top rows), plus the step's own row. The speculated layers are those the offloaded InfiniGen
selects in (every layer but a full-attention layer 0), except a model's sliding-window layers: their window is
small, and they attend it whole, so only global layers are sparse.

The selected rows are read in place from the paged blocks, no gather into staging: the decode kernel
(``decode.paged_decode``, ``csrc/paged_decode.cpp``) runs over the layer's cache viewed as blocks of one row of
one KV head, (slots x Hkv, 1, 1, D), and each (sequence, KV head) is a row of its own whose table lists the
(slot x Hkv + head) entries it reads, in position order, its own row last. Under a selection that covers every
row this is the same computation, key for key, as the full decode.

Prefill attends to everything (InfiniGen speculates for decoding). Each row of a *scored* chunk (prompt logprobs,
how the eval tools score a continuation) attends only to what its own rehearsal selects among the rows before
it, plus itself, as the offloaded InfiniGen computes it (``offload_chunk.py``) and decoding the rows one by one
would. The partial keys are kept for every row a speculated layer writes (prefill, decode, a parallel prefill's
rows) and follow the blocks: copied with copy-on-write and Prompt Cache slots, recomputed from the keys after a
swap-in or a module's slots written in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvserve.attention.backend import AttentionMetadata, InPlaceDecode
from kvserve.attention.decode import paged_decode
from kvserve.attention.paged import PagedKVCache
from kvserve.attention.paged_metadata import PagedAttentionMetadata
from kvserve.attention.paged_plan import StepPlan
from kvserve.attention.softcap import sdpa
from kvserve.policies.infinigen import PagedCandidates, Selection
from kvserve.policies.infinigen_state import PartialProjections, SelectingPolicy

if TYPE_CHECKING:
    from kvserve.core.step import SchedulerOutput

_SELECT_ROWS = 256  # rows of a scored chunk speculated at once (as the offloaded cache)


@dataclass
class SparseStats:
    """Per layer: rows selected against the rows before them, over decode steps and scored chunk rows (the
    offloaded cache's ``OffloadStats`` counting); layers that are not sparse count nothing."""

    selected_rows: list[int]
    cached_rows: list[int]
    decode_steps: int = 0

    def read_fraction(self) -> list[float]:
        return [s / c if c else 1.0 for s, c in zip(self.selected_rows, self.cached_rows, strict=True)]


@dataclass
class SparseStep:
    """What a step's sparse layers share: which rows select, and the partial queries the layers fill in."""

    decode_rows: torch.Tensor  # (Bs,) long: rows of the decodes that have a context to select from
    decode_seqs: tuple[int, ...]  # their sequences (metadata order)
    all_decodes: bool  # every row of the step is such a decode: nothing else to attend
    query_rows: torch.Tensor | None  # rows whose partial queries the step needs (None: none)
    decode_at: torch.Tensor | None  # the decode rows' places in query_rows (None: query_rows are the decode rows)
    scored: tuple[tuple[int, int], ...]  # (prefill index in the plan, its first scored row)
    partial_queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (len(query_rows), Hkv, G, r)


class SparseDecodeKVCache(PagedKVCache):
    """The paged cache whose decodes attend, in each speculated layer, only to InfiniGen's selection (module doc).
    ``policy``: InfiniGen with its alphas resolved; ``rehearsal``: the model's partial projections; the rest is
    ``PagedKVCache``'s."""

    def __init__(self, policy: SelectingPolicy, rehearsal: PartialProjections, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_quant is not None:
            raise ValueError(
                f"kv_policy='infinigen' reads plain rows; a {self.kv_quant.name} KV cache is not supported"
            )
        if isinstance(policy.alpha, tuple) and len(policy.alpha) != self.num_layers:
            raise ValueError(
                f"infinigen_alpha has {len(policy.alpha)} per-layer values; the model has {self.num_layers}"
            )
        policy.layer_alpha(0)  # raises while alpha is still "auto"
        self.policy, self.rehearsal = policy, rehearsal
        windows = self.layer_windows or (None,) * self.num_layers
        # Global layers only: a window layer attends its (small) window whole.
        self.sparse_layers = frozenset(i for i in rehearsal.speculated_layers if windows[i] is None)
        self.own_query_layers = rehearsal.own_query_layers & self.sparse_layers
        self.rehearsed_layers = self.sparse_layers - self.own_query_layers
        # Partial keys per block row of the sparse layers, each block's (r, block_size) transposed as the
        # speculation op reads them. A row shared with window layers (window groups) is theirs in other blocks.
        rows = sorted({self.layer_rows[i] for i in self.sparse_layers})
        self._partial_index = {row: i for i, row in enumerate(rows)}
        shape = (len(rows), self.num_kv_heads, self.num_blocks, rehearsal.partial_dims, self.block_size)
        self.partial_keys = torch.zeros(shape, dtype=self.dtype, device=self.k.device)
        self.rank_mean: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.stats = SparseStats([0] * self.num_layers, [0] * self.num_layers)
        self._scored_from: tuple[int, ...] = ()
        self._built: PagedAttentionMetadata | None = None  # the metadata build_metadata made last
        self._step: SparseStep | None = None
        self._step_metadata: PagedAttentionMetadata | None = None

    # ----- partial keys -----

    def _partial(self, layer: int) -> torch.Tensor:
        """``layer``'s partial key cache (Hkv, blocks, r, block_size)."""
        return self.partial_keys[self._partial_index[self.layer_rows[layer]]]

    def _store_partial(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """The partial keys of keys k (N, Hkv, D) written to ``slots`` (N,) of ``layer``."""
        partial = self.rehearsal.partial_key(layer, k.to(self.dtype))  # (N, Hkv, r)
        rows = self._partial(layer).transpose(-1, -2)  # (Hkv, blocks, bs, r)
        rows[:, slots // self.block_size, slots % self.block_size] = partial.transpose(0, 1).to(rows.dtype)

    def _refresh(self, slots: torch.Tensor) -> None:
        """Recompute the partial keys of ``slots`` from the keys the cache holds there (every sparse layer)."""
        for layer in self.sparse_layers:
            keys = self.k[self.layer_rows[layer]].view(-1, self.num_kv_heads, self.head_dim).index_select(0, slots)
            self._store_partial(layer, slots, keys)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        super().copy_blocks(pairs)
        if pairs:
            src, dst = self._tensors(pairs)
            self.partial_keys.index_copy_(2, dst, self.partial_keys.index_select(2, src))  # blocks on dim 2

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        super().copy_slots(pairs)
        if pairs:
            src, dst = self._tensors(pairs)
            rows, bs = self.partial_keys.transpose(-1, -2), self.block_size  # (R, Hkv, blocks, bs, r)
            rows[:, :, dst // bs, dst % bs] = rows[:, :, src // bs, src % bs]

    def write_slots(self, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        super().write_slots(slots, k, v)
        self._refresh(torch.tensor(list(slots), dtype=torch.long, device=self.k.device))

    def swap_in(self, pairs: Sequence[tuple[int, int]], host_cache: PagedKVCache | None = None) -> None:
        """Blocks back from the host tier, their partial keys recomputed from their keys (the tier holds K and V)."""
        super().swap_in(pairs, host_cache)
        if pairs:
            blocks = self._tensors(pairs)[1]
            self._refresh(
                (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=blocks.device)).view(-1)
            )

    def _tensors(self, pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.k.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.k.device)
        return src, dst

    def store_layer(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata,
        scores: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        super().store_layer(layer, k, v, metadata, scores)
        if layer in self.sparse_layers:
            meta = self._check_metadata(metadata)
            self._store_partial(layer, meta.slot_mappings[meta.group_of(layer)], k)

    def set_rank_mean(self, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The count is a mean over every rank's query heads (tensor parallelism)."""
        self.rank_mean = mean

    # ----- a step -----

    def build_metadata(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> PagedAttentionMetadata:
        metadata = super().build_metadata(out, rows_from)
        # A sequence whose rows are scored selects from its first scored row on (as the offloaded cache).
        self._scored_from = tuple(
            max(0, s.score_from - s.num_computed_tokens) if s.seq_id in rows_from else len(s.token_ids)
            for s in out.scheduled
        )
        self._built = metadata
        return metadata

    def in_place_decode(self, metadata: AttentionMetadata) -> InPlaceDecode | None:
        return None  # every layer goes through forward: the rehearsal runs between them

    def _step_of(self, metadata: PagedAttentionMetadata) -> SparseStep:
        if metadata is not self._step_metadata:
            self._step, self._step_metadata = self._make_step(metadata, self._plan_of(metadata)), metadata
            if self._step.decode_seqs:
                self.stats.decode_steps += 1
        return self._step

    def _make_step(self, meta: PagedAttentionMetadata, plan: StepPlan) -> SparseStep:
        device = self.k.device
        picks = [j for j, i in enumerate(plan.decodes) if meta.context_lens[i] > 0]
        decode_rows = plan.decode_rows[picks] if len(picks) != len(plan.decodes) else plan.decode_rows
        scored_from = self._scored_from if meta is self._built else ()
        scored = tuple(
            (j, scored_from[p.index])
            for j, p in enumerate(plan.prefills)
            if scored_from and scored_from[p.index] < p.query_len
        )
        all_decodes = plan.decode_only and len(picks) == len(plan.decodes)
        query_rows, decode_at = (decode_rows if picks else None), None
        if scored:  # every row of the step: the scored rows are a prompt's few, the decodes at their places
            query_rows, decode_at = torch.arange(meta.num_tokens, device=device), decode_rows
        seqs = tuple(plan.decodes[j] for j in picks)
        return SparseStep(decode_rows, seqs, all_decodes, query_rows, decode_at, scored)

    def observe_input(
        self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> None:
        """The rehearsal: layer + 1's partial queries from this layer's input, for the rows that select."""
        nxt = layer + 1
        if nxt not in self.rehearsed_layers:
            return
        step = self._step_of(self._check_metadata(metadata))
        rows = step.query_rows
        if rows is None:
            return
        if rows.numel() != x.shape[0]:
            x, rope = x.index_select(0, rows), (rope[0].index_select(0, rows), rope[1].index_select(0, rows))
        step.partial_queries[nxt] = self.rehearsal.partial_query(nxt, x, rope)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if layer in self.sparse_layers:
            meta = self._check_metadata(metadata)
            self._store_partial(layer, meta.slot_mappings[meta.group_of(layer)], k)
        return super().forward(layer, q, k, v, metadata)  # writes the rows, then ``_attend``

    def _attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        if layer not in self.sparse_layers:
            return super()._attend(layer, q, k, v, metadata)
        step = self._step_of(metadata)
        if layer in self.own_query_layers and step.query_rows is not None:  # layer 1: from its own query
            step.partial_queries[layer] = self.rehearsal.partial_from_query(layer, q.index_select(0, step.query_rows))
        if step.all_decodes:
            return self._decode_sparse(layer, q, metadata, step)
        # Prefills attend to everything; the decodes' rows are then replaced by their sparse attention.
        out = super()._attend(layer, q, k, v, metadata)
        if step.decode_seqs:
            rows = step.decode_rows
            out.index_copy_(0, rows, self._decode_sparse(layer, q.index_select(0, rows), metadata, step))
        for j, first in step.scored:
            self._attend_scored(layer, q, out, metadata, self._plan_of(metadata).prefills[j], first, step)
        return out

    def _decode_sparse(
        self, layer: int, q: torch.Tensor, meta: PagedAttentionMetadata, step: SparseStep
    ) -> torch.Tensor:
        """q (Bs, H, D), the decode rows that select: each over its KV heads' selected rows and its own."""
        group = meta.group_of(layer)
        tables = meta.block_tables[group]
        if len(step.decode_seqs) != tables.shape[0]:
            tables = tables.index_select(0, torch.tensor(step.decode_seqs, dtype=torch.long, device=tables.device))
        context = [meta.context_lens[i] for i in step.decode_seqs]
        as_int = {"dtype": torch.int32, "device": tables.device}
        candidates = PagedCandidates(
            tables.contiguous(), self.block_size, torch.zeros(len(context), **as_int), torch.tensor(context, **as_int)
        )
        partial_q = step.partial_queries[layer]
        if step.decode_at is not None:
            partial_q = partial_q.index_select(0, step.decode_at)
        selection, _ = self.policy.select_decode_rows(
            layer, partial_q, self._partial(layer), candidates, self.head_dim, self.rank_mean
        )
        self.stats.selected_rows[layer] += int(selection.counts.sum())
        self.stats.cached_rows[layer] += sum(context)
        table, ends = selected_table(selection, candidates, self.num_kv_heads)
        row = self.layer_rows[layer]
        by_row = (-1, 1, 1, self.head_dim)  # every (slot, KV head) a block of one row
        batch, heads, dim = q.shape
        out = paged_decode(
            q.reshape(batch * self.num_kv_heads, heads // self.num_kv_heads, dim), self.k[row].view(by_row),
            self.v[row].view(by_row), table, torch.zeros_like(ends), ends, softcap=meta.softcap,
        )[0]  # fmt: skip
        return out.view(batch, heads, dim)

    def _attend_scored(
        self, layer: int, q: torch.Tensor, out: torch.Tensor, meta: PagedAttentionMetadata, prefill: Any, first: int,
        step: SparseStep,
    ) -> None:  # fmt: skip
        """Rows ``first``.. of a prefill: each over the rows its rehearsal selects among those before it, plus itself,
        in pieces of ``_SELECT_ROWS`` (the rows before it as the cache holds them)."""
        group, row, bs = meta.group_of(layer), self.layer_rows[layer], self.block_size
        table = meta.block_tables[group][prefill.index].long()
        context, hkv = prefill.context_len, self.num_kv_heads
        for a in range(first, prefill.query_len, _SELECT_ROWS):
            b = min(a + _SELECT_ROWS, prefill.query_len)
            held, m = context + a, b - a
            if held == 0:  # nothing cached to select among: as computed, counted unselected
                self.stats.selected_rows[layer] += m * (m - 1) // 2
                self.stats.cached_rows[layer] += m * (m - 1) // 2
                continue
            positions = torch.arange(context + b, device=table.device)
            slots = table[positions // bs] * bs + positions % bs  # (held + m,)
            partial_k = self._partial(layer).transpose(-1, -2)[:, slots // bs, slots % bs]  # (Hkv, held + m, r)
            rows = slice(prefill.start + a, prefill.start + b)
            allowed = self.policy.rows_allowed(
                layer, step.partial_queries[layer][rows], partial_k, held, self.head_dim, self.rank_mean, None
            )  # (m, Hkv, held + m)
            self.stats.selected_rows[layer] += (int(allowed.sum()) - m * hkv) // hkv
            self.stats.cached_rows[layer] += held * m + m * (m - 1) // 2
            keys = self.k[row].view(-1, hkv, self.head_dim).index_select(0, slots).to(q.dtype)
            values = self.v[row].view(-1, hkv, self.head_dim).index_select(0, slots).to(q.dtype)
            out[rows] = attend_allowed(q[rows], keys, values, allowed, meta.softcap)


def selected_table(
    selection: Selection, candidates: PagedCandidates, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What each (sequence, KV head) reads, as a decode kernel's table over the cache viewed by (slot, KV head):
    the selected positions in ascending order, then the sequence's own row (position ``candidates.ends``), as
    ``slot * Hkv + head`` entries: (B * Hkv, K + 1) int32, padded with 0, and how many are read, (B * Hkv,) int32."""
    index, chosen, counts = selection.index, selection.chosen, selection.counts  # (B, Hkv, K), (B, K), (B,)
    batch, width = index.shape[0], index.shape[-1] + 1
    own = candidates.ends.long()[:, None, None].expand(batch, num_kv_heads, 1)
    # Past a sequence's count the index holds placeholders: they sort last, after its own row.
    placeholder = torch.iinfo(torch.long).max
    positions = torch.cat((index.long().masked_fill(~chosen[:, None, :], placeholder), own), dim=-1)
    positions = positions.sort(dim=-1).values
    ends = counts.long() + 1
    read = torch.arange(width, device=index.device)[None, :] < ends[:, None]  # (B, K + 1)
    positions = positions.masked_fill(~read[:, None, :], 0)
    heads = torch.arange(num_kv_heads, device=index.device)[None, :, None]
    table = candidates.slots(positions) * num_kv_heads + heads  # (B, Hkv, K + 1)
    return table.view(batch * num_kv_heads, width).to(torch.int32), ends.repeat_interleave(num_kv_heads).to(torch.int32)


def attend_allowed(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, softcap: float = 0.0
) -> torch.Tensor:
    """q (m, H, D) over keys/values (n, Hkv, D), row i of KV head h reading the keys ``allowed[i, h]`` ((m, Hkv, n)
    bool) -> (m, H, D)."""
    m, num_heads, head_dim = q.shape
    hkv = keys.shape[1]
    qg = q.transpose(0, 1).reshape(hkv, num_heads // hkv, m, head_dim)  # (Hkv, G, m, D)
    mask = allowed.permute(1, 0, 2)[:, None]  # (Hkv, 1, m, n)
    out = sdpa(qg, keys.transpose(0, 1)[:, None], values.transpose(0, 1)[:, None], attn_mask=mask, softcap=softcap)
    return out.reshape(num_heads, m, head_dim).transpose(0, 1)
