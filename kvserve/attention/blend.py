"""Selective recompute of imported Prompt Cache tokens over the paged cache (CacheBlend, Yao et al., EuroSys'25,
https://arxiv.org/abs/2405.16444).

A ``ModuleRecompute`` (scheduler.py) names a sequence's imported module tokens, their positions and slots, the
candidates that may be rewritten and how many. Two passes over the model, both through ``BlendAttention``,
whose queries attend to the imported tokens' cached keys causally by *position* (schema positions, gaps
allowed), not by slot order, and in a sliding-window layer only to those within its window by position:

1. Selection (skipped when every candidate is recomputed): every candidate through layer 0, its queries over
   the whole assembled prompt; layer 1's fresh keys and values of them are compared with the cached ones, and
   the ``count`` with the largest deviation (squared L2 of K and V together) are chosen. Layer 0's own KV
   depends on the token and its position only, so layer 1 is the first where the modules' isolation shows.
   The choice is made once and kept for every layer (the paper narrows it layer by layer).
2. Recompute: the chosen tokens through every layer; each layer writes their fresh keys and values into their
   slots (the sequence's own copies) before they attend, so unchosen tokens contribute their cached KV and
   chosen ones their fresh KV. With every candidate chosen the result is a plain prefill at those positions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, UnsupportedKVOperation
from kvserve.attention.flash_prefill import flash_prefill, use_flash_prefill
from kvserve.attention.paged import PagedKVCache
from kvserve.attention.paged_plan import slot_rows
from kvserve.attention.softcap import sdpa
from kvserve.core.step import ModuleRecompute


@dataclass(frozen=True)
class BlendMetadata(AttentionMetadata):
    """The step's queries (some imported tokens) over every imported token of one sequence."""

    context_slots: torch.Tensor  # (C,) long: the imported tokens' cache slots
    context_positions: torch.Tensor  # (C,) long: their positions
    query_slots: torch.Tensor  # (N,) long: the queries' own slots (written to when ``write``)
    query_positions: torch.Tensor  # (N,) long
    write: bool  # store the queries' fresh keys/values before attending (the recompute pass)
    stop_at: int | None = None  # the selection pass: layer whose fresh keys/values end the forward
    # (first query, end query, keys it may see): queries in chunks over the key prefix they reach (keys in
    # position order), so the step does about half of the (N, C) rectangle; one chunk over every key otherwise.
    chunks: tuple[tuple[int, int, int], ...] = ()
    # The same keys in position order, and how many of them each query sees: for the prefill kernel.
    sorted_slots: torch.Tensor | None = None  # (C,) long
    key_order: torch.Tensor | None = None  # (C,) long: sorted_slots = context_slots[key_order]
    key_ends: torch.Tensor | None = None  # (N,) long

    @functools.cached_property
    def bias(self) -> torch.Tensor:
        """(N, C) float: 0 where a query sees a key (by position), -inf elsewhere; built on first use (only torch's
        attention takes it: at 4k tokens it is as large as the selection pass's projections)."""
        visible = self.context_positions.unsqueeze(0) <= self.query_positions.unsqueeze(1)  # causal by position
        return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, -math.inf)


QUERY_CHUNK = 128  # queries per attention call: each call reads only the keys its last query may see


class _LayerKV(Exception):  # noqa: N818 - not an error: the selection pass ends here with what it came for
    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__()
        self.k, self.v = k, v


class BlendAttention(AttentionBackend):
    """Attention by position over one sequence's imported tokens in a paged cache."""

    def __init__(self, cache: AttentionBackend) -> None:
        if not isinstance(cache, PagedKVCache):
            kind = type(cache).__name__
            raise UnsupportedKVOperation(f"selective recompute reads a paged cache in place, not a {kind}")
        self.cache = cache

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s keys and values as (slots, Hkv, D) views of the cache."""
        cache, row = self.cache, self.cache.layer_rows[layer]
        shape = (-1, cache.num_kv_heads, cache.head_dim)
        return cache.k[row].view(shape), cache.v[row].view(shape)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q (N, H, D), k and v (N, Hkv, D) -> (N, H, D)."""
        md = metadata
        if md.stop_at == layer:
            raise _LayerKV(k, v)
        k_cache, v_cache = self.layer_kv(layer)
        if md.write:
            k_cache.flatten(1).index_copy_(0, md.query_slots, k.flatten(1))
            v_cache.flatten(1).index_copy_(0, md.query_slots, v.flatten(1))
        window = md.window_of(layer)
        if window is not None:
            return _attend_window(q, k_cache, v_cache, md, window)
        if use_flash_prefill(q, k_cache):  # bfloat16 on AVX512-BF16: visible keys are a prefix in position order
            keys, values = slot_rows(k_cache, md.sorted_slots), slot_rows(v_cache, md.sorted_slots)
            return flash_prefill(q, keys, values, 0, key_ends=md.key_ends, softcap=md.softcap)
        keys = slot_rows(k_cache, md.context_slots).transpose(0, 1).unsqueeze(0)  # (1, Hkv, C, D)
        values = slot_rows(v_cache, md.context_slots).transpose(0, 1).unsqueeze(0)
        qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, N, D)
        bias = md.bias.to(q.dtype)
        out = torch.empty_like(qh)
        for begin, end, seen in md.chunks:
            out[:, :, begin:end] = sdpa(
                qh[:, :, begin:end], keys[:, :, :seen], values[:, :, :seen], attn_mask=bias[begin:end, :seen],
                softcap=md.softcap, enable_gqa=True,
            )  # fmt: skip
        return out.squeeze(0).transpose(0, 1)  # (N, H, D)


def _attend_window(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: BlendMetadata, window: int
) -> torch.Tensor:
    """A sliding-window layer: each query over the keys at most ``window - 1`` positions before it (its own
    included): in position order they are a run of keys, which the bfloat16 prefill kernel takes as is. Otherwise
    queries go in position order, ``QUERY_CHUNK`` at a time, each chunk over the keys (in position order) its
    window reaches: about a window's worth per chunk, not the whole prompt."""
    key_positions = md.context_positions[md.key_order]  # ascending, as md.sorted_slots
    if use_flash_prefill(q, k_cache):  # each query over a run of the sorted keys: [its window's first, itself]
        starts = torch.searchsorted(key_positions, md.query_positions - window + 1)
        keys, values = slot_rows(k_cache, md.sorted_slots), slot_rows(v_cache, md.sorted_slots)
        return flash_prefill(q, keys, values, 0, key_ends=md.key_ends, key_starts=starts, softcap=md.softcap)
    query_order = md.query_positions.argsort()
    out = torch.empty_like(q)  # (N, H, D)
    for begin in range(0, len(query_order), QUERY_CHUNK):
        rows = query_order[begin : begin + QUERY_CHUNK]
        positions = md.query_positions[rows]
        first = int(torch.searchsorted(key_positions, positions.min() - window + 1))
        end = int(torch.searchsorted(key_positions, positions.max(), right=True))
        slots = md.sorted_slots[first:end]
        distance = positions[:, None] - key_positions[None, first:end]  # (chunk, keys)
        mask = (distance >= 0) & (distance < window)
        qh = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, chunk, D)
        kh = slot_rows(k_cache, slots).transpose(0, 1).unsqueeze(0)  # (1, Hkv, keys, D)
        vh = slot_rows(v_cache, slots).transpose(0, 1).unsqueeze(0)
        attended = sdpa(qh, kh, vh, attn_mask=mask, softcap=md.softcap, enable_gqa=True)
        out[rows] = attended.squeeze(0).transpose(0, 1)
    return out


def kv_deviation(k: torch.Tensor, v: torch.Tensor, k_cached: torch.Tensor, v_cached: torch.Tensor) -> torch.Tensor:
    """Per token, the squared L2 distance of fresh from cached keys and values: (N, Hkv, D) each -> (N,) float32."""
    dk = (k.float() - k_cached.float()).square().sum((1, 2))
    dv = (v.float() - v_cached.float()).square().sum((1, 2))
    return dk + dv


def select_deviating(deviation: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` largest deviations (N,), ascending: (count,) long."""
    return torch.topk(deviation, count).indices.sort().values


def recompute_modules(model: torch.nn.Module, cache: AttentionBackend, job: ModuleRecompute) -> None:
    """Run ``job``: choose its tokens (unless all are recomputed) and rewrite their keys and values in ``cache``."""
    blend = BlendAttention(cache)
    device = blend.cache.k.device
    ids = torch.tensor(job.token_ids, dtype=torch.long, device=device)  # (C,)
    positions = torch.tensor(job.positions, dtype=torch.long, device=device)
    slots = torch.tensor(job.slots, dtype=torch.long, device=device)
    chosen = torch.tensor(job.candidates, dtype=torch.long, device=device)  # (M,) indices into the C tokens
    if job.count < len(job.candidates):
        if job.count <= len(job.probe) < len(job.candidates):  # the others deviate by zero: ranked after these
            chosen = torch.tensor(job.probe, dtype=torch.long, device=device)
        deviation = _deviation(model, blend, job.seq_id, ids, positions, slots, chosen)  # (M,)
        chosen = chosen[select_deviating(deviation, job.count)]
    metadata = _metadata(
        job.seq_id, positions, slots, chosen, write=True, windows=blend.cache.layer_windows, softcap=blend.cache.softcap
    )
    model(ids[chosen], positions[chosen], blend, metadata)


def _deviation(
    model: torch.nn.Module, blend: BlendAttention, seq_id: int, ids: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, candidates: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The candidates' layer-1 KV deviation (M,) after layer 0 attends over the whole assembled prompt."""
    layer = min(1, len(model.layers) - 1)
    metadata = _metadata(
        seq_id, positions, slots, candidates, write=False, stop_at=layer, windows=blend.cache.layer_windows,
        softcap=blend.cache.softcap,
    )  # fmt: skip
    try:
        model(ids[candidates], positions[candidates], blend, metadata)
    except _LayerKV as fresh:
        k_cache, v_cache = blend.layer_kv(layer)
        cand_slots = slots[candidates]
        return kv_deviation(fresh.k, fresh.v, slot_rows(k_cache, cand_slots), slot_rows(v_cache, cand_slots))
    raise RuntimeError(f"the model never reached layer {layer}'s attention")


def _metadata(
    seq_id: int, positions: torch.Tensor, slots: torch.Tensor, chosen: torch.Tensor, write: bool,
    stop_at: int | None = None, windows: tuple[int | None, ...] = (), softcap: float = 0.0,
) -> BlendMetadata:  # fmt: skip
    query_positions = positions[chosen]
    order = positions.argsort(stable=True)
    return BlendMetadata(
        (seq_id,), (len(chosen),), (len(slots),), context_slots=slots, context_positions=positions,
        query_slots=slots[chosen], query_positions=query_positions, write=write, stop_at=stop_at,
        chunks=_query_chunks(positions, query_positions), sorted_slots=slots[order], key_order=order,
        key_ends=torch.searchsorted(positions[order], query_positions, right=True), layer_windows=windows,
        softcap=softcap,
    )  # fmt: skip


def _query_chunks(positions: torch.Tensor, query_positions: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """Chunks of ``QUERY_CHUNK`` queries with how many keys each reaches, when keys and queries are in position
    order (a prompt's modules in schema order); else one chunk over every key."""
    n, c = len(query_positions), len(positions)
    if not (
        bool((positions[1:] >= positions[:-1]).all()) and bool((query_positions[1:] >= query_positions[:-1]).all())
    ):
        return ((0, n, c),)
    ends = range(QUERY_CHUNK, n + QUERY_CHUNK, QUERY_CHUNK)
    reach = torch.searchsorted(positions, query_positions[[min(e, n) - 1 for e in ends]], right=True).tolist()
    return tuple((e - QUERY_CHUNK, min(e, n), seen) for e, seen in zip(ends, reach, strict=True))
