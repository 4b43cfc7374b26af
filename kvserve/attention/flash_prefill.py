"""Causal prefill attention in bfloat16 through kvserve's own kernel (``csrc/flash_prefill.cpp``), on CPUs
whose bfloat16 dot product instruction (AVX512-BF16) torch's flash attention does not use.

Without AMX, torch's CPU flash attention computes bfloat16 at its float32 speed: causal 2,048 queries x 9
heads x 64 ran at 116 GFLOP/s on an AMD EPYC Zen 4 (2 threads), about half of a 2,048-token prefill; the
kernel's ``vdpbf16ps`` products ran the same shape at 280 GFLOP/s. With AMX, torch's kernel runs its products
on the tiles and the kernel is not built (``flash_prefill_available()`` is false there, as on CPUs without
AVX512-BF16): ``attend_prefill`` then keeps SDPA. float32 and float16 always keep SDPA, so the float32
exactness of every lossless path is untouched.

``flash_prefill_votes`` is the same attention for a compressing cache's prefill chunk, which also needs how much
attention its voting queries pay each key (``policies/scoring.py``): the kernel takes it from the same logits in a
second pass over K for those queries only, in float32 (bfloat16 products are exact in float32), so every row keeps
this kernel instead of the voting rows attending in float32 through torch.
"""

from __future__ import annotations

import functools
import math

import torch

from kvserve.platform.cpu_kernels import cpu_kernels_available


@functools.cache
def flash_prefill_available() -> bool:
    """Whether this machine's kernel build has the bfloat16 prefill kernel and prefers it to torch's."""
    return cpu_kernels_available() and bool(torch.ops.kvserve.flash_prefill_available())


def use_flash_prefill(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``flash_prefill`` takes q (T, H, D) and k (N, Hkv, D)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and k.dtype == torch.bfloat16
        and q.shape[-1] % 64 == 0
        and q.shape[1] % k.shape[1] == 0
        and flash_prefill_available()
    )


def flash_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_len: int,
    window: int | None = None,
    key_ends: torch.Tensor | None = None,
    key_starts: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q (T, H, D) at cache positions ctx_len.. over k, v (ctx_len + T, Hkv, D) -> (T, H, D), causal, each query
    over at most the last ``window`` positions (its own included) when given; 1/sqrt(D) scaling as SDPA's.
    With ``key_ends`` ((T,) int64), query t sees keys ``0 .. key_ends[t] - 1`` of k, v (N, Hkv, D) instead, and
    with ``key_starts`` too, keys ``key_starts[t] .. key_ends[t] - 1``. Scaled logits are soft-capped by ``softcap``
    (0: none; ``attention/softcap.py``)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.kvserve.flash_prefill(q, k, v, ctx_len, window or 0, scale, key_ends, key_starts, softcap)


def flash_prefill_votes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_len: int,
    first: int,
    row_weights: torch.Tensor,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_prefill``'s causal attention of q (T, H, D) over k, v (ctx_len + T, Hkv, D), and the votes of its
    queries first..: the attention each key receives from them, weighted by ``row_weights`` (T - first,) and
    averaged over the query heads that read its KV head, summed -> (output (T, H, D), sums (ctx_len + T, Hkv)
    float32): ``scoring.head_column_sums`` of the same queries, without a float32 pass over their rows."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    weights = row_weights.to(torch.float32).contiguous()
    out, sums = torch.ops.kvserve.flash_prefill_votes(q, k, v, ctx_len, scale, first, weights, softcap)
    return out, sums.T
