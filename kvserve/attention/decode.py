"""Decode attention over paged KV: one query row per sequence, its keys read in place through its block table.

``paged_decode`` runs the compiled CPU kernel (``csrc/paged_decode.cpp``) when it is available and the
tensors are on the CPU, else ``paged_decode_reference``: the same result from torch ops (a gather of each
row's blocks and one masked SDPA call), which is also the kernel's exactness oracle in the tests.

A quantized cache (``quant``, ``attention/kv_quant.py``) holds uint8 rows of int8 or int4 codes with their scales:
the kernel ``csrc/paged_decode_quant.cpp`` reads them in place (float32 queries, the output cast back to q's
dtype); the torch path dequantises the gathered blocks to q's dtype before the same SDPA. Rotation is the
caller's: q rotated as the cache's rows were (``KVQuant.rotated``), the output rotated back.

Every cache's decode goes through here: the paged cache with its block tables, the compressed cache with a
table per layer, and the offloading cache with the rows it fetched (a dense (B, T, Hkv, D) buffer is B
blocks of T slots with the table ``[[0], [1], ...]``).
"""

from __future__ import annotations

import math

import torch

from kvserve.attention.kv_quant import KVQuant, widen
from kvserve.attention.softcap import cap_logits, sdpa
from kvserve.platform.cpu_kernels import use_cpu_kernel


def _use_kernel(q: torch.Tensor, k_cache: torch.Tensor, quant: KVQuant | None) -> bool:
    """Whether the compiled kernel takes this call: ``paged_decode`` for a float cache, ``paged_decode_quant`` for a
    quantized one's uint8 rows (its queries go in as float32, whatever q's dtype)."""
    if quant is None:
        return use_cpu_kernel(q, k_cache)
    return k_cache.device.type == "cpu" and k_cache.dtype == torch.uint8 and use_cpu_kernel(q)


def _kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    want_weights: bool,
    softcap: float,
    quant: KVQuant | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compiled kernel's (output in q's dtype, log-sum-exp, weights or an empty tensor); q contiguous."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if quant is None:
        return torch.ops.kvserve.paged_decode(
            q, k_cache, v_cache, block_tables, starts, ends, scale, want_weights, softcap
        )
    out, lse, weights = torch.ops.kvserve.paged_decode_quant(
        q.float(), k_cache, v_cache, block_tables, starts, ends, scale, quant.bits, want_weights, softcap
    )
    return out.to(q.dtype), lse, weights


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    want_weights: bool = False,
    softcap: float = 0.0,
    quant: KVQuant | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of q (B, H, D) over k_cache/v_cache (num_blocks, block_size, Hkv, D), of q's dtype or narrower
    under float32 q (bfloat16, float16), or with ``quant`` that format's uint8 rows (num_blocks, block_size, Hkv,
    quant.row_bytes): row b reads key positions
    ``starts[b] .. ends[b] - 1`` of its table ``block_tables[b]`` ((B, W) int32; starts, ends (B,) int32), its
    scaled logits soft-capped by ``softcap`` (0: none; ``attention/softcap.py``).

    Returns the output (B, H, D) and, with ``want_weights``, each key's softmax probability averaged over the
    query heads, (B, W * block_size) float32 by position, zero outside a row's range; else None."""
    q = q.contiguous()
    if _use_kernel(q, k_cache, quant):
        out, _, weights = _kernel(q, k_cache, v_cache, block_tables, starts, ends, want_weights, softcap, quant)
        return out, (weights if want_weights else None)
    return paged_decode_reference(q, k_cache, v_cache, block_tables, starts, ends, want_weights, softcap, quant)


def paged_decode_lse(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    softcap: float = 0.0,
    quant: KVQuant | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_decode`` (same arguments) returning the output (B, H, D) and each query head's log-sum-exp of its
    scaled logits (B, H) float32: -inf, with a zero output, for an empty range. Two ranges attended apart merge
    by it (``merge_attention``)."""
    q = q.contiguous()
    if _use_kernel(q, k_cache, quant):
        out, lse, _ = _kernel(q, k_cache, v_cache, block_tables, starts, ends, False, softcap, quant)
        return out, lse
    qg, keys, values, mask = _gather(q, k_cache, v_cache, block_tables, starts, ends, quant)
    logits = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, Hkv, G, T)
    logits = cap_logits(logits, softcap)
    lse = torch.logsumexp(logits.masked_fill(~mask, float("-inf")), dim=-1)  # (B, Hkv, G)
    weights = torch.exp(logits - lse[..., None]).masked_fill(~mask, 0.0)  # an empty range: no weight anywhere
    out = torch.matmul(weights, values.float()).to(q.dtype)  # (B, Hkv, G, D)
    return out.reshape(q.shape), lse.reshape(q.shape[:2])


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """The attention over two disjoint key ranges from each one's output (B, H, D) and log-sum-exp (B, H)."""
    lse = torch.logaddexp(lse_a, lse_b)
    a, b = torch.exp(lse_a - lse)[..., None], torch.exp(lse_b - lse)[..., None]
    return (out_a.float() * a + out_b.float() * b).to(out_a.dtype)


def _gather(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    quant: KVQuant | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's blocks gathered for the torch paths: queries (B, Hkv, G, D) (query head h reads KV head h // G),
    keys and values (B, Hkv, T, D) widened to q's dtype when the cache is narrower (dequantised when it is
    quantized), visible (B, 1, 1, T)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    length = block_tables.shape[1] * block_size
    index = block_tables.long().view(-1)
    keys = widen(k_cache.index_select(0, index), q.dtype, quant).view(batch, length, hkv, head_dim).transpose(1, 2)
    values = widen(v_cache.index_select(0, index), q.dtype, quant).view(batch, length, hkv, head_dim).transpose(1, 2)
    position = torch.arange(length, device=q.device)
    visible = (position >= starts.to(q.device).long()[:, None]) & (position < ends.to(q.device).long()[:, None])
    return q.reshape(batch, hkv, num_heads // hkv, head_dim), keys, values, visible[:, None, None, :]


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    want_weights: bool = False,
    softcap: float = 0.0,
    quant: KVQuant | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``paged_decode`` from torch ops: gather each row's blocks, mask its range, attend (same arguments)."""
    batch, num_heads, head_dim = q.shape
    qg, keys, values, mask = _gather(q, k_cache, v_cache, block_tables, starts, ends, quant)
    if not want_weights:
        out = sdpa(qg, keys, values, attn_mask=mask, softcap=softcap)
        return out.reshape(batch, num_heads, head_dim), None
    logits = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) / math.sqrt(head_dim)  # (B, Hkv, G, T)
    logits = cap_logits(logits, softcap)
    weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.matmul(weights, values.float()).to(q.dtype)  # (B, Hkv, G, D)
    return out.reshape(batch, num_heads, head_dim), weights.mean(dim=(1, 2))
