"""GGUF weights of the K-quant mixes (Q4_K, Q5_K, Q6_K, and the Q5_0 / Q8_0 llama.cpp writes for short rows) run in
their file's own block format, read in place from the mapped file.

A ``GGUFWeight`` is a tensor's bytes, (rows, bytes per row) uint8, and its ggml type; nothing is repacked or copied,
so a model costs about its file's size. ``GGUFLinear`` runs kvserve's ``gguf_linear`` (``csrc/gguf_gemv.cpp``): the
activations rounded to int8 per block (256 inputs for the K-quants, 32 for Q5_0 / Q8_0, as llama.cpp does) and each
block's product an integer sum of byte products. Lossy against float32 activations the way llama.cpp is (every
input keeps 8 bits); a row's result does not depend on the batch. Several tensors with one input size form one
fused projection (q/k/v, gate/up) without copying their rows: the kernel writes the parts' outputs side by side,
and llama.cpp's Q/K row order is undone by where each row's output lands (``out_index``). ``GGUFEmbedding``
dequantises only the rows a batch looks up; a tied head is a ``GGUFLinear`` over the same bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from kvserve.models.dtype import cpu_has_bf16_acceleration
from kvserve.platform.cpu_kernels import cpu_kernels_available

NATIVE_TYPES = frozenset(
    {
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q8_0,
    }
)


@dataclass
class GGUFWeight:
    """An (out, in) weight as ggml blocks: ``blocks`` (out, bytes per row) uint8, a view of the file where it can
    be; ``row_order`` (out,) int64 or None: row i of the weight as the model wants it is row ``row_order[i]``
    of ``blocks`` (llama.cpp's Q/K permutation undone). Stacked experts: ``blocks`` (experts, out, bytes per row)."""

    blocks: torch.Tensor
    qtype: GGMLQuantizationType
    row_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.qtype not in NATIVE_TYPES:
            raise ValueError(f"{self.qtype.name} is not one of {sorted(t.name for t in NATIVE_TYPES)}")
        block, size = GGML_QUANT_SIZES[self.qtype]
        if self.blocks.dim() not in (2, 3) or self.blocks.dtype != torch.uint8 or self.blocks.shape[-1] % size:
            raise ValueError(f"{self.qtype.name} blocks must be ([experts,] rows, whole {size}-byte blocks) uint8")
        self.in_features = self.blocks.shape[-1] // size * block

    @property
    def shape(self) -> tuple[int, ...]:
        return *self.blocks.shape[:-1], self.in_features

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 (len(rows), in) for weight rows ``rows`` (in the model's order)."""
        stored = rows if self.row_order is None else self.row_order[rows]
        if cpu_kernels_available():
            return torch.ops.kvserve.gguf_dequantize(self.blocks, int(self.qtype), stored.reshape(-1).long(), False)
        picked = self.blocks[stored.reshape(-1)].numpy()
        return torch.from_numpy(np.asarray(dequantize(picked, self.qtype), dtype=np.float32))

    def dequantize(self) -> torch.Tensor:
        """float32 (out, in): the reference the kernels are checked against."""
        return self.dequantize_rows(torch.arange(self.shape[0]))


# Batches from which a bfloat16 model dequantises a weight to bfloat16 for the call and runs oneDNN's GEMM instead
# of the int8 kernel, on a CPU with bfloat16 matmul instructions (AVX512-BF16, AMX). Measured on AMD EPYC Zen 4, 2
# threads (int8 kernel time / dequantise + GEMM time): Q4_K 8192x2048 0.77 at 128 rows, 1.60 at 512; Q6_K
# 2048x8192 0.69 / 1.35; with 32-input blocks (Gemma's 640-wide Q5_0 / Q8_0) 2.6-2.7 already at 64 rows.
SUPER_BLOCK_DENSE_ROWS = 256
BLOCK32_DENSE_ROWS = 64
_BLOCK32 = frozenset({GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0})


class GGUFLinear(nn.Module):
    """y = x W^T (+ b), W the rows of ``parts`` stacked, each part read as its ggml blocks (see the top).
    ``dtype``: the activations' dtype (the product runs on float32 inputs and returns ``dtype``). A bfloat16 model
    on a CPU with bfloat16 matmul instructions runs batches of ``dense_rows`` rows or more (prefill) as a GEMM on the
    weight dequantised for the call: faster there, and no copy is kept."""

    def __init__(self, parts: Sequence[GGUFWeight], dtype: torch.dtype, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        inputs = {p.in_features for p in parts}
        if len(inputs) != 1:
            raise ValueError(f"the parts of a fused projection must share an input size, got {sorted(inputs)}")
        (self.in_features,) = inputs
        self.out_features = sum(p.shape[0] for p in parts)
        self.act_dtype = dtype
        self.types = [int(p.qtype) for p in parts]
        self.type_names = [p.qtype.name for p in parts]
        for i, part in enumerate(parts):
            self.register_buffer(f"part{i}", part.blocks, persistent=False)
        # out_index[o]: the output column of stored row o (counting through the parts): the inverse of row_order.
        orders, first = [], 0
        for part in parts:
            rows = part.shape[0]
            order = torch.arange(rows) if part.row_order is None else part.row_order
            orders.append(order + first)
            first += rows
        order = torch.cat(orders)
        index = torch.empty_like(order)
        index[order] = torch.arange(self.out_features)
        identity = bool(torch.equal(index, torch.arange(self.out_features)))
        self.register_buffer("out_index", torch.empty(0, dtype=torch.long) if identity else index, persistent=False)
        self.row_orders = [torch.arange(p.shape[0]) if p.row_order is None else p.row_order for p in parts]
        self.bias = nn.Parameter(bias.to(dtype)) if bias is not None else None
        small = all(p.qtype in _BLOCK32 for p in parts)
        self.dense_rows = BLOCK32_DENSE_ROWS if small else SUPER_BLOCK_DENSE_ROWS
        if dtype != torch.bfloat16 or not cpu_has_bf16_acceleration():
            self.dense_rows = sys.maxsize

    def blocks(self) -> list[torch.Tensor]:
        return [getattr(self, f"part{i}") for i in range(len(self.types))]

    def code_tensors(self) -> list[torch.Tensor]:
        """What a product reads (for byte counts)."""
        return self.blocks()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole (out, in) weight in the model's row order, as float32 or bfloat16."""
        bf16 = dtype == torch.bfloat16
        parts = zip(self.blocks(), self.types, self.row_orders, strict=True)
        return torch.cat([torch.ops.kvserve.gguf_dequantize(b, t, order, bf16) for b, t, order in parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] >= self.dense_rows:
            y = F.linear(x2.to(torch.bfloat16), self.dequantize(torch.bfloat16), self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        y = torch.ops.kvserve.gguf_linear(x2.float().contiguous(), self.blocks(), self.types, self.out_index)
        y = y.to(self.act_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, types={'+'.join(self.type_names)}"


class GGUFEmbedding(nn.Module):
    """Token embedding rows kept as ggml blocks, dequantised when looked up."""

    def __init__(self, weight: GGUFWeight, dtype: torch.dtype) -> None:
        super().__init__()
        if weight.row_order is not None:
            raise ValueError("an embedding's rows are in their stored order")
        self.num_embeddings, self.embedding_dim = weight.shape
        self.qtype = weight.qtype
        self.register_buffer("blocks", weight.blocks, persistent=False)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = GGUFWeight(self.blocks, self.qtype).dequantize_rows(ids.reshape(-1).cpu())
        return rows.reshape(*ids.shape, self.embedding_dim).to(device=ids.device, dtype=self.dtype)
