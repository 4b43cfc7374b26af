"""Building blocks of the Llama family: RMSNorm, rotary embedding with explicit positions, SwiGLU."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.models import fused
from kvserve.models.config import RopeScaling
from kvserve.models.packed_linear import dense_linear, prepack


class Linear(nn.Module):
    """y = x W^T (+ b), with parameters left uninitialised: weights always come from a checkpoint.

    Skipping torch's random init keeps model construction instant (the pages are never touched
    before the checkpoint's tensors are assigned in their place).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # see prepack()
        self.row_tile = 0  # rows per matmul call in the batch-invariant mode (packed_linear.in_row_tiles); 0: all

    def prepack(self) -> None:
        """Reorder the weight once for oneDNN where that is faster (bfloat16 on CPU); call after loading."""
        self.packed = prepack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.packed, self.bias, self.row_tile)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the activation dtype, as the reference does.
        return fused.rms_norm(x, self.weight, self.eps)


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, freq_factors: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) after the model's scaling rule.

    ``freq_factors`` are the per-frequency divisors a GGUF file stores as ``rope_freqs.weight``
    (llama.cpp's precomputed form of llama3 scaling); they take precedence over ``scaling``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:
        return (inv_freq / freq_factors.to(torch.float64)).float()
    if scaling is None or scaling.rope_type == "default":
        return inv_freq.float()
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).float()
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout, indexed by explicit position ids.

    A token's rotation depends only on its position id, never on where it sits in a batch or
    cache, so chunks, gaps and reused modules rotate correctly. ``table`` looks the step's
    positions up once; every layer then rotates its queries and keys with ``apply``.
    """

    def __init__(self, inv_freq: torch.Tensor, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # (P, D/2)
        # Stored as [cos | cos] and [-sin | sin], so x rotated = x * cos + roll(x, D/2) * sin.
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (N, 1, D) for positions (N,), in the activation dtype (as transformers rotates)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate x (N, heads, D) by its rows of ``table``, as a new tensor (``fused.rotate_`` rotates in place)."""
        return fused.rotate_reference(x, table)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_mul(self.gate_up_proj(x), self.intermediate_size))
