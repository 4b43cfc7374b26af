"""Decode attention over paged KV: one query row per sequence, its keys read in place through its block table.

``paged_decode`` runs the compiled CPU kernel (``csrc/paged_decode.cpp``) when it is available and the
tensors are on the CPU, else ``paged_decode_reference``: the same result from torch ops (a gather of each
row's blocks and one masked SDPA call), which is also the kernel's exactness oracle in the tests.

Every cache's decode goes through here: the paged cache with its block tables, the compressed cache with a
table per layer, and the offloading cache with the rows it fetched (a dense (B, T, Hkv, D) buffer is B
blocks of T slots with the table ``[[0], [1], ...]``).
"""

from __future__ import annotations

import math

import torch

from kvserve.attention.softcap import cap_logits, sdpa
from kvserve.platform.cpu_kernels import use_cpu_kernel


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    want_weights: bool = False,
    softcap: float = 0.0,
    quant=None,  # noqa: ANN001
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of q (B, H, D) over k_cache/v_cache (num_blocks, block_size, Hkv, D), of q's dtype or narrower
    under float32 q (bfloat16, float16): row b reads key positions
    ``starts[b] .. ends[b] - 1`` of its table ``block_tables[b]`` ((B, W) int32; starts, ends (B,) int32), its
    scaled logits soft-capped by ``softcap`` (0: none; ``attention/softcap.py``).

    Returns the output (B, H, D) and, with ``want_weights``, each key's softmax probability averaged over the
    query heads, (B, W * block_size) float32 by position, zero outside a row's range; else None."""
    q = q.contiguous()
    if quant is not None:
        k_cache, v_cache = quant.dequantize(k_cache, q.dtype), quant.dequantize(v_cache, q.dtype)
    if use_cpu_kernel(q, k_cache):
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, _, weights = torch.ops.kvserve.paged_decode(
            q, k_cache, v_cache, block_tables, starts, ends, scale, want_weights, softcap
        )
        return out, (weights if want_weights else None)
    return paged_decode_reference(q, k_cache, v_cache, block_tables, starts, ends, want_weights, softcap)


def paged_decode_lse(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_decode`` (same arguments) returning the output (B, H, D) and each query head's log-sum-exp of its
    scaled logits (B, H) float32: -inf, with a zero output, for an empty range. Two ranges attended apart merge
    by it (``merge_attention``)."""
    q = q.contiguous()
    if use_cpu_kernel(q, k_cache):
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse, _ = torch.ops.kvserve.paged_decode(
            q, k_cache, v_cache, block_tables, starts, ends, scale, False, softcap
        )
        return out, lse
    qg, keys, values, mask = _gather(q, k_cache, v_cache, block_tables, starts, ends)
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's blocks gathered for the torch paths: queries (B, Hkv, G, D) (query head h reads KV head h // G),
    keys and values (B, Hkv, T, D) widened to q's dtype when the cache is narrower, visible (B, 1, 1, T)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    length = block_tables.shape[1] * block_size
    index = block_tables.long().view(-1)
    keys = k_cache.index_select(0, index).view(batch, length, hkv, head_dim).transpose(1, 2).to(q.dtype)
    values = v_cache.index_select(0, index).view(batch, length, hkv, head_dim).transpose(1, 2).to(q.dtype)
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``paged_decode`` from torch ops: gather each row's blocks, mask its range, attend (same arguments)."""
    batch, num_heads, head_dim = q.shape
    qg, keys, values, mask = _gather(q, k_cache, v_cache, block_tables, starts, ends)
    if not want_weights:
        out = sdpa(qg, keys, values, attn_mask=mask, softcap=softcap)
        return out.reshape(batch, num_heads, head_dim), None
    logits = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) / math.sqrt(head_dim)  # (B, Hkv, G, T)
    logits = cap_logits(logits, softcap)
    weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.matmul(weights, values.float()).to(q.dtype)  # (B, Hkv, G, D)
    return out.reshape(batch, num_heads, head_dim), weights.mean(dim=(1, 2))
