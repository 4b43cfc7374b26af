"""GGUF Q4_0 / Q4_1 weights run natively as torch's CPU int4 group-wise format (group 32).

ggml stores a Q4_0 block of 32 weights as ``w = d * (q - 8)`` and a Q4_1 block as ``w = d * q + m``
(``q`` in 0..15, ``d`` and ``m`` float16). torch's ``_weight_int4pack_mm_for_cpu`` computes with
``w = (q - 8) * scale + zero`` per group of 32 along the input dimension, so the conversion keeps
every ``q`` and only rewrites the group constants: Q4_0 -> (scale d, zero 0), Q4_1 -> (scale d,
zero m + 8d). Nothing is lost but the rounding of those constants to the activation dtype
(bfloat16: 8 significant bits instead of float16's 11), the same rounding a bfloat16 copy of the
dequantised weight has.

Row operations a loader needs (llama.cpp's Q/K row permutation, fusing q/k/v and gate/up) are done
on ``Int4Weight`` (codes and group constants per row) before packing, since the packed layout is
the kernel's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from kvserve.models.packed_linear import dense_linear, prepack

GROUP_SIZE = 32  # ggml's block size for Q4_0 / Q4_1, and the kernel's group size
# ggml block layout: bytes of the float16 constants, then 16 bytes of codes (two per byte).
_BLOCK_HEADER = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}
INT4_TYPES = frozenset(_BLOCK_HEADER)
_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu wants the output size divisible by 16
# torch's CPU int4 kernel has no AMX path: its cost grows with the row count, while a bfloat16 matmul
# (weight prepacked for oneDNN, see packed_linear.py) reading 4x the bytes is flat up to dozens of rows.
# Measured on SmolLM2's four projections of a layer (2 threads, AMX Xeon, torch 2.13, cache-warm):
# int4 133 / 169 / 202 / 238 / 437 us for 1 / 2 / 3 / 4 / 6 rows, packed bfloat16 208-218 us.
# With a dense copy at hand, more rows than this go through it.
INT4_MAX_ROWS = 3


@dataclass
class Int4Weight:
    """An (out, in) weight as 4-bit codes with a scale and a zero per group of 32 inputs.

    Dequantised value: ``(codes - 8) * scale + zero``, with scale and zero repeated over their group.
    """

    codes: torch.Tensor  # (N, K) uint8 in 0..15
    scale: torch.Tensor  # (N, K / 32) float32
    zero: torch.Tensor  # (N, K / 32) float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @classmethod
    def from_ggml_blocks(cls, blocks: np.ndarray, qtype: GGMLQuantizationType) -> Int4Weight:
        """``blocks``: a GGUF tensor's raw data, (rows, bytes per row) uint8, of type Q4_0 or Q4_1."""
        if qtype not in _BLOCK_HEADER:
            raise ValueError(f"{qtype.name} is not a 4-bit type with groups of 32 (Q4_0 or Q4_1)")
        header = _BLOCK_HEADER[qtype]
        rows = blocks.shape[0]
        raw = np.ascontiguousarray(blocks).reshape(rows, -1, header + GROUP_SIZE // 2)  # (N, groups, bytes)
        d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = torch.from_numpy(raw[..., header:].copy())  # (N, groups, 16)
        # Byte j of a block holds weight j in its low nibble and weight j + 16 in its high nibble.
        codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, -1)
        scale = torch.from_numpy(d)
        if qtype == GGMLQuantizationType.Q4_0:
            zero = torch.zeros_like(scale)
        else:
            m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
            zero = m + 8 * scale
        return cls(codes, scale, zero)

    @classmethod
    def planes_from_q8_0(cls, blocks: np.ndarray) -> Int4Weight:
        """A Q8_0 tensor (``w = d * q``, q in -128..127) as two stacked int4 weights, rows [high; low].

        ``q + 128 = 16 * hi + lo`` with hi, lo in 0..15, so ``w = 16d * (hi - 8) + d * lo``: the high
        plane has codes hi, scale 16d, zero 0; the low plane codes lo, scale d, zero 8d. The sum of the
        two planes' rows is the weight, every code kept (see ``Int8PlanesLinear``).
        """
        rows = blocks.shape[0]
        raw = np.ascontiguousarray(blocks).reshape(rows, -1, 2 + GROUP_SIZE)  # (N, groups, f16 d + 32 int8)
        d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        q = torch.from_numpy(raw[..., 2:].copy().view(np.int8)).reshape(rows, -1).to(torch.int16) + 128
        high = cls((q >> 4).to(torch.uint8), 16 * d, torch.zeros_like(d))
        low = cls((q & 0x0F).to(torch.uint8), d.clone(), 8 * d)
        return cls.cat([high, low])

    def dequantize(self) -> torch.Tensor:
        """float32 (N, K)."""
        n, k = self.shape
        codes = self.codes.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8
        return (codes * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).reshape(n, k)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
        """Apply a row operation (a permutation, a selection) to codes and group constants alike."""
        return Int4Weight(fn(self.codes), fn(self.scale), fn(self.zero))

    @staticmethod
    def cat(parts: Sequence[Int4Weight]) -> Int4Weight:
        """Stack the rows of several weights with the same input size (a fused projection)."""
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "zero")))


def _zero_rows(n: int, k: int) -> Int4Weight:
    groups = k // GROUP_SIZE
    return Int4Weight(torch.full((n, k), 8, dtype=torch.uint8), torch.zeros(n, groups), torch.zeros(n, groups))


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W held in torch's packed CPU int4 layout (half a byte per weight).

    ``dtype`` is the activation dtype; the group constants are stored in it. The kernel takes
    bfloat16, float16 or float32 activations (measured on torch 2.13) and a 2-D input.
    ``dense``, the same weight dequantised to ``dtype``, optionally rides along for batches of more
    than ``INT4_MAX_ROWS`` rows (prefill, many sequences), where the dense matmul is faster.
    """

    def __init__(
        self,
        weight: Int4Weight,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        dense: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if dense is not None and tuple(dense.shape) != weight.shape:
            raise ValueError(f"dense weight has shape {tuple(dense.shape)}, the int4 weight {weight.shape}")
        if self.in_features % GROUP_SIZE:
            raise ValueError(f"int4 weights need an input size divisible by {GROUP_SIZE}, got {self.in_features}")
        pad = -self.out_features % _ROW_MULTIPLE  # the packing needs N divisible by 16: zero rows, sliced off
        if pad:
            weight = Int4Weight.cat([weight, _zero_rows(pad, self.in_features)])
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed_weight", packed)  # (N, K / 2) uint8, the kernel's layout
        scales_and_zeros = torch.stack((weight.scale, weight.zero), dim=-1).transpose(0, 1)  # (K / 32, N, 2)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(dtype).contiguous())
        self.bias = nn.Parameter(bias.to(dtype)) if bias is not None else None
        self.dense = nn.Parameter(dense.to(dtype)) if dense is not None else None
        self.dense_packed: torch.Tensor | None = None

    def prepack(self) -> None:
        """Reorder the dense copy once for oneDNN (see ``packed_linear``); call after loading. The packed
        copy then serves every large batch, so the plain one is dropped: one dense copy in memory."""
        packed = prepack(self.dense) if self.dense is not None else None
        if packed is not None:
            self.dense_packed, self.dense = packed, None

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > INT4_MAX_ROWS and (self.dense is not None or self.dense_packed is not None):
            return dense_linear(x, self.dense, self.dense_packed, self.bias)
        x2 = x2.contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed_weight, GROUP_SIZE, self.scales_and_zeros)
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        has_dense = self.dense is not None or self.dense_packed is not None
        dense = f", dense copy above {INT4_MAX_ROWS} rows" if has_dense else ""
        return f"in={self.in_features}, out={self.out_features}, int4 groups of {GROUP_SIZE}, {self.dtype}{dense}"


class Int8PlanesLinear(nn.Module):
    """y = x W^T for a GGUF Q8_0 weight, read as its 8-bit codes: two int4 planes in one int4 matmul.

    ``planes`` comes from ``Int4Weight.planes_from_q8_0`` (rows [high; low]); the kernel computes both
    halves of the output in one call and they are added. A byte and a quarter per weight is read
    instead of bfloat16's two. ``dense`` (the same weight in ``dtype``, e.g. the tied embedding matrix)
    serves batches of more than ``INT4_MAX_ROWS`` rows.
    """

    def __init__(self, planes: Int4Weight, dtype: torch.dtype, dense: torch.Tensor | None = None) -> None:
        super().__init__()
        rows, self.in_features = planes.shape
        self.out_features = rows // 2
        self.planes = QuantLinear(planes, dtype)
        self.dense = dense
        self.dense_packed: torch.Tensor | None = None

    def prepack(self) -> None:
        self.dense_packed = prepack(self.dense) if self.dense is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.reshape(-1, self.in_features).shape[0] > INT4_MAX_ROWS:
            return dense_linear(x, self.dense, self.dense_packed)
        y = self.planes(x)
        return y[..., : self.out_features] + y[..., self.out_features :]


class QuantEmbedding(nn.Module):
    """Embedding rows kept as 4-bit codes (two per byte, row order) and dequantised only when looked up.

    For a tied Q4 token embedding: the lookup reads a few rows; the LM head (a ``QuantLinear`` over
    the same codes) reads the whole matrix in its compact form.
    """

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        codes = weight.codes.reshape(self.num_embeddings, -1, 2)
        self.register_buffer("nibbles", codes[..., 0] | (codes[..., 1] << 4))  # (V, D / 2) uint8
        self.register_buffer("scale_zero", torch.stack((weight.scale, weight.zero), dim=-1))  # (V, D / 32, 2) f32
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        nibbles = F.embedding(ids, self.nibbles)  # (N, D / 2)
        codes = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(*ids.shape, -1, GROUP_SIZE).float() - 8
        sz = self.scale_zero[ids]  # (N, D / 32, 2)
        rows = codes * sz[..., :1] + sz[..., 1:]
        return rows.reshape(*ids.shape, self.embedding_dim).to(self.dtype)
