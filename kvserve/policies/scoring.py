"""Attention weights as slot scores: what the write-time policies (PyramidInfer, H2O, SnapKV) rank slots by.

These functions take plain tensors (queries, candidate keys, running scores) and know nothing of blocks,
so each is tested alone on hand-made tensors; the compressed cache calls them with what it gathered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.policies.base import KVPolicy

SCORE_CHUNK = 256  # query rows per chunk when scoring a prefill (bounds the (H, rows, keys) weights)


def scaled_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q k^T / sqrt(D) as float32, multiplied in the cache dtype (bfloat16 runs on AMX; the scores that
    rank tokens need no more precision). q (..., r, D), k (..., n, D) -> (..., r, n)."""
    return torch.matmul(q, k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])


def column_sums(q: torch.Tensor, keys: torch.Tensor, held: int, first: int, row_weights: torch.Tensor) -> torch.Tensor:
    """Weighted attention each candidate receives from queries first.. of a chunk, mean over heads: (n,) float32.

    q (m, H, D) are the chunk's queries, the j-th at candidate index held + j, seeing candidates up to its
    own; keys (n, Hkv, D) with n = held + m; ``row_weights`` (m - first,) weigh queries first..m-1.
    """
    return head_column_sums(q, keys, held, first, row_weights).mean(dim=1)


def head_column_sums(
    q: torch.Tensor, keys: torch.Tensor, held: int, first: int, row_weights: torch.Tensor
) -> torch.Tensor:
    """``column_sums`` per KV head: (n, Hkv) float32, each the mean over the query heads that read it (GQA)."""
    m, num_heads, head_dim = q.shape
    n, num_kv_heads = keys.shape[:2]
    group = num_heads // num_kv_heads
    kh = keys.transpose(0, 1)[:, None]  # (Hkv, 1, n, D): query head h reads KV head h // group
    total = torch.zeros(num_kv_heads, n, dtype=torch.float32, device=q.device)
    for begin in range(first, m, SCORE_CHUNK):
        end = min(begin + SCORE_CHUNK, m)
        qh = q[begin:end].transpose(0, 1).reshape(num_kv_heads, group, end - begin, head_dim)  # (Hkv, G, c, D)
        # Query j of the chunk sits at candidate index held + j and sees keys up to there: the chunk reads the
        # first held + end keys, and only among its own (the last end - begin) does it need a causal mask.
        width = held + end
        logits = scaled_logits(qh, kh[:, :, :width])  # (Hkv, G, c, width) float32
        future = torch.ones(end - begin, end - begin, dtype=torch.bool, device=q.device).triu(1)
        logits[..., held + begin :].masked_fill_(future, float("-inf"))
        weights = torch.softmax(logits, dim=-1).mean(dim=1)  # (Hkv, c, width)
        total[:, :width] += row_weights[begin - first : end - first].to(weights.device) @ weights
    return total.T


def update_scores(policies: Sequence[KVPolicy], scores: torch.Tensor, step_weights: torch.Tensor) -> torch.Tensor:
    """Each sequence's running scores (B, T) folded with its step's weights (B, T), batched per policy."""
    if all(p == policies[0] for p in policies):
        return policies[0].update(scores, step_weights)
    out = scores.clone()
    for policy in set(policies):
        rows = torch.tensor([b for b, p in enumerate(policies) if p == policy], device=scores.device)
        out[rows] = policy.update(scores[rows], step_weights[rows])
    return out
