"""GGUF Q4_0 / Q4_1 (and a tied Q8_0 head) run on their codes instead of dequantised matrices.

ggml stores a Q4_0 block of 32 weights as ``w = d * (q - 8)`` and a Q4_1 block as ``w = d * q + m``
(``q`` in 0..15, ``d`` and ``m`` float16); ``Int4Weight`` keeps every ``q`` with ``w = q * scale + offset``
(Q4_0: scale d, offset -8d; Q4_1: d, m), values exactly those of ggml's dequantisation. Two kernels:

- **float32 activations**: kvserve's ``q4_linear`` / ``q8_linear`` (``csrc/quant_gemv.cpp``) read the codes
  (4-bit ones rearranged so that decoding them needs no shuffles: ``Int4Weight.lane_words``) and the
  constants as float32: results equal the dequantised float32 matmul but for the order of the sums.
- **bfloat16 / float16**: torch's ``_weight_int4pack_mm_for_cpu``, with ``w = (q - 8) * scale + zero`` per
  group of 32, so the group constants are rewritten (``zero = offset + 8 * scale``) and rounded to the
  activation dtype (bfloat16: 8 significant bits instead of float16's 11), the same rounding a bfloat16
  copy of the dequantised weight has. It is ~20x slower than a dense float32 matmul on float32
  activations, hence kvserve's kernel there.

Row operations a loader needs (llama.cpp's Q/K row permutation, fusing q/k/v and gate/up) are done
on ``Int4Weight`` (codes and group constants per row) before packing, since the packed layouts are
the kernels' own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from kvserve.models.packed_linear import dense_linear, prepack
from kvserve.platform.cpu_kernels import cpu_kernels_available

GROUP_SIZE = 32  # ggml's block size for Q4_0 / Q4_1 / Q8_0, and the kernels' group size
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
# kvserve's float32 kernels decode a weight group once for up to 4 rows. Against MKL's float32 matmul on the
# dense weight (5-8x the bytes), from DRAM, 2 threads, AMD EPYC (benchmarks/decode-kernel/quant_gemv.py): a
# layer's projections 3.7x faster at 1 row, 1.25x at 16, 0.78x at 24; the Q8_0 head 4.6x / 2.6x / 1.6x at
# 1 / 16 / 32 rows. More rows than these go through the dense copy.
FLOAT32_MAX_ROWS = 16
FLOAT32_HEAD_MAX_ROWS = 32
# With activations rounded to int8 (``q4_linear_q8``, int8_activations.py) the codes beat the dense float32 matmul
# at every row count (SmolLM2's layers, 2 threads, AMD EPYC, benchmarks/int8-activations: 3.0x at 32 rows, 1.9x
# at 128, 1.5x at 2,048), so a projection switched to int8 drops its dense copy; so does a Q8_0 head
# (``q8_linear_q8``: 4.9x at 32 rows, 2.6x at 128, AMD EPYC with VNNI). Their codes interleave blocks of this many
# output rows (a weight with another output count keeps float32 activations).
INT8_OUT_BLOCK = 8


def max_rows(dtype: torch.dtype, head: bool = False) -> int:
    """Rows a call runs on the codes when a dense copy is at hand (more go through the copy); ``head``: the
    Q8_0 LM head's limit."""
    if dtype != torch.float32:
        return INT4_MAX_ROWS
    return FLOAT32_HEAD_MAX_ROWS if head else FLOAT32_MAX_ROWS


@dataclass
class Int4Weight:
    """An (out, in) weight as 4-bit codes with a scale and an offset per group of 32 inputs.

    Value: ``codes * scale + offset``, with scale and offset repeated over their group.
    """

    codes: torch.Tensor  # (N, K) uint8 in 0..15
    scale: torch.Tensor  # (N, K / 32) float32
    offset: torch.Tensor  # (N, K / 32) float32

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
            offset = -8 * scale  # exact: a power of two times a float16
        else:
            offset = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        return cls(codes, scale, offset)

    def lane_words(self) -> torch.Tensor:
        """(N, ceil(K / 64) * 8) int32 in the lane order of kvserve's ``q4_linear``: word l of a pair of groups
        holds the code of input 8j + l of the pair's 64 inputs in nibble j (nibbles 4-7: the second group)."""
        n, k = self.shape
        groups = k // GROUP_SIZE
        codes = self.codes.reshape(n, groups, 4, 8).to(torch.int64)  # (N, group, nibble j, lane l)
        lanes = (codes << (4 * torch.arange(4)).view(4, 1)).sum(dim=2)  # (N, groups, 8): 16 bits each
        if groups % 2:
            lanes = torch.cat((lanes, torch.zeros(n, 1, 8, dtype=torch.int64)), dim=1)
        pairs = lanes.reshape(n, -1, 2, 8)
        words = pairs[:, :, 0] | (pairs[:, :, 1] << 16)
        words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits as a signed int32
        return words.to(torch.int32).reshape(n, -1).contiguous()

    def interleaved_nibbles(self) -> torch.Tensor:
        """``q4_linear_q8``'s codes: (N, K / 2) uint8, N a multiple of ``INT8_OUT_BLOCK``, the rows interleaved per
        block of 8 (ggml's repacked layout): a block's bytes run [group][v = 0..3][row r][byte i], byte i holding
        the code of the group's input 8v + i in its low nibble and of input 8v + 4 + i in its high one."""
        n, k = self.shape
        c = self.codes.reshape(n // INT8_OUT_BLOCK, INT8_OUT_BLOCK, k // GROUP_SIZE, 4, 2, 4)  # (b, r, g, v, half, i)
        pairs = c[..., 0, :] | (c[..., 1, :] << 4)  # (b, r, g, v, i)
        return pairs.permute(0, 2, 3, 1, 4).reshape(n, k // 2).contiguous()

    @staticmethod
    def codes_from_interleaved_nibbles(nibbles: torch.Tensor, k: int) -> torch.Tensor:
        """The inverse of ``interleaved_nibbles``: (N, K) uint8 codes."""
        n = nibbles.shape[0]
        pairs = nibbles.reshape(n // INT8_OUT_BLOCK, k // GROUP_SIZE, 4, INT8_OUT_BLOCK, 4).permute(0, 3, 1, 2, 4)
        return torch.stack((pairs & 0x0F, pairs >> 4), dim=-2).reshape(n, k)

    def interleaved_consts(self) -> torch.Tensor:
        """``q4_linear_q8``'s group constants: (N / 8, K / 32, 2, 8) float32, per block of 8 rows and group the
        rows' scales, then their offsets."""
        n, groups = self.scale.shape
        both = torch.stack((self.scale, self.offset), dim=1).float()  # (N, 2, G)
        return both.reshape(n // INT8_OUT_BLOCK, INT8_OUT_BLOCK, 2, groups).permute(0, 3, 2, 1).contiguous()

    @staticmethod
    def codes_from_lane_words(words: torch.Tensor, k: int) -> torch.Tensor:
        """The inverse of ``lane_words``: (N, K) uint8 codes."""
        n = words.shape[0]
        lanes = words.to(torch.int64).reshape(n, -1, 1, 8) & 0xFFFFFFFF
        lanes = torch.cat((lanes & 0xFFFF, lanes >> 16), dim=2).reshape(n, -1, 8)[:, : k // GROUP_SIZE]
        codes = (lanes.unsqueeze(2) >> (4 * torch.arange(4)).view(4, 1)) & 0x0F  # (N, groups, nibble j, lane l)
        return codes.reshape(n, k).to(torch.uint8)

    def dequantize(self) -> torch.Tensor:
        """float32 (N, K)."""
        n, k = self.shape
        codes = self.codes.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return (codes * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)).reshape(n, k)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
        """Apply a row operation (a permutation, a selection) to codes and group constants alike."""
        return Int4Weight(fn(self.codes), fn(self.scale), fn(self.offset))

    @staticmethod
    def cat(parts: Sequence[Int4Weight]) -> Int4Weight:
        """Stack the rows of several weights with the same input size (a fused projection)."""
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "offset")))


@dataclass
class Int8Weight:
    """A GGUF Q8_0 weight: ``codes * scale`` with int8 codes and a scale per group of 32 inputs."""

    codes: torch.Tensor  # (N, K) int8
    scale: torch.Tensor  # (N, K / 32) float32

    @classmethod
    def from_q8_0_blocks(cls, blocks: np.ndarray) -> Int8Weight:
        rows = blocks.shape[0]
        raw = np.ascontiguousarray(blocks).reshape(rows, -1, 2 + GROUP_SIZE)  # (N, groups, f16 d + 32 int8)
        d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        return cls(torch.from_numpy(raw[..., 2:].copy().view(np.int8)).reshape(rows, -1), d)

    def planes(self) -> Int4Weight:
        """The weight as two stacked int4 weights, rows [high; low], for torch's int4 kernel.

        ``q + 128 = 16 * hi + lo`` with hi, lo in 0..15, so ``w = 16d * hi - 128d + d * lo``: the high plane
        has codes hi, scale 16d, offset -128d; the low plane codes lo, scale d, offset 0. The sum of the two
        planes' rows is the weight, every code kept (see ``Q8Linear``).
        """
        q = self.codes.to(torch.int16) + 128
        d = self.scale
        high = Int4Weight((q >> 4).to(torch.uint8), 16 * d, -128 * d)
        low = Int4Weight((q & 0x0F).to(torch.uint8), d.clone(), torch.zeros_like(d))
        return Int4Weight.cat([high, low])

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        return (self.codes.reshape(n, -1, GROUP_SIZE).float() * self.scale.unsqueeze(-1)).reshape(n, k)

    def interleaved_offset_codes(self) -> torch.Tensor:
        """``q8_linear_q8``'s codes: (N, K) uint8 holding code + 128, N a multiple of ``INT8_OUT_BLOCK``, the rows
        interleaved per block of 8: a block's bytes run [group][v = 0..7][row r][byte i], byte i the code of the
        group's input 4v + i."""
        n, k = self.codes.shape
        unsigned = (self.codes.to(torch.int16) + 128).to(torch.uint8)
        c = unsigned.reshape(n // INT8_OUT_BLOCK, INT8_OUT_BLOCK, k // GROUP_SIZE, 8, 4)  # (b, r, g, v, i)
        return c.permute(0, 2, 3, 1, 4).reshape(n, k).contiguous()

    def interleaved_scales(self) -> torch.Tensor:
        """``q8_linear_q8``'s scales: (N / 8, K / 32, 8) float32, per block of 8 rows and group the rows' scales."""
        n, groups = self.scale.shape
        return self.scale.float().reshape(n // INT8_OUT_BLOCK, INT8_OUT_BLOCK, groups).transpose(1, 2).contiguous()

    @classmethod
    def from_interleaved(cls, codes: torch.Tensor, scales: torch.Tensor) -> Int8Weight:
        """The inverse of ``interleaved_offset_codes`` and ``interleaved_scales``."""
        n, k = codes.shape
        c = codes.reshape(n // INT8_OUT_BLOCK, k // GROUP_SIZE, 8, INT8_OUT_BLOCK, 4).permute(0, 3, 1, 2, 4)
        signed = (c.reshape(n, k).to(torch.int16) - 128).to(torch.int8)
        return cls(signed, scales.transpose(1, 2).reshape(n, -1))


def _zero_rows(n: int, k: int) -> Int4Weight:
    groups = k // GROUP_SIZE
    return Int4Weight(torch.zeros((n, k), dtype=torch.uint8), torch.zeros(n, groups), torch.zeros(n, groups))


def _float32_kernels_run(dtype: torch.dtype) -> bool:
    """Whether kvserve's float32 kernels take activations of ``dtype`` here (else the dequantising reference)."""
    return dtype == torch.float32 and cpu_kernels_available()


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W held as 4-bit codes (half a byte per weight).

    ``dtype`` is the activation dtype. float32 runs kvserve's ``q4_linear`` on its lane layout (or,
    without the compiled kernels, a dequantising reference); bfloat16 and float16 run torch's packed int4
    layout and kernel. ``dense``, the same weight dequantised to ``dtype``, optionally rides along for batches
    of more than ``max_rows(dtype)`` rows (prefill, many sequences), where the dense matmul is faster.
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
        self.act_dtype = dtype
        self.max_rows = max_rows(dtype)
        self.int8_activations = False
        if dtype == torch.float32:
            self.register_buffer("codes", weight.lane_words())  # (N, ceil(K / 64) * 8) int32
            self.register_buffer("consts", torch.stack((weight.scale, weight.offset), dim=1).float().contiguous())
        else:
            pad = -self.out_features % _ROW_MULTIPLE  # the packing needs N divisible by 16: zero rows, sliced off
            if pad:
                weight = Int4Weight.cat([weight, _zero_rows(pad, self.in_features)])
            codes = weight.codes.to(torch.int32).contiguous()
            self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
            zero = weight.offset + 8 * weight.scale
            scales_and_zeros = torch.stack((weight.scale, zero), dim=-1).transpose(0, 1)  # (K / 32, N, 2)
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

    def round_activations_to_int8(self) -> bool:
        """Run the products on codes with float32 activations rounded to int8 (``q4_linear_q8``; see
        ``int8_activations.py``): the codes and constants are interleaved per block of 8 rows (``interleaved_nibbles``)
        and every batch runs on them, so a dense copy is dropped. False (nothing changes) where this projection does
        not take float32 activations, or its output count is not a multiple of ``INT8_OUT_BLOCK``."""
        if self.act_dtype != torch.float32 or self.int8_activations or self.out_features % INT8_OUT_BLOCK:
            return False
        weight = self.int4_weight()
        del self.codes
        self.register_buffer("nibbles", weight.interleaved_nibbles())
        self.register_buffer("consts", weight.interleaved_consts())
        self.dense, self.dense_packed = None, None
        self.int8_activations, self.max_rows = True, sys.maxsize  # the codes serve every batch
        return True

    @property
    def dtype(self) -> torch.dtype:
        return self.act_dtype

    @property
    def kernel_codes(self) -> torch.Tensor:
        """The codes as the float32 kernel reads them: int32 lane words (``q4_linear``) or, with int8
        activations, interleaved uint8 nibbles (``q4_linear_q8``)."""
        return self.nibbles if self.int8_activations else self.codes

    def code_tensors(self) -> list[torch.Tensor]:
        """What a product on the codes reads (for byte counts)."""
        if self.act_dtype == torch.float32:
            return [self.kernel_codes, self.consts]
        return [self.packed_weight, self.scales_and_zeros]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > self.max_rows and (self.dense is not None or self.dense_packed is not None):
            return dense_linear(x, self.dense, self.dense_packed, self.bias)
        y = self._on_codes(x2.contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _on_codes(self, x2: torch.Tensor) -> torch.Tensor:
        if self.act_dtype != torch.float32:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed_weight, GROUP_SIZE, self.scales_and_zeros)
            return y[:, : self.out_features] if y.shape[-1] != self.out_features else y
        if self.int8_activations:  # set only where the kernels run (int8_activations.py)
            return torch.ops.kvserve.q4_linear_q8(x2, self.nibbles, self.consts)
        if x2.device.type == "cpu" and _float32_kernels_run(x2.dtype):
            return torch.ops.kvserve.q4_linear(x2, self.codes, self.consts)
        return F.linear(x2, self.int4_weight().dequantize())  # the reference: no compiled kernels

    def int4_weight(self) -> Int4Weight:
        """The float32 kernels' weight as codes and group constants."""
        if self.int8_activations:
            codes = Int4Weight.codes_from_interleaved_nibbles(self.nibbles, self.in_features)
            consts = self.consts.permute(0, 3, 2, 1).reshape(self.out_features, 2, -1)  # back to (N, 2, G)
        else:
            codes, consts = Int4Weight.codes_from_lane_words(self.codes, self.in_features), self.consts
        return Int4Weight(codes, consts[:, 0], consts[:, 1])

    def extra_repr(self) -> str:
        has_dense = self.dense is not None or self.dense_packed is not None
        dense = f", dense copy above {self.max_rows} rows" if has_dense else ""
        int8 = ", int8 activations" if self.int8_activations else ""
        return f"in={self.in_features}, out={self.out_features}, int4 groups of {GROUP_SIZE}, {self.dtype}{int8}{dense}"


class Q8Linear(nn.Module):
    """y = x W^T for a GGUF Q8_0 weight (e.g. a tied LM head), read as its 8-bit codes.

    float32 runs kvserve's ``q8_linear`` on the int8 codes; bfloat16 and float16 run the codes as two int4
    planes (``Int8Weight.planes``) in one call of torch's int4 kernel and add the halves. A byte and a
    quarter per weight is read instead of bfloat16's two. ``dense`` (the same weight in ``dtype``, e.g.
    the tied embedding matrix) serves batches of more than ``max_rows(dtype, head=True)`` rows.
    """

    def __init__(self, weight: Int8Weight, dtype: torch.dtype, dense: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.max_rows = max_rows(dtype, head=True)
        self.act_dtype = dtype
        self.planes: QuantLinear | None = None
        if dtype == torch.float32:
            self.register_buffer("codes", weight.codes.contiguous())
            self.register_buffer("scale", weight.scale.float().contiguous())
        else:
            self.planes = QuantLinear(weight.planes(), dtype)
        self.dense = dense
        self.dense_packed: torch.Tensor | None = None
        self.int8_activations = False

    def prepack(self) -> None:
        self.dense_packed = prepack(self.dense) if self.dense is not None else None

    def round_activations_to_int8(self) -> bool:
        """Run the head with float32 activations rounded to int8 (``q8_linear_q8``, as ``QuantLinear``'s switch):
        the codes interleaved per block of 8 rows, every batch on them, the dense copy dropped. False (nothing
        changes) where the head does not take float32 activations or its output count is not a multiple of
        ``INT8_OUT_BLOCK``."""
        if self.planes is not None or self.int8_activations or self.out_features % INT8_OUT_BLOCK:
            return False
        weight = Int8Weight(self.codes, self.scale)
        del self.codes, self.scale
        self.register_buffer("offset_codes", weight.interleaved_offset_codes())
        self.register_buffer("scales", weight.interleaved_scales())
        self.dense, self.dense_packed = None, None
        self.int8_activations, self.max_rows = True, sys.maxsize
        return True

    def code_tensors(self) -> list[torch.Tensor]:
        """What a product on the codes reads (for byte counts)."""
        if self.planes is not None:
            return self.planes.code_tensors()
        return [self.offset_codes, self.scales] if self.int8_activations else [self.codes, self.scale]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.dense is not None and x2.shape[0] > self.max_rows:
            return dense_linear(x, self.dense, self.dense_packed)
        if self.planes is not None:
            y = self.planes(x)
            return y[..., : self.out_features] + y[..., self.out_features :]
        if self.int8_activations:  # set only where the kernels run (int8_activations.py)
            y = torch.ops.kvserve.q8_linear_q8(x2.contiguous(), self.offset_codes, self.scales)
        elif x2.device.type == "cpu" and _float32_kernels_run(x2.dtype):
            y = torch.ops.kvserve.q8_linear(x2.contiguous(), self.codes, self.scale)
        else:  # the reference: no compiled kernels
            y = F.linear(x2, Int8Weight(self.codes, self.scale).dequantize())
        return y.reshape(*x.shape[:-1], self.out_features)


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
        self.register_buffer("scale_offset", torch.stack((weight.scale, weight.offset), dim=-1))  # (V, D / 32, 2)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        nibbles = F.embedding(ids, self.nibbles)  # (N, D / 2)
        codes = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(*ids.shape, -1, GROUP_SIZE).float()
        so = self.scale_offset[ids]  # (N, D / 32, 2)
        rows = codes * so[..., :1] + so[..., 1:]
        return rows.reshape(*ids.shape, self.embedding_dim).to(self.dtype)
