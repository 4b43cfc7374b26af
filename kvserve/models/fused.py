"""A decoder layer's elementwise steps, each one compiled CPU op (``csrc/fused_ops.cpp``) where it is built, else
the torch code it replaces. At batch 1 a step's cost is mostly the dispatch of ~1,200 small ops; these cut a
Llama layer's elementwise work from ~25 ops to 4. The torch versions are the reference the tests hold the
kernels to, and what runs on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.platform.cpu_kernels import use_cpu_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) for x (..., hidden): the norm in float32, rounded to x's dtype, then scaled."""
    if x.dim() == 2 and x.stride(-1) == 1 and weight.dtype == x.dtype and use_cpu_kernel(x):
        return torch.ops.kvserve.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = F.rms_norm(x.float(), weight.shape, eps=eps)
    return weight * normed.to(x.dtype)


def rotate_(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding of x (N, heads, D) by its rows of ``table`` (cos, sin (N, 1, D)), in place where the
    kernel runs (x may be a view of a fused projection); returns the rotated tensor."""
    cos, sin = table
    if x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous() and use_cpu_kernel(x, cos):
        torch.ops.kvserve.rope_(x, cos, sin)
        return x
    return rotate_reference(x, table)


def rotate_reference(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + roll(x, D/2) * sin (sin's first half is stored negated)."""
    cos, sin = table
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def silu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    """silu(gate) * up for gate_up (N, 2n) = [gate | up] -> (N, n)."""
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and use_cpu_kernel(gate_up):
        return torch.ops.kvserve.silu_mul(gate_up, n)
    return silu_mul_reference(gate_up, n)


def silu_mul_reference(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    gate, up = gate_up.split(n, dim=-1)
    return F.silu(gate) * up
