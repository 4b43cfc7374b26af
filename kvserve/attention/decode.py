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
import torch.nn.functional as F

from kvserve.cpu_kernels import use_cpu_kernel


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    want_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of q (B, H, D) over k_cache/v_cache (num_blocks, block_size, Hkv, D), of q's dtype or narrower
    under float32 q (bfloat16, float16): row b reads key positions
    ``starts[b] .. ends[b] - 1`` of its table ``block_tables[b]`` ((B, W) int32; starts, ends (B,) int32).

    Returns the output (B, H, D) and, with ``want_weights``, each key's softmax probability averaged over the
    query heads, (B, W * block_size) float32 by position, zero outside a row's range; else None."""
    q = q.contiguous()
    if use_cpu_kernel(q, k_cache):
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, _, weights = torch.ops.kvserve.paged_decode(
            q, k_cache, v_cache, block_tables, starts, ends, scale, want_weights
        )
        return out, (weights if want_weights else None)
    return paged_decode_reference(q, k_cache, v_cache, block_tables, starts, ends, want_weights)


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    want_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``paged_decode`` from torch ops: gather each row's blocks, mask its range, attend (same arguments)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    length = block_tables.shape[1] * block_size
    index = block_tables.long().view(-1)
    # (B, Hkv, T, D), widened to q's dtype when the cache is narrower
    keys = k_cache.index_select(0, index).view(batch, length, hkv, head_dim).transpose(1, 2).to(q.dtype)
    values = v_cache.index_select(0, index).view(batch, length, hkv, head_dim).transpose(1, 2).to(q.dtype)
    position = torch.arange(length, device=q.device)
    visible = (position >= starts.to(q.device).long()[:, None]) & (position < ends.to(q.device).long()[:, None])
    mask = visible[:, None, None, :]  # (B, 1, 1, T)
    qg = q.reshape(batch, hkv, num_heads // hkv, head_dim)  # (B, Hkv, G, D): query head h reads KV head h // G
    if not want_weights:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
        return out.reshape(batch, num_heads, head_dim), None
    logits = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) / math.sqrt(head_dim)  # (B, Hkv, G, T)
    weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.matmul(weights, values.float()).to(q.dtype)  # (B, Hkv, G, D)
    return out.reshape(batch, num_heads, head_dim), weights.mean(dim=(1, 2))
