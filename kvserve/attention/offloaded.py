"""Attention over a KV cache offloaded to a slower tier: fetch everything, fetch INT4, or fetch what InfiniGen predicts.

Every sequence's full KV lives in a ``KVTier`` (host memory or a memory-mapped file), at the slots the
KV manager hands out; the device holds only what a step reads. Per decode step and layer:

1. at layer i's attention input (``observe_input``) the fetch for layer i + 1 is queued on the
   ``TransferQueue``, so it overlaps layer i's compute: every cached row (``full``), every row in 4-bit
   codes (``int4``), or the rows InfiniGen's rehearsal selects (``infinigen``: layer i + 1's partial
   query from layer i's input against layer i + 1's partial key cache, which stays on the device);
   layer 0 fetches its whole cache at its own input (unless it has a window, below); InfiniGen's layer 1
   selects with its own query once projected (``Rehearsal.own_query_layers``: layer 0's input predicts
   nothing of it), a fetch not overlapped;
2. layer i waits for its fetch, attends over the fetched rows plus the step's own keys, and queues the
   store of its new keys/values (behind any fetch already queued, so a later fetch reads them).

Sequences with several new rows (a prompt, a chunk, a scored continuation) run one at a time: their
cached rows are fetched whole. A prompt's rows attend to everything before them (InfiniGen speculates
for decoding, not prefill); under InfiniGen each row of a *scored* chunk (prompt logprobs, how the eval
tools score a continuation) attends only to the rows its own rehearsal selects among the rows before it,
plus itself, which is what decoding them one by one would read.
With a KV pool limit, a row past the pool's capacity is computed on its own: it selects, attends, and
its keys/values overwrite the victim's slot (per KV head) with its partial key and counters.

Sliding-window layers (``layer_windows``, Gemma 3): the tier keeps every layer's whole context, in one KV
group (the simplest layout; the tier is the large, cheap memory), but a window layer reads only the last
``window`` positions (its own included): a decode fetches just the blocks that cover its window, a chunk
fetches the rows its first row's window reaches and attends with the window's mask. InfiniGen speculates
in window layers too, layer 0 included, among the rows of the window and from the layer's own query
(``Rehearsal.own_query_layers``: a fetch of a few rows of a bounded window, not overlapped). A KV pool
limit overwrites slots in place, so positions no longer follow slots: not with windows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, UnsupportedKVOperation
from kvserve.attention.decode import paged_decode
from kvserve.attention.paged import attend_prefill
from kvserve.attention.softcap import sdpa
from kvserve.attention.step_layout import pad_tables, row_starts, slot_ids
from kvserve.core.step import StepReport
from kvserve.kv.tiers import KVTier, RowSpec, StagingBuffers, Transfer, TransferQueue, gather_rows, scatter_rows
from kvserve.policies.base import KVPolicy
from kvserve.policies.infinigen import InfiniGen, PagedCandidates, Rehearsal, choose_victims
from kvserve.policies.quant import Int4KV, dequantize_int4, quantize_int4

if TYPE_CHECKING:
    from kvserve.core.step import SchedulerOutput

_SELECT_ROWS = 256  # rows of a chunk speculated at once


@dataclass
class _Fetch:
    """Rows of one layer on their way to the device, for the step's decode sequences, as (N, T, Hkv, D) keys
    and values: whole blocks, sequence b's in block b's T rows, or the rows InfiniGen selects (each KV head its
    own), every sequence's one after the other in one block. Sequence b attends to rows ``starts[b] .. own[b]``
    of its block ``blocks[b]``, its new row going in at ``own[b]``."""

    transfer: Transfer
    buffers: dict[str, torch.Tensor]  # the staging buffers it lands in
    shape: tuple[int, ...]  # (N, T, Hkv, D): of the keys/values they hold
    blocks: torch.Tensor  # (B,) long
    starts: torch.Tensor  # (B,) int32
    own: torch.Tensor  # (B,) long


@dataclass(frozen=True)
class _DecodeBlocks:
    """The blocks a decode batch reads in layers of one window size (None: the whole context): sequence b sees
    rows ``starts[b] .. own[b] - 1`` of its W * block_size, and its new row goes in at ``own[b]``."""

    block_index: torch.Tensor  # (Bd, W) long block ids covering each sequence's visible rows and the next one
    candidates: PagedCandidates  # the same blocks as an int32 table, and the cached rows each sequence sees
    own: torch.Tensor  # (Bd,) long
    visible: int  # cached rows the sequences see, together


@dataclass
class _Step:
    decodes: list[int]  # sequences (metadata order) decoding one token, batched
    views: dict[int | None, _DecodeBlocks]  # window size (None: global layers) -> what its layers fetch
    cached: int  # rows the decode sequences hold, together
    rows: torch.Tensor  # (Bd,) long: the decode sequences' rows in the step's tokens
    tokens: torch.Tensor  # (Bd,) int32: their new tokens' indices in their sequences
    write_slots: torch.Tensor | None  # (Bd, Hkv) long: where the new rows go, unless a full pool evicts
    pending: dict[int, _Fetch] = field(default_factory=dict)  # layer -> its fetch
    partial_queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (N, Hkv, G, r)


@dataclass(frozen=True)
class OffloadAttentionMetadata(AttentionMetadata):
    """Per sequence: its block table and the KV it may reach (prompt + max_tokens, for the pool limit)."""

    block_tables: tuple[tuple[int, ...], ...] = ()
    full_lengths: tuple[int, ...] = ()
    # Per sequence: the first row of its chunk that is a scored continuation token (prompt logprobs, how the
    # eval tools score): from there on a row reads what decoding it would. Prompt rows before it attend to
    # everything before them, as InfiniGen's prefill does. () or the chunk length: a plain prompt chunk.
    scored_from: tuple[int, ...] = ()
    block_size: int = 16
    state: _Step | None = None  # the step's plan and its fetches in flight (OffloadedKVCache.build_metadata)


@dataclass
class OffloadStats:
    """Per layer: rows selected (InfiniGen) or fetched against the rows before them, over decode steps and
    scored chunks (a row of a chunk counts the rows before it)."""

    fetched_rows: list[int]
    cached_rows: list[int]
    decode_steps: int = 0

    def fetch_fraction(self) -> list[float]:
        return [f / c if c else 1.0 for f, c in zip(self.fetched_rows, self.cached_rows, strict=True)]


def _check_infinigen(policy: InfiniGen, rehearsal: Rehearsal | None, num_layers: int) -> None:
    """InfiniGen runs with the model's rehearsal and an alpha per layer (resolved from ``"auto"``)."""
    if rehearsal is None:
        raise ValueError("kv_policy='infinigen' needs the model's rehearsal (skewed partial weights)")
    if isinstance(policy.alpha, tuple) and len(policy.alpha) != num_layers:
        raise ValueError(f"infinigen_alpha has {len(policy.alpha)} per-layer values; the model has {num_layers} layers")
    policy.layer_alpha(0)  # raises while alpha is still "auto"


def _check_windows(windows: Sequence[int | None], num_layers: int, policy: KVPolicy) -> tuple[int | None, ...]:
    """Each layer's window (a sliding-window model), or () when every layer sees its whole context."""
    if not any(w is not None for w in windows):
        return ()
    if len(windows) != num_layers:
        raise ValueError(f"layer_windows has {len(windows)} entries; the model has {num_layers} layers")
    if isinstance(policy, InfiniGen) and policy.pool_limit < 1:
        raise ValueError(
            f"kv_pool_limit={policy.pool_limit} overwrites slots in place, so a sliding-window layer could no longer "
            "find its window by position: use kv_pool_limit=1 on a model with sliding-window layers"
        )
    return tuple(windows)


class OffloadedKVCache(AttentionBackend):
    """Full KV in a slower tier, fetched per layer and step according to ``policy`` (see the module doc)."""

    def __init__(
        self,
        policy: KVPolicy,
        tier_kind: str,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        path: str | None = None,
        rehearsal: Rehearsal | None = None,
        queue: TransferQueue | None = None,
        layer_windows: Sequence[int | None] = (),
        softcap: float = 0.0,
    ) -> None:
        """``softcap``: the attention-logit soft cap of every layer (0: none). InfiniGen selects rows by its
        speculated logits as they are, uncapped: its threshold is calibrated on those against the capped exact
        weights (``policies/calibration.py``), so selection and calibration agree."""
        if policy.name not in ("full", "infinigen", "int4"):
            raise ValueError(f"kv_offload runs kv_policy full, infinigen or int4, not {policy.name!r}")
        if isinstance(policy, InfiniGen):
            _check_infinigen(policy, rehearsal, num_layers)
        self.layer_windows = _check_windows(layer_windows, num_layers, policy)
        self.softcap = softcap
        self.policy, self.rehearsal = policy, rehearsal
        self.rank_mean: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallelism: set_rank_mean
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.num_slots = num_blocks * block_size
        self.rows = _row_specs(policy, num_kv_heads, head_dim, dtype)
        self.tier = KVTier(tier_kind, num_layers, self.num_slots, self.rows, self.device.type == "cuda", path)
        self.queue = queue or TransferQueue(self.device, fault="kv-disk" if tier_kind == "disk" else None)
        self.staging = StagingBuffers(self.rows, self.device)
        self.stats = OffloadStats([0] * num_layers, [0] * num_layers)
        self.partial_keys = self.pool = None
        if rehearsal is not None:
            # Per KV head, each block's (r, block_size) transposed: speculation's dot products run across a
            # block's keys, contiguous (``csrc/speculate.cpp``). ``_partial_rows`` views it by slot.
            shape = (num_layers, num_kv_heads, num_blocks, rehearsal.partial_dims, block_size)
            self.partial_keys = torch.zeros(shape, dtype=dtype, device=self.device)  # device tier
        if isinstance(policy, InfiniGen) and policy.pool_limit < 1:
            # Per (layer, slot, KV head): times selected, last row that selected it, row that inserted it.
            self.pool = torch.zeros(
                (3, num_layers, self.num_slots, num_kv_heads), dtype=torch.int32, device=self.device
            )

    @property
    def block_bytes(self) -> int:
        """Slower-tier bytes of one block (every layer)."""
        return self.tier.slot_bytes(self.num_layers) * self.block_size

    # ----- block operations the runner asks for -----

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write of forked sequences: the tier's rows, their partial keys and pool counters."""
        if not pairs:
            return
        self.queue.synchronize()  # no store may land in a block while it is copied
        self.tier.copy_blocks(list(pairs), self.block_size)
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        if self.partial_keys is not None:  # blocks on dim 2
            self.partial_keys.index_copy_(2, dst, self.partial_keys.index_select(2, src))
        if self.pool is not None:
            blocks = self.pool.unflatten(2, (self.num_blocks, self.block_size))
            blocks.index_copy_(2, dst, blocks.index_select(2, src))

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Single token slots (src, dst) in every layer: a Prompt Cache module's partial last block copied into a
        request that imports it, in the tier, with the slots' partial keys and pool counters."""
        if not pairs:
            return
        self.queue.synchronize()  # the module's stores have landed, and none lands in a slot while it is copied
        self.tier.copy_slots(list(pairs))
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        if self.partial_keys is not None:
            rows = self._partial_rows()  # (L, Hkv, blocks, bs, r)
            bs = self.block_size
            rows[:, :, dst // bs, dst % bs] = rows[:, :, src // bs, src % bs]
        if self.pool is not None:  # slots on dim 2
            self.pool.index_copy_(2, dst, self.pool.index_select(2, src))

    def swap_out(self, pairs: Sequence[tuple[int, int]], host_cache: object = None) -> None:
        raise UnsupportedKVOperation("an offloading engine preempts by recompute (its KV is already off the device)")

    swap_in = swap_out

    def bytes_moved(self) -> dict[str, int]:
        return {"fetched": self.queue.stats.bytes_fetched, "stored": self.queue.stats.bytes_stored}

    def set_rank_mean(self, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """InfiniGen fetches per KV head, but how many rows a layer fetches is the mean over every query head."""
        self.rank_mean = mean

    def close(self) -> None:
        self.queue.close()

    def report(self, metadata: AttentionMetadata) -> StepReport:
        self.queue.check()  # a failed store leaves rows missing from the tier: the step must not count as done
        return super().report(metadata)

    def recover(self) -> None:
        self.queue.drain()

    # ----- a step -----

    def build_metadata(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> OffloadAttentionMetadata:
        self.queue.check()  # a store of the last step that failed after its report: this step's sequences redo it
        scheduled = out.scheduled
        metadata = OffloadAttentionMetadata(
            seq_ids=tuple(s.seq_id for s in scheduled),
            query_lens=tuple(len(s.token_ids) for s in scheduled),
            context_lens=tuple(s.num_computed_tokens for s in scheduled),
            block_tables=tuple(s.block_tables[0] for s in scheduled),
            full_lengths=tuple(max(s.full_length, s.num_computed_tokens + len(s.token_ids)) for s in scheduled),
            scored_from=tuple(
                max(0, s.score_from - s.num_computed_tokens) if s.seq_id in rows_from else len(s.token_ids)
                for s in scheduled
            ),
            block_size=self.block_size,
        )
        return dataclasses.replace(metadata, state=self._plan_step(metadata))

    def _plan_step(self, metadata: OffloadAttentionMetadata) -> _Step:
        """The step's decode batch (the blocks its rows are in), planned once for every layer."""
        # One new row over a cache: batched and fetched ahead. A one-token prompt has nothing to fetch.
        decodes = [i for i, n in enumerate(metadata.query_lens) if n == 1 and metadata.context_lens[i] > 0]
        held = [self._held(metadata, i) for i in decodes]
        bs = self.block_size
        starts = row_starts(metadata.query_lens)
        tokens = [metadata.context_lens[i] for i in decodes]
        evicting = any(t >= self._capacity(metadata, i) for i, t in zip(decodes, tokens, strict=True))
        write = None
        if not evicting:  # each new row at its own slot, in every layer
            own_slots = [metadata.block_tables[i][t // bs] * bs + t % bs for i, t in zip(decodes, tokens, strict=True)]
            write = torch.tensor(own_slots, dtype=torch.long, device=self.device)[:, None].expand(-1, self.num_kv_heads)
        if decodes:
            self.stats.decode_steps += 1
        views = {w: self._decode_blocks(metadata, decodes, held, w) for w in set(self.layer_windows or (None,))}
        return _Step(
            decodes, views, sum(held), torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=self.device),
            torch.tensor(tokens, dtype=torch.int32, device=self.device), write,
        )  # fmt: skip

    def _decode_blocks(
        self, meta: OffloadAttentionMetadata, decodes: list[int], held: list[int], window: int | None
    ) -> _DecodeBlocks:
        """Per decode sequence, the whole blocks from its window's first row (0 without a window) up to and
        including its next row: its own key/value goes there once fetched."""
        bs = self.block_size
        firsts = [max(0, h + 1 - window) if window else 0 for h in held]  # first visible row
        lows = [f // bs for f in firsts]  # first block read
        width = max((h // bs - low + 1 for h, low in zip(held, lows, strict=True)), default=1)
        tables = [meta.block_tables[i][low : h // bs + 1] for i, h, low in zip(decodes, held, lows, strict=True)]
        blocks = pad_tables(tables, width)  # (Bd, W)
        base = torch.tensor(lows, dtype=torch.long) * bs  # (Bd,) row of the first block read
        own = torch.tensor(held, dtype=torch.long) - base
        starts = torch.tensor(firsts, dtype=torch.long) - base
        blocks = blocks.to(self.device)
        candidates = PagedCandidates(
            blocks, bs, starts.to(torch.int32).to(self.device), own.to(torch.int32).to(self.device)
        )
        visible = sum(h - f for h, f in zip(held, firsts, strict=True))
        return _DecodeBlocks(blocks.long(), candidates, own.to(self.device), visible)

    def store_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        scores: torch.Tensor | None = None,
    ) -> None:
        """A parallel prefill's keys/values (T, Hkv, D) of one sequence's whole prompt, to its slots in the tier
        (with their partial keys and pool counters)."""
        if len(metadata.seq_ids) != 1 or metadata.context_lens[0] != 0:
            raise ValueError("an offloaded cache stores layers computed elsewhere for one whole prompt at a time")
        m = k.shape[0]
        write = self._write_slots(layer, metadata, 0, 0, m)  # (m, Hkv)
        self._store(layer, write, k, v, torch.arange(m, dtype=torch.int32, device=self.device))

    def observe_input(
        self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> None:
        if not isinstance(metadata, OffloadAttentionMetadata):
            return
        step = metadata.state
        nxt = layer + 1
        rehearsed = self._speculates(nxt) and nxt not in self.rehearsal.own_query_layers
        if rehearsed:
            step.partial_queries[nxt] = self.rehearsal.partial_query(nxt, x, rope)  # (N, Hkv, G, r)
        if not step.decodes:
            return
        if layer == 0 and not self._speculates(0):
            step.pending[0] = self._fetch_blocks(0, step)
        if nxt < self.num_layers and not self._speculates(nxt):
            step.pending[nxt] = self._fetch_blocks(nxt, step)
        elif rehearsed:
            step.pending[nxt] = self._fetch_selected(nxt, step, metadata)

    def _speculates(self, layer: int) -> bool:
        """Whether InfiniGen selects ``layer``'s rows (every layer but a full-attention layer 0; a window layer
        among its window's rows)."""
        return self.rehearsal is not None and layer in self.rehearsal.speculated_layers

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if not isinstance(metadata, OffloadAttentionMetadata):
            raise TypeError(f"OffloadedKVCache needs OffloadAttentionMetadata, got {type(metadata).__name__}")
        starts = row_starts(metadata.query_lens)
        step = metadata.state
        if self._speculates(layer) and layer in self.rehearsal.own_query_layers:  # selects from its own query
            step.partial_queries[layer] = self.rehearsal.partial_from_query(layer, q)
            if step.decodes:
                step.pending[layer] = self._fetch_selected(layer, step, metadata)
        if len(step.decodes) == len(metadata.query_lens):
            return self._decode(layer, q, k, v, metadata)
        out = torch.empty_like(q)  # (N, H, D)
        if step.decodes:
            rows = step.rows
            out.index_copy_(0, rows, self._decode(layer, q[rows], k[rows], v[rows], metadata))
        batched = set(step.decodes)
        for i, n in enumerate(metadata.query_lens):
            if i not in batched:
                rows = slice(starts[i], starts[i] + n)
                out[rows] = self._chunk(layer, q[rows], k[rows], v[rows], metadata, i, rows)
        return out

    # ----- decode: batched, fetched ahead -----

    def _decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: OffloadAttentionMetadata
    ) -> torch.Tensor:
        """One new row per decode sequence: q (B, H, D), k/v (B, Hkv, D) -> (B, H, D)."""
        step = meta.state
        fetch = step.pending.pop(layer)
        fetch.transfer.wait()
        keys, values = self._dequantized(fetch.buffers, fetch.shape)  # (N, T, Hkv, D)
        # The step's own key/value is on the device already: it takes the spare row each fetch left.
        keys[fetch.blocks, fetch.own], values[fetch.blocks, fetch.own] = k, v
        # The fetched rows are blocks of the paged kernel: no copy, only each sequence's range is read.
        tables = fetch.blocks.to(torch.int32)[:, None]
        out, _ = paged_decode(
            q, keys, values, tables, fetch.starts, (fetch.own + 1).to(torch.int32), softcap=self.softcap
        )
        self._store_decodes(layer, k, v, meta)
        return out

    def _fetch_blocks(self, layer: int, step: _Step) -> _Fetch:
        """Every cached row the decode sequences see in ``layer`` (their window's, in a window layer), as
        whole blocks (the fetch-everything baseline)."""
        view = step.views[self._window(layer)]
        blocks = view.block_index.view(-1)
        num_rows = blocks.numel() * self.block_size
        batch = view.block_index.shape[0]
        self._count(layer, view.visible, step.cached)
        out = {name: self.staging.get(name, layer, num_rows) for name in self.rows}

        def copy() -> None:
            for name, buffer in out.items():
                array = self.tier.arrays[name][layer]
                by_block = array.view(self.num_blocks, self.block_size * math.prod(array.shape[1:]))
                gather_rows(by_block, blocks, buffer.view(blocks.numel(), -1))

        shape = (batch, num_rows // batch, self.num_kv_heads, self.head_dim)
        transfer = self.queue.fetch(copy, num_rows * self._row_bytes())
        sequence_blocks = torch.arange(batch, device=self.device)  # sequence b's rows are block b
        return _Fetch(transfer, out, shape, sequence_blocks, view.candidates.starts, view.own)

    def _fetch_selected(self, layer: int, step: _Step, meta: OffloadAttentionMetadata) -> _Fetch:
        """The rows layer ``layer``'s rehearsal selects for each decode sequence (InfiniGen)."""
        partial_q = step.partial_queries[layer].index_select(0, step.rows)  # (B, Hkv, G, r)
        view = step.views[self._window(layer)]  # a window layer selects among its window's rows
        batch = partial_q.shape[0]
        selection, slots = self.policy.select_decode_rows(
            layer, partial_q, self.partial_keys[layer], view.candidates, self.head_dim, self.rank_mean
        )  # slots (B, Hkv, K)
        # One more row per (sequence, head), any row: the step's own key/value goes there once fetched.
        slots = F.pad(slots, (0, 1))
        counts = selection.counts.to(slots.device)
        heads = torch.arange(self.num_kv_heads, device=slots.device)[None, :, None]
        # Rows of the tier's (slots * Hkv, D) view, ordered (row, Hkv): row j of a sequence holds each KV head's
        # j-th pick. Only its count of picks and the spare row: past its count a sequence's slots are
        # placeholders (K is the batch's largest count), so the sequences' rows go one after the other.
        keep = torch.arange(slots.shape[-1], device=slots.device)[None, :] <= counts[:, None]  # (B, K + 1)
        flat = (slots * self.num_kv_heads + heads).transpose(1, 2)[keep].reshape(-1)
        own = torch.cumsum(counts + 1, 0) - 1  # each sequence's spare row, after its picks
        starts = own - counts  # its first pick
        total = flat.numel() // self.num_kv_heads
        self._count(layer, int(selection.counts.sum()), step.cached)
        if self.pool is not None:
            self._note_selected(
                layer, slots[..., :-1], selection.chosen, step.tokens
            )  # the selected, not the spare row
        out = {name: self.staging.get(name, layer, total) for name in self.rows}  # total x every head

        def copy() -> None:
            for name, buffer in out.items():
                array = self.tier.arrays[name][layer]  # (slots, Hkv, *row)
                gather_rows(array.view(self.num_slots * self.num_kv_heads, -1), flat, buffer.view(flat.numel(), -1))

        nbytes = flat.numel() * self._row_bytes() // self.num_kv_heads
        shape = (1, total, self.num_kv_heads, self.head_dim)  # one block: every sequence's rows
        blocks = torch.zeros(batch, dtype=torch.long, device=self.device)
        starts = starts.to(self.device, torch.int32)
        return _Fetch(self.queue.fetch(copy, nbytes), out, shape, blocks, starts, own.to(self.device))

    def _store_decodes(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: OffloadAttentionMetadata) -> None:
        """The decode rows' keys/values (B, Hkv, D) to the tier: at their own slot, or over a victim's."""
        step = meta.state
        slots = step.write_slots
        if slots is None:  # some pool is full: victims differ per layer
            slots = torch.cat([self._write_slots(layer, meta, i, meta.context_lens[i]) for i in step.decodes])
        self._store(layer, slots, k, v, step.tokens)  # slots (B, Hkv)

    # ----- several rows of one sequence -----

    def _chunk(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: OffloadAttentionMetadata, i: int,
        rows: slice,
    ) -> torch.Tensor:  # fmt: skip
        """m rows of sequence i: q (m, H, D), k/v (m, Hkv, D) -> (m, H, D)."""
        m = q.shape[0]
        context = meta.context_lens[i]
        bulk = max(0, min(m, self._capacity(meta, i) - context))  # rows that still find a free slot of their own
        selective = isinstance(self.policy, InfiniGen) and self._speculates(layer)
        if not selective and meta.scored_from:  # speculation counts its own picks (_select_rows)
            self._count_reads(layer, meta, i, context + min(meta.scored_from[i], m), context + m)
        first_scored = min(meta.scored_from[i], bulk) if meta.scored_from and selective else 0
        out = torch.empty_like(q)
        if first_scored:  # prompt rows: attend to everything before them, in one piece
            out[:first_scored] = self._chunk_rows(layer, q[:first_scored], k[:first_scored], v[:first_scored],
                                                  meta, i, rows.start, context, select=False)  # fmt: skip
        # Selecting rows go in pieces: the (rows, H, keys) speculation stays small, and a piece reads the rows
        # before it from the tier like any cached row.
        piece = _SELECT_ROWS if selective else max(bulk, 1)
        for a in range(first_scored, bulk, piece):
            b = min(a + piece, bulk)
            out[a:b] = self._chunk_rows(layer, q[a:b], k[a:b], v[a:b], meta, i, rows.start + a, context + a, selective)
        for j in range(bulk, m):  # a full pool: each row selects, attends and replaces a victim in turn
            out[j : j + 1] = self._chunk_rows(
                layer, q[j : j + 1], k[j : j + 1], v[j : j + 1], meta, i, rows.start + j, context + j, selective
            )
        return out

    def _chunk_rows(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: OffloadAttentionMetadata, i: int,
        first_row: int, token: int, select: bool,
    ) -> torch.Tensor:  # fmt: skip
        """Rows of sequence i that all fit the pool (or one row that evicts), the first being row ``first_row``
        of the step and token ``token`` of its sequence: attend (each only to the rows InfiniGen selects for
        it, if ``select``), then store."""
        m = q.shape[0]
        held, window = min(token, self._capacity(meta, i)), self._window(layer)
        first = max(0, token + 1 - window) if window else 0  # the first row the chunk's first row sees
        allowed = None
        if held > first:
            slots = self._slots(meta.block_tables[i], held, first)  # (h,) the pool's slots
            keys, values = self._fetch_rows(layer, slots)  # (h, Hkv, D)
            keys, values = torch.cat((keys, k)), torch.cat((values, v))
            if select:
                allowed = self._select_rows(layer, slots, k, meta, first_row, m, token)
        else:  # nothing cached to select among: the rows read the chunk's rows before them, as counted unselected
            keys, values = k, v
            if select:
                self._count_reads(layer, meta, i, token, token + m)
        out = _attend(q, keys, values, max(0, held - first), allowed, window, self.softcap)
        write = self._write_slots(layer, meta, i, token, m)  # (m, Hkv)
        tokens = torch.arange(token, token + m, dtype=torch.int32, device=self.device)
        self._store(layer, write, k, v, tokens)
        return out

    def _select_rows(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, meta: OffloadAttentionMetadata, first_row: int, m: int,
        token: int,
    ) -> torch.Tensor:  # fmt: skip
        """Which of the h cached rows and m new rows each of the m rows may read: (m, Hkv, h + m) bool."""
        held = slots.numel()
        partial_q = meta.state.partial_queries[layer][first_row : first_row + m]  # (m, Hkv, G, r)
        cached = self._partial_rows(layer)[:, slots // self.block_size, slots % self.block_size]  # (Hkv, h, r)
        partial_k = torch.cat((cached, self.rehearsal.partial_key(layer, k).transpose(0, 1)), dim=1)  # (Hkv, h + m, r)
        window = self._window(layer)
        allowed = self.policy.rows_allowed(layer, partial_q, partial_k, held, self.head_dim, self.rank_mean, window)
        # allowed: (m, Hkv, h + m)
        cached_picks = allowed[:, :, :held]
        # Per row: rows selected among the h + j before it (every KV head), against all of them (a window layer's
        # h cached rows are its first row's window: against every row before each, as _count_reads counts).
        before = held * m if window is None else token * m
        selected = (int(allowed.sum()) - m * self.num_kv_heads) // self.num_kv_heads
        self._count(layer, selected, before + m * (m - 1) // 2)
        if self.pool is not None:
            last_row = torch.tensor([token + m - 1], dtype=torch.int32, device=self.device)
            every = slots[None, None, :].expand(1, self.num_kv_heads, held)
            self._note_selected(layer, every, cached_picks.any(dim=0)[None], last_row, cached_picks.sum(dim=0)[None])
        return allowed

    # ----- the pool -----

    def _capacity(self, meta: OffloadAttentionMetadata, i: int) -> int:
        if isinstance(self.policy, InfiniGen):
            return self.policy.pool_slots(meta.full_lengths[i])
        return meta.full_lengths[i]

    def _held(self, meta: OffloadAttentionMetadata, i: int) -> int:
        return min(meta.context_lens[i], self._capacity(meta, i))

    def _write_slots(self, layer: int, meta: OffloadAttentionMetadata, i: int, token: int, m: int = 1) -> torch.Tensor:
        """(m, Hkv) slots where tokens token.. of sequence i go in ``layer``: their own while the pool has
        room, else (one row at a time) each head's victim."""
        cap = self._capacity(meta, i)
        if token + m <= cap:
            return self._slots(meta.block_tables[i], token + m, token)[:, None].expand(m, self.num_kv_heads)
        if m != 1:
            raise ValueError(f"rows past the KV pool's capacity ({cap}) are stored one at a time, got {m}")
        slots = self._slots(meta.block_tables[i], cap)  # (cap,)
        counts, last, inserted = (a[layer].index_select(0, slots).transpose(0, 1) for a in self.pool)  # (Hkv, cap)
        return slots[choose_victims(self.policy.pool_eviction, counts, last, inserted)][None]  # (1, Hkv)

    def _note_selected(
        self,
        layer: int,
        slots: torch.Tensor,
        chosen: torch.Tensor,
        now: torch.Tensor,
        times: torch.Tensor | None = None,
    ) -> None:
        """Pool counters: of slots (B, Hkv, K), ``chosen`` (B, K) or (B, Hkv, K) were selected (``times`` times,
        else once) by rows ``now`` (B,)."""
        if chosen.dim() == 2:
            chosen = chosen[:, None, :].expand_as(slots)
        heads = torch.arange(self.num_kv_heads, device=slots.device)[None, :, None].expand_as(slots)
        flat = (slots * self.num_kv_heads + heads)[chosen]
        counts, last = self.pool[0, layer].view(-1), self.pool[1, layer].view(-1)
        increments = times[chosen] if times is not None else torch.ones_like(flat, dtype=torch.int32)
        counts.index_add_(0, flat, increments.to(torch.int32))
        last.index_copy_(0, flat, now[:, None, None].expand_as(slots)[chosen])

    # ----- tier transfers -----

    def _store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rows k/v (R, Hkv, D) to ``slots`` (R, Hkv) of the tier, with their partial keys and counters."""
        heads = torch.arange(self.num_kv_heads, device=slots.device)[None, :]
        flat = (slots * self.num_kv_heads + heads).view(-1)  # (R * Hkv,)
        if self.partial_keys is not None:
            partial = self.rehearsal.partial_key(layer, k).transpose(0, 1)  # (Hkv, R, r)
            by_head = slots.t()  # (Hkv, R)
            rows = self._partial_rows(layer)  # (Hkv, blocks, bs, r)
            rows[heads.t().expand_as(by_head), by_head // self.block_size, by_head % self.block_size] = partial
        if self.pool is not None:
            stamps = tokens[:, None].expand_as(slots).reshape(-1)
            self.pool[0, layer].view(-1).index_fill_(0, flat, 0)
            self.pool[1, layer].view(-1).index_copy_(0, flat, stamps)
            self.pool[2, layer].view(-1).index_copy_(0, flat, stamps)
        encoded = {name: rows.reshape(flat.numel(), -1).contiguous() for name, rows in self._encoded(k, v).items()}

        def copy() -> None:
            for name, rows in encoded.items():
                array = self.tier.arrays[name][layer]
                scatter_rows(array.view(self.num_slots * self.num_kv_heads, -1), flat, rows)

        self.queue.store(copy, flat.numel() * self._row_bytes() // self.num_kv_heads)

    def _partial_rows(self, layer: int | None = None) -> torch.Tensor:
        """The partial keys by slot: (Hkv, blocks, block_size, r) of ``layer``, or (L, ...) of every layer (a view)."""
        keys = self.partial_keys if layer is None else self.partial_keys[layer]
        return keys.transpose(-1, -2)

    def _fetch_rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head of ``slots`` (h,) in ``layer``, fetched and waited for: (h, Hkv, D) keys and values."""
        out = {name: self.staging.get(name, layer, slots.numel()) for name in self.rows}

        def copy() -> None:
            for name, buffer in out.items():
                array = self.tier.arrays[name][layer]
                gather_rows(array.view(self.num_slots, -1), slots, buffer.view(slots.numel(), -1))

        self.queue.fetch(copy, slots.numel() * self._row_bytes()).wait()
        return self._dequantized(out, (slots.numel(), self.num_kv_heads, self.head_dim))

    def _encoded(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        if not isinstance(self.policy, Int4KV):
            return {"k": k, "v": v}
        (kc, ks), (vc, vs) = quantize_int4(k, self.policy.group_size), quantize_int4(v, self.policy.group_size)
        return {"k": kc, "k_scale": ks, "v": vc, "v_scale": vs}

    def _dequantized(
        self, fetched: dict[str, torch.Tensor], shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fetched rows as keys and values of ``shape`` (INT4 codes are dequantised on the device)."""
        if not isinstance(self.policy, Int4KV):
            return fetched["k"].view(shape), fetched["v"].view(shape)
        codes = shape[:-1] + (self.head_dim // 2,)
        scales = shape[:-1] + (self.head_dim // self.policy.group_size, 2)
        k = dequantize_int4(fetched["k"].view(codes), fetched["k_scale"].view(scales), self.dtype)
        v = dequantize_int4(fetched["v"].view(codes), fetched["v_scale"].view(scales), self.dtype)
        return k, v

    def _row_bytes(self) -> int:
        """Tier bytes of one slot in one layer (every head, every array)."""
        return self.tier.slot_bytes(1)

    def _count_reads(self, layer: int, meta: OffloadAttentionMetadata, i: int, begin: int, end: int) -> None:
        """Scored rows begin..end-1 of sequence i read every row before them that the pool holds, or their window's."""
        if end <= begin:
            return
        before = torch.arange(begin, end)  # rows before each
        reads = before.clamp(max=self._capacity(meta, i))
        window = self._window(layer)
        if window:
            reads = reads.clamp(max=window - 1)
        self._count(layer, int(reads.sum()), int(before.sum()))

    def _window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def _count(self, layer: int, fetched: int, cached: int) -> None:
        self.stats.fetched_rows[layer] += fetched
        self.stats.cached_rows[layer] += cached

    def _slots(self, table: tuple[int, ...], end: int, begin: int = 0) -> torch.Tensor:
        """(end - begin,) slot ids of a sequence's rows begin..end-1."""
        return slot_ids(table, begin, end, self.block_size, self.device)


def offload_block_bytes(
    policy: KVPolicy, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
) -> int:
    """Slower-tier bytes of one block of ``block_size`` tokens in every layer under ``policy``."""
    per_slot = sum(spec.row_bytes for spec in _row_specs(policy, num_kv_heads, head_dim, dtype).values())
    return per_slot * num_layers * block_size


def _row_specs(policy: KVPolicy, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, RowSpec]:
    if isinstance(policy, Int4KV):
        codes = RowSpec((num_kv_heads, head_dim // 2), torch.uint8)
        scales = RowSpec((num_kv_heads, policy.groups(head_dim), 2), dtype)
        return {"k": codes, "k_scale": scales, "v": codes, "v_scale": scales}
    return {"k": RowSpec((num_kv_heads, head_dim), dtype), "v": RowSpec((num_kv_heads, head_dim), dtype)}


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: int,
    allowed: torch.Tensor | None,
    window: int | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q (m, H, D) at positions held.. over keys/values (held + m, Hkv, D), each row over the last ``window`` of
    them (None: all); ``allowed`` (m, Hkv, held + m) instead says what each row reads (InfiniGen's selection, made
    within the window); logits soft-capped by ``softcap`` (0: none). -> (m, H, D)."""
    if allowed is None:
        return attend_prefill(q, keys, values, held, window, softcap)
    m, num_heads, head_dim = q.shape
    hkv = keys.shape[1]
    qg = q.transpose(0, 1).reshape(hkv, num_heads // hkv, m, head_dim)  # (Hkv, G, m, D)
    mask = allowed.permute(1, 0, 2)[:, None]  # (Hkv, 1, m, h + m)
    out = sdpa(qg, keys.transpose(0, 1)[:, None], values.transpose(0, 1)[:, None], attn_mask=mask, softcap=softcap)
    return out.reshape(num_heads, m, head_dim).transpose(0, 1)
