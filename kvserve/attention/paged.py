"""Paged KV cache and attention: PagedAttention (Kwon et al., SOSP'23, https://arxiv.org/abs/2309.06180).

The cache is a pool of fixed-size blocks; a sequence's tokens live in the blocks listed in its
block table, in order, so block ``table[j]`` holds its tokens ``j * block_size ..``. Each new
token goes to the cache slot ``block_id * block_size + offset`` given by the step's slot mapping.

Layout: one tensor per K and V shaped (num_layers, num_blocks, block_size, Hkv, D), i.e. per
layer block-major, then token-major inside a block. Why this and not (.., Hkv, block_size, D):

- Gathering a sequence is one ``index_select`` of whole blocks (each block is one contiguous run
  of ``block_size * Hkv * D`` values in either layout), and here the result (blocks, block_size,
  Hkv, D) *is* (tokens, Hkv, D): the reshape is free and SDPA reads the (Hkv, tokens, D) transpose
  through its strides. The head-major layout needs a permute + copy after the gather; on CPU it
  measured about 2x slower (B=32, context 512, SmolLM2 heads: 3.1 ms against 1.35 ms).
- Writing the step's keys is one ``index_copy_`` of the (N, Hkv, D) rows into the (slots, Hkv, D)
  view, with no transpose.
- A (layer, block) pair is contiguous, which is what a swap between tiers copies.

Decode sequences (query length 1) of a step are batched into one ``paged_decode`` call (``decode.py``),
which reads each sequence's blocks in place through its block table: the compiled CPU kernel, or the torch
reference (a gather and one masked SDPA) elsewhere. Prefills (fresh or chunked) run one causal attention per
sequence offset by the context length: SDPA, or in bfloat16 on CPUs with AVX512-BF16 and no AMX kvserve's
own kernel (``flash_prefill.py``).

Padding entries of a block table point at block 0; the attention masks keep them out, and the cache
is zero-initialised so that no slot ever holds NaN (0 * NaN would leak through a mask).

A quantized cache (``kv_quant``: int8 or int4, ``kv_quant.py``) holds byte rows (.., Hkv, row_bytes) instead of
(.., Hkv, D) values, so every block move above is unchanged. Queries, keys and values are rotated as they meet
the cache and the output rotated back; every query, of decodes and prefills alike, sees the keys as the cache
holds them (the step's own keys read back from their rows). Decodes read the rows in place; a prefill after a
context dequantises its sequence's blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, InPlaceDecode
from kvserve.attention.block_moves import check_pairs, check_peers, read_slots, transfer, write_slots
from kvserve.attention.decode import paged_decode
from kvserve.attention.flash_prefill import flash_prefill, use_flash_prefill
from kvserve.attention.kv_quant import KVQuant, widen
from kvserve.attention.masks import causal_mask, window_binds
from kvserve.attention.paged_metadata import PagedAttentionMetadata
from kvserve.attention.paged_plan import DecodeView, StepPlan, attend_positioned, decode_view, make_plan
from kvserve.attention.row_invariant import RowPlan, attend_row_calls, plan_row_calls
from kvserve.attention.softcap import sdpa
from kvserve.errors import KVTierError
from kvserve.kv import huge_pages

if TYPE_CHECKING:
    from kvserve.core.step import SchedulerOutput


class PagedKVCache(AttentionBackend):
    """Block pool of keys and values for every layer, and attention that reads it through block tables."""

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
        layer_rows: Sequence[int] = (),
        batch_invariant: bool = False,
        num_host_blocks: int = 0,
        layer_to_group: Sequence[int] = (),
        layer_windows: Sequence[int | None] = (),
        softcap: float = 0.0,
        kv_quant: KVQuant | None = None,
    ) -> None:
        """``layer_rows``: per layer, its row of a block when KV groups share block storage (``kv/layout.py``);
        () gives every layer a row of its own. ``batch_invariant``: attend each query row in a call shaped by
        its own position (``row_invariant.py``), so its result does not depend on the rest of the step.
        ``num_host_blocks``: a host tier of that many blocks to swap to (0: none). ``layer_to_group`` and
        ``layer_windows`` and ``softcap`` go into the metadata this cache builds (KV groups, sliding windows, the
        attention-logit soft cap). ``kv_quant``: hold the rows quantized (int8, int4), attended in ``dtype``."""
        sizes = dict(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        bad = {name: value for name, value in sizes.items() if value < 1}
        if bad:
            raise ValueError(f"cache sizes must be >= 1, got {bad}")
        self.layer_rows = tuple(layer_rows) or tuple(range(num_layers))
        if len(self.layer_rows) != num_layers:
            raise ValueError(f"layer_rows names {len(self.layer_rows)} layers; the model has {num_layers}")
        if kv_quant is not None and batch_invariant:
            raise ValueError(f"a {kv_quant.name} cache does not run batch-invariant attention")
        if kv_quant is not None and kv_quant.head_dim != head_dim:
            raise ValueError(f"{kv_quant} is for heads of {kv_quant.head_dim} values, the cache's are {head_dim}")
        self.kv_quant, self.dtype = kv_quant, dtype
        row = kv_quant.row_bytes if kv_quant is not None else head_dim
        shape = (max(self.layer_rows) + 1, num_blocks, block_size, num_kv_heads, row)
        storage = torch.uint8 if kv_quant is not None else dtype
        # Zeros, not empty: padding reads masked slots, which must not hold NaN (zero int8/int4 rows read as 0).
        self.k = huge_pages.zeros(shape, storage, device, pin_memory)
        self.v = huge_pages.zeros(shape, storage, device, pin_memory)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.batch_invariant = batch_invariant
        self.layer_to_group = tuple(layer_to_group)
        self.layer_windows = tuple(layer_windows) if any(w is not None for w in layer_windows) else ()
        self.softcap = softcap
        self.host_cache = self._make_swap_space(num_host_blocks) if num_host_blocks else None
        self._plan: StepPlan | None = None  # the plan of ``_plan_metadata``, the step attended last
        self._plan_metadata: PagedAttentionMetadata | None = None

    def _make_swap_space(self, num_blocks: int) -> PagedKVCache:
        try:
            return self.make_host_cache(num_blocks)
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory errors are RuntimeErrors
            nbytes = 2 * self.k[:, :1].nbytes * num_blocks  # keys and values of one block, every layer
            raise KVTierError(
                f"the host tier for swapping ({num_blocks} blocks, {nbytes:,} bytes: swap_space) could not be "
                f"allocated: {exc}; lower swap_space, or set it to 0 to preempt by recompute"
            ) from None

    def make_host_cache(self, num_blocks: int | None = None) -> PagedKVCache:
        """A CPU cache with this one's block shape to swap to (pinned when this cache is on CUDA)."""
        return PagedKVCache(
            self.num_layers,
            num_blocks or self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            "cpu",
            pin_memory=self.k.is_cuda,
            layer_rows=self.layer_rows,
            kv_quant=self.kv_quant,
        )

    # ----- block movement -----

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: copy each (src, dst) block's contents in every layer (all reads before writes)."""
        if not pairs:
            return
        src, dst = check_pairs(pairs, self.num_blocks, self.num_blocks)
        src_t = torch.tensor(src, dtype=torch.long, device=self.k.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.k.device)
        for cache in (self.k, self.v):
            blocks = cache.flatten(2)  # (L, n, block_size * Hkv * D): index_select is ~3x slower over (.., 1, D)
            blocks.index_copy_(1, dst_t, blocks.index_select(1, src_t))

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy single token slots ``(src, dst)`` (slot = block * block_size + offset) in every layer:
        Prompt Cache modules' partial last blocks into the sequences that import them."""
        if not pairs:
            return
        src, dst = check_pairs(pairs, self.num_slots, self.num_slots)
        src_t = torch.tensor(src, dtype=torch.long, device=self.k.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.k.device)
        for cache in (self.k, self.v):
            flat = cache.view(cache.shape[0], self.num_slots, self.num_kv_heads * cache.shape[-1])
            flat.index_copy_(1, dst_t, flat.index_select(1, src_t))

    def read_slots(self, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` in every layer (``block_moves.read_slots``)."""
        return read_slots(self, slots)

    def write_slots(self, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write keys and values into ``slots`` of every layer (``block_moves.write_slots``)."""
        write_slots(self, slots, k, v)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def swap_out(self, pairs: Sequence[tuple[int, int]], host_cache: PagedKVCache | None = None) -> None:
        """Copy (this cache's block, host block) pairs to ``host_cache`` (default: this cache's host tier).

        On CUDA the copies are asynchronous on the current stream: synchronise it (or wait on an
        event recorded after this call) before reading the host blocks.
        """
        host = self._host(host_cache)
        transfer(self, host, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]], host_cache: PagedKVCache | None = None) -> None:
        """Copy (host block, this cache's block) pairs from ``host_cache`` (asynchronous on CUDA)."""
        host = self._host(host_cache)
        transfer(host, self, pairs)

    def _host(self, host_cache: PagedKVCache | None) -> PagedKVCache:
        host = host_cache or self.host_cache
        if host is None:
            raise RuntimeError("the scheduler asked for a swap but the cache has no host tier (swap_space=0)")
        check_peers(self, host)
        return host

    # ----- attention -----

    def build_metadata(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> PagedAttentionMetadata:
        scheduled = out.scheduled
        return PagedAttentionMetadata.build_grouped(
            seq_ids=[s.seq_id for s in scheduled],
            query_lens=[len(s.token_ids) for s in scheduled],
            context_lens=[s.num_computed_tokens for s in scheduled],
            group_block_tables=[[s.block_tables[g] for s in scheduled] for g in range(len(scheduled[0].block_tables))],
            block_size=self.block_size,
            device=self.k.device,
            layer_to_group=self.layer_to_group,
            layer_windows=self.layer_windows,
            key_positions=[torch.tensor(s.key_positions) if s.key_positions else None for s in scheduled],
            softcap=self.softcap,
        )

    def store_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        scores: torch.Tensor | None = None,
    ) -> None:
        metadata = self._check_metadata(metadata)
        if k.dtype != torch.uint8:  # parallel prefill hands a quantized cache its rows already
            k, v = self._rows(k), self._rows(v)
        self._write(self.layer_rows[layer], metadata.slot_mappings[metadata.group_of(layer)], k, v)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values (N, Hkv, D) as the cache stores them: rounded to its dtype, or rotated and quantized."""
        if self.kv_quant is None:
            return x.to(self.k.dtype)
        return self.kv_quant.quantize(self.kv_quant.rotated(x))

    def _write(self, row: int, slots: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> None:
        """Stored rows (N, Hkv, D or row_bytes) into ``slots`` of block row ``row``."""
        self.k[row].view(-1, self.num_kv_heads, self.k.shape[-1]).index_copy_(0, slots, k_rows)
        self.v[row].view(-1, self.num_kv_heads, self.v.shape[-1]).index_copy_(0, slots, v_rows)

    def in_place_decode(self, metadata: AttentionMetadata) -> InPlaceDecode | None:
        metadata = self._check_metadata(metadata)
        plan = self._plan_of(metadata)
        plain = plan.decode_only and len(metadata.block_tables) == 1
        if not plain or self.batch_invariant or self.layer_windows or metadata.softcap or self.kv_quant is not None:
            return None
        view = self._decode_view(metadata, plan, 0, None)
        slots = metadata.slot_mappings[0]
        return InPlaceDecode(self.k, self.v, self.layer_rows, slots, view.tables, view.starts, view.ends)

    def _check_metadata(self, metadata: AttentionMetadata) -> PagedAttentionMetadata:
        if not isinstance(metadata, PagedAttentionMetadata):
            raise TypeError(f"PagedKVCache needs PagedAttentionMetadata, got {type(metadata).__name__}")
        if metadata.block_size != self.block_size:
            raise ValueError(f"metadata is for blocks of {metadata.block_size} tokens, the cache has {self.block_size}")
        return metadata

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        metadata = self._check_metadata(metadata)
        slots = metadata.slot_mappings[metadata.group_of(layer)]
        if self.kv_quant is not None:
            return self._forward_quantized(layer, q, k, v, metadata, slots)
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)  # a narrower cache rounds them once, here
        self._write(self.layer_rows[layer], slots, k, v)
        return self._attend(layer, q, k.to(q.dtype), v.to(q.dtype), metadata)  # as the cache holds them

    def _forward_quantized(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: PagedAttentionMetadata,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` over quantized rows: one rotation of the step's queries, keys and values together and one
        quantization of its keys and values (a decode step is bound by its count of small ops, not their size)."""
        quant, heads, kv_heads = self.kv_quant, q.shape[1], k.shape[1]
        rotated = quant.rotated(torch.cat((q, k, v), dim=1))  # (N, H + 2 Hkv, D) float32
        rows = quant.quantize(rotated[:, heads:])  # (N, 2 Hkv, row_bytes)
        self._write(self.layer_rows[layer], slots, rows[:, :kv_heads], rows[:, kv_heads:])
        k_read = v_read = None  # decodes read every key from the cache, their own too
        if not self._plan_of(meta).decode_only:  # prefills see the step's keys as the cache holds them
            read = quant.dequantize(rows, q.dtype)
            k_read, v_read = read[:, :kv_heads], read[:, kv_heads:]
        out = self._attend(layer, rotated[:, :heads].to(q.dtype), k_read, v_read, meta)
        return quant.rotated(out).to(q.dtype)  # H v summed: H again is the output

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        """q (N, H, D) over the step's keys k, v (N, Hkv, D; None: decodes read them cached) and the blocks before."""
        group, row = metadata.group_of(layer), self.layer_rows[layer]
        k_cache, v_cache = self.k[row], self.v[row]  # (num_blocks, block_size, Hkv, D or row_bytes)
        plan, window, softcap = self._plan_of(metadata), metadata.window_of(layer), metadata.softcap
        if self.batch_invariant:
            out = attend_row_calls(q, k_cache, v_cache, self._row_plan(metadata, plan, group, window), softcap)
            return attend_positioned(out, q, k_cache, v_cache, metadata, plan, group, window, self.kv_quant)
        view = self._decode_view(metadata, plan, group, window) if plan.decodes else None
        if plan.decode_only:
            out = self._decode(q, k_cache, v_cache, view, softcap)
            return attend_positioned(out, q, k_cache, v_cache, metadata, plan, group, window, self.kv_quant)
        out = torch.empty_like(q)  # (N, H, D)
        if view is not None:
            rows = plan.decode_rows
            out.index_copy_(0, rows, self._decode(q.index_select(0, rows), k_cache, v_cache, view, softcap))
        for p, table in zip(plan.prefills, plan.prefill_tables[group], strict=True):
            rows = slice(p.start, p.start + p.query_len)
            if p.context_len == 0:  # the whole sequence is this step's keys: no gather needed
                out[rows] = attend_prefill(q[rows], k[rows], v[rows], 0, window, softcap)
                continue
            # Blocks wholly before the first query's window are not read (a window group released them).
            first = max(0, p.context_len - window + 1) // self.block_size if window else 0
            offset = first * self.block_size
            seq_len = p.context_len + p.query_len - offset
            keys = widen(k_cache.index_select(0, table[first:]).flatten(0, 1)[:seq_len], q.dtype, self.kv_quant)
            values = widen(v_cache.index_select(0, table[first:]).flatten(0, 1)[:seq_len], q.dtype, self.kv_quant)
            out[rows] = attend_prefill(q[rows], keys, values, p.context_len - offset, window, softcap)
        return attend_positioned(out, q, k_cache, v_cache, metadata, plan, group, window, self.kv_quant)

    def _plan_of(self, metadata: PagedAttentionMetadata) -> StepPlan:
        """The step's plan, made once for ``metadata`` (the step's, immutable) and kept until the next step's."""
        if metadata is not self._plan_metadata:
            self._plan, self._plan_metadata = make_plan(metadata), metadata
        return self._plan

    @staticmethod
    def _decode_view(metadata: PagedAttentionMetadata, plan: StepPlan, group: int, window: int | None) -> DecodeView:
        views, key = plan.decode_views, (group, window)
        if key not in views:
            views[key] = decode_view(metadata, plan.decodes, group, window)
        return views[key]

    @staticmethod
    def _row_plan(metadata: PagedAttentionMetadata, plan: StepPlan, group: int, window: int | None) -> RowPlan:
        plans, key = plan.row_plans, (group, window)
        if key not in plans:
            table = metadata.block_tables[group]
            plans[key] = plan_row_calls(metadata.query_lens, metadata.context_lens, table, metadata.block_size, window)
        return plans[key]

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, view: DecodeView, softcap: float = 0.0
    ) -> torch.Tensor:
        """q (B, H, D), one query per decode sequence, over its blocks read in place -> (B, H, D)."""
        return paged_decode(
            q, k_cache, v_cache, view.tables, view.starts, view.ends, softcap=softcap, quant=self.kv_quant
        )[0]


def attend_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, window: int | None = None, softcap: float = 0.0
) -> torch.Tensor:
    """q (T, H, D) at cache positions ctx_len.. over k, v (ctx_len + T, Hkv, D) -> (T, H, D); with a
    ``window``, each query sees only the last ``window`` positions (its own included); scaled logits soft-capped
    by ``softcap`` (0: none)."""
    q_len = q.shape[0]
    if q_len > 1 and use_flash_prefill(q, k):
        return flash_prefill(q, k, v, ctx_len, window, softcap=softcap)
    if window_binds(window, ctx_len + q_len):
        return _attend_windowed(q, k, v, ctx_len, window, softcap)
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, T, D)
    kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx + T, D)
    if ctx_len == 0:
        out = sdpa(qh, kh, vh, is_causal=q_len > 1, softcap=softcap, enable_gqa=True)
    elif q.device.type == "cpu" and q_len > 1 and not softcap:
        out = _attend_context_then_chunk(qh, kh, vh, ctx_len)
    else:
        mask = causal_mask(q_len, ctx_len, device=q.device)  # (T, ctx + T)
        out = sdpa(qh, kh, vh, attn_mask=mask, softcap=softcap, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # (T, H, D)


def _attend_windowed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, window: int, softcap: float = 0.0
) -> torch.Tensor:
    """Sliding-window attention in chunks of ``window`` queries, each over the keys its window reaches:
    O(T * window) work instead of the O(T * (ctx + T)) of one masked call."""
    out = torch.empty_like(q)  # (T, H, D)
    for start in range(0, q.shape[0], window):
        end = min(start + window, q.shape[0])
        first = max(0, ctx_len + start - window + 1)  # the chunk's first query sees no key before this
        rows = slice(first, ctx_len + end)
        mask = causal_mask(end - start, ctx_len + start - first, window, q.device)  # (chunk, keys)
        qh = q[start:end].transpose(0, 1).unsqueeze(0)  # (1, H, chunk, D)
        kh, vh = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
        chunk = sdpa(qh, kh, vh, attn_mask=mask, softcap=softcap, enable_gqa=True)
        out[start:end] = chunk.squeeze(0).transpose(0, 1)
    return out


def _attend_context_then_chunk(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """Causal attention of a chunk after ``ctx_len`` cached tokens as two flash-attention calls: every query
    over the whole context (no mask), and causally over the chunk itself; merged by their log-sum-exps.

    With a boolean (T, ctx + T) mask torch's CPU flash kernel computes and masks the whole rectangle:
    measured 2x slower for 4,000 queries after 4,000 cached tokens (bfloat16, SmolLM2's heads). The CPU
    kernel returns the log-sum-exp SDPA does not, and takes grouped KV heads as they are.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    past, past_lse = flash(qh, kh[:, :, :ctx_len], vh[:, :, :ctx_len])[:2]  # (1, H, T, D), (1, H, T) float32
    own, own_lse = flash(qh, kh[:, :, ctx_len:], vh[:, :, ctx_len:], is_causal=True)[:2]
    lse = torch.logaddexp(past_lse, own_lse)
    past_weight, own_weight = torch.exp(past_lse - lse).unsqueeze(-1), torch.exp(own_lse - lse).unsqueeze(-1)
    return (past.float() * past_weight + own.float() * own_weight).to(qh.dtype)
