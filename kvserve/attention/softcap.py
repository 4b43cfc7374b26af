"""Attention-logit soft-capping (Gemma 2): each scaled logit x becomes ``cap * tanh(x / cap)`` before the mask and
the softmax. SDPA cannot apply it, so the torch paths take ``sdpa`` here: SDPA itself without a cap (the same call,
the same bits as before), explicit float32 logits with one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Logits per chunk of query rows in ``capped_attention`` (float32, 64 MiB): its peak is about twice that (logits and
# weights) beside float32 copies of K and V.
CHUNK_LOGITS = 1 << 24


def cap_logits(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)``; the logits themselves for a cap of 0 (none)."""
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (default scale) with logits soft-capped by ``softcap`` (0: none)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
    return capped_attention(q, k, v, softcap, attn_mask, is_causal)


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softcap: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA's contract (q (..., H, T, D), k and v (..., Hkv, S, D) with H a multiple of Hkv, a boolean mask (True =
    attend) or an additive one broadcasting to (..., H, T, S), ``is_causal`` aligned top-left) over soft-capped
    logits, computed in float32 and returned in q's dtype. Query rows go in chunks of about ``CHUNK_LOGITS``
    logits (with causal masking, a chunk multiplies only the keys its rows can see). A row that sees no key gets
    zeros; a NaN stays NaN, as in SDPA."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    group = heads // kv_heads
    # Query head h reads KV head h // G: q as (..., Hkv, G, T, D) against k (..., Hkv, 1, S, D), no copies of K/V.
    qg = q.unflatten(-3, (kv_heads, group))
    kt, vf = k.float().transpose(-1, -2).unsqueeze(-3), v.float().unsqueeze(-3)
    if attn_mask is not None and attn_mask.dim() >= 3:
        per_head = attn_mask.shape[-3] == heads and group > 1
        attn_mask = attn_mask.unflatten(-3, (kv_heads, group)) if per_head else attn_mask.unsqueeze(-3)
    rows, keys = q.shape[-2], k.shape[-2]
    # The 1/sqrt(D) scale and the cap's 1/cap folded into q: one product, then tanh and * cap in place.
    fold = 1.0 / math.sqrt(q.shape[-1]) / (softcap or 1.0)
    per_row = max(1, q[..., :1, :1].numel() * keys)
    chunk = max(1, CHUNK_LOGITS // per_row)
    mask_rows = attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] == rows and rows > 1
    outs = []
    for begin in range(0, rows, chunk):
        end = min(rows, begin + chunk)
        seen = min(keys, end) if is_causal else keys  # causal: no row of this chunk sees a key at or past ``end``
        logits = torch.matmul(qg[..., begin:end, :].float() * fold, kt[..., :seen])  # (..., Hkv, G, c, seen)
        if softcap:
            logits.tanh_().mul_(softcap)
        hidden = None
        if is_causal:
            at = torch.arange(begin, end, device=q.device)[:, None]
            hidden = torch.arange(seen, device=q.device)[None, :] > at
        if attn_mask is not None:
            mask = (attn_mask[..., begin:end, :] if mask_rows else attn_mask)[..., :seen]
            if mask.dtype == torch.bool:
                hidden = ~mask if hidden is None else hidden | ~mask
            else:
                logits.add_(mask.float())
        if hidden is not None:
            logits.masked_fill_(hidden, float("-inf"))
        dead = logits.amax(dim=-1, keepdim=True) == float("-inf")  # every key hidden (NaN rows are not)
        weights = torch.softmax(logits, dim=-1).masked_fill_(dead, 0.0)
        outs.append(torch.matmul(weights, vf[..., :seen, :]))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    return out.flatten(-4, -3).to(q.dtype)
