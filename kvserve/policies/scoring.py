"""Attention weights as slot scores: what the write-time policies (PyramidInfer, H2O, SnapKV) rank slots by.

These functions take plain tensors (queries, candidate keys, running scores) and know nothing of blocks,
so each is tested alone on hand-made tensors; the compressed cache calls them with what it gathered.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kvserve.attention.softcap import cap_logits

SCORE_CHUNK = 256  # query rows per chunk when scoring a prefill (bounds the (H, rows, keys) weights)


def column_sums(
    q: torch.Tensor, keys: torch.Tensor, held: int, first: int, row_weights: torch.Tensor, softcap: float = 0.0
) -> torch.Tensor:
    """Weighted attention each candidate receives from queries first.. of a chunk, mean over heads: (n,) float32.

    q (m, H, D) are the chunk's queries, the j-th at candidate index held + j, seeing candidates up to its
    own; keys (n, Hkv, D) with n = held + m; ``row_weights`` (m - first,) weigh queries first..m-1.
    """
    return head_column_sums(q, keys, held, first, row_weights, softcap).mean(dim=1)


def head_column_sums(
    q: torch.Tensor, keys: torch.Tensor, held: int, first: int, row_weights: torch.Tensor, softcap: float = 0.0
) -> torch.Tensor:
    """``column_sums`` per KV head: (n, Hkv) float32, each the mean over the query heads that read it (GQA)."""
    total = keys.new_zeros(keys.shape[1], keys.shape[0], dtype=torch.float32)
    for begin, end, weights in _voting_chunks(q, keys, held, first, softcap):
        _add_column_sums(total, weights, row_weights[begin - first : end - first])
    return total.T


def attend_voting_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: int,
    first: int,
    row_weights: torch.Tensor,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a chunk's voting queries first.. and ``head_column_sums`` from the same softmax (its
    logits soft-capped by ``softcap``, 0: none).

    q (m, H, D) at candidate indices held..; keys/values (held + m, Hkv, D). Returns the rows' output
    (m - first, H, D) in q's dtype and the sums (n, Hkv) float32. The weights are formed once and serve both,
    so a scoring prefill multiplies q by k once for these rows instead of in SDPA and again to score.
    """
    m, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    vh = values.transpose(0, 1)[:, None].float()  # (Hkv, 1, n, D): the weights stay float32
    total = keys.new_zeros(num_kv_heads, keys.shape[0], dtype=torch.float32)
    out = q.new_empty(m - first, num_heads, head_dim)
    for begin, end, weights in _voting_chunks(q, keys, held, first, softcap):
        rows = torch.matmul(weights, vh[:, :, : weights.shape[-1]])  # (Hkv, G, c, D)
        out[begin - first : end - first] = rows.reshape(num_heads, end - begin, head_dim).transpose(0, 1)
        _add_column_sums(total, weights, row_weights[begin - first : end - first])
    return out, total.T


def _voting_chunks(
    q: torch.Tensor, keys: torch.Tensor, held: int, first: int, softcap: float = 0.0
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Queries first.. of a chunk in pieces of SCORE_CHUNK rows: (begin, end, attention weights (Hkv, G, c,
    held + end) float32), query head h = kv * G + g reading KV head kv."""
    m, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    # float32 throughout: the weights are also the voting rows' attention (a bfloat16 product would round the logits).
    kh = keys.transpose(0, 1)[:, None].float()  # (Hkv, 1, n, D): query head h reads KV head h // group
    scale = 1 / math.sqrt(head_dim)  # on the (c, D) queries, not the (c, width) logits
    for begin in range(first, m, SCORE_CHUNK):
        end = min(begin + SCORE_CHUNK, m)
        qh = q[begin:end].transpose(0, 1).reshape(num_kv_heads, group, end - begin, head_dim).float() * scale
        # Query j of the chunk sits at candidate index held + j and sees keys up to there: the chunk reads the
        # first held + end keys, and only among its own (the last end - begin) does it need a causal mask.
        logits = cap_logits(torch.matmul(qh, kh[:, :, : held + end].transpose(-1, -2)), softcap)  # (Hkv, G, c, width)
        future = torch.ones(end - begin, end - begin, dtype=torch.bool, device=q.device).triu(1)
        logits[..., held + begin :].masked_fill_(future, float("-inf"))
        yield begin, end, torch.softmax(logits, dim=-1)


def _add_column_sums(total: torch.Tensor, weights: torch.Tensor, row_weights: torch.Tensor) -> None:
    """total (Hkv, n) += the chunk's ``weights`` (Hkv, G, c, width) summed over its rows by ``row_weights`` (c,),
    averaged over each KV head's G query heads: one batched product, no (Hkv, c, width) mean."""
    num_kv_heads, group, rows, width = weights.shape
    per_row = row_weights.to(weights.device).repeat(group) / group  # (G * c,), g-major like the weights
    total[:, :width] += torch.matmul(per_row, weights.view(num_kv_heads, group * rows, width))
