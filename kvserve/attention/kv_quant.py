"""A quantized KV cache's rows: 8-bit or 4-bit codes with their scales in one byte row per (token, KV head).

Each (token, KV head) row of D values becomes one row of bytes, its scales after its codes, so a block of the
paged pool stays one (block_size, Hkv, row_bytes) uint8 run: copied, swapped, shared and hashed as one unit,
like llama.cpp's ``q8_0``/``q4_0`` blocks (codes and their fp16 scale side by side).

- ``int8``: D signed codes, then the row's scale (float16): value = code * scale, scale = max |x| / 127.
  D + 2 bytes a row (bfloat16: 2 D).
- ``int4``: D / 2 bytes of unsigned 4-bit codes (element 2j in byte j's low nibble, 2j + 1 in its high
  nibble), then the row's scale and minimum (float16 each): value = code * scale + minimum. D / 2 + 4 bytes.

One scale per row and not per group of the head dimension: with the rotation below the row's values are
spread evenly, and a group-32 int4 row would cost D / 2 + 4 D / 32 bytes (40 for D = 64: 3.2x against
bfloat16 instead of 3.6x).

**Rotation** (QuaRot, https://arxiv.org/abs/2404.00456; llama.cpp rotates quantized KV the same way): keys
and values are multiplied by an orthonormal Hadamard matrix H before they are quantized, queries by H before
they meet the keys (q . k = Hq . Hk), and the attention output by H again (H = H^T = H^-1; the output is a
weighted sum of H v). A key's few large channels (the ones RoPE and the model's outliers put there) are then
spread over all D channels, so one scale per row loses little. For a D that is not a power of two, H is
block-diagonal with the largest power-of-two block that divides D.

The attention kernels read these rows in place (``csrc/paged_decode_quant.cpp``); ``dequantize`` is the torch
reference and what a prefill reads a sequence's context through.
"""

from __future__ import annotations

import functools

import torch

KV_QUANT_BITS = {"int8": 8, "int4": 4}


class KVQuant:
    """The row format of an ``int8`` or ``int4`` KV cache for heads of ``head_dim`` values."""

    def __init__(self, name: str, head_dim: int, rotate: bool = True) -> None:
        if name not in KV_QUANT_BITS:
            raise ValueError(f"a quantized KV cache is one of {list(KV_QUANT_BITS)}, got {name!r}")
        self.name, self.bits, self.head_dim, self.rotate = name, KV_QUANT_BITS[name], head_dim, rotate
        if self.bits == 4 and head_dim % 2:
            raise ValueError(f"int4 KV packs two values a byte; head_dim {head_dim} is odd")
        self.row_bytes = head_dim + 2 if self.bits == 8 else head_dim // 2 + 4

    def __repr__(self) -> str:
        return f"KVQuant({self.name!r}, head_dim={self.head_dim}, rotate={self.rotate})"

    # ----- rotation -----

    def rotated(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) times H, in float32 (queries, keys and values before they meet the cache, and the output
        after); x itself as float32 when the format does not rotate."""
        if not self.rotate:
            return x.float()
        return torch.matmul(x.float(), hadamard(self.head_dim, str(x.device)))

    # ----- rows -----

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) float -> (..., row_bytes) uint8 rows."""
        x = x.float()
        if self.bits == 8:
            scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-6) / 127
            scale = scale.half().float()  # the scale as stored: codes are rounded against it
            codes = (x / scale).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
            return torch.cat((codes, _half_bytes(scale)), dim=-1)
        low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
        scale = ((high - low).clamp_(min=1e-6) / 15).half().float()
        low = low.half().float()
        codes = ((x - low) / scale).round_().clamp_(0, 15).to(torch.uint8)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return torch.cat((packed, _half_bytes(scale), _half_bytes(low)), dim=-1)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(..., row_bytes) uint8 rows -> (..., D) values in ``dtype`` (still rotated)."""
        if rows.shape[-1] != self.row_bytes:
            got = tuple(rows.shape)
            raise ValueError(f"{self.name} rows of head_dim {self.head_dim} are {self.row_bytes} bytes, got {got}")
        d = self.head_dim
        if self.bits == 8:
            codes = rows[..., :d].contiguous().view(torch.int8).float()
            return (codes * _half_of(rows[..., d : d + 2])).to(dtype)
        packed = rows[..., : d // 2]
        codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float()  # (..., D)
        scale, low = _half_of(rows[..., d // 2 : d // 2 + 2]), _half_of(rows[..., d // 2 + 2 : d // 2 + 4])
        return (codes * scale + low).to(dtype)


def widen(rows: torch.Tensor, dtype: torch.dtype, quant: KVQuant | None) -> torch.Tensor:
    """Cache rows as values in ``dtype``: dequantised when the cache is quantized, else cast."""
    return quant.dequantize(rows, dtype) if quant is not None else rows.to(dtype)


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """(..., 1) float -> (..., 2) uint8: its float16 bytes."""
    return x.half().contiguous().view(torch.uint8)


def _half_of(raw: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 float16 bytes -> (..., 1) float32."""
    return raw.contiguous().view(torch.float16).float()


@functools.lru_cache(maxsize=16)
def hadamard(dim: int, device: str = "cpu") -> torch.Tensor:
    """The (dim, dim) orthonormal, symmetric Hadamard matrix (Sylvester's construction), block-diagonal with the
    largest power-of-two block dividing ``dim`` when ``dim`` is not a power of two. float32."""
    block = dim & -dim  # the largest power of two that divides dim
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h = h / block**0.5
    return torch.block_diag(*[h] * (dim // block)).to(device)
