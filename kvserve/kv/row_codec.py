"""How a KV row is held in a slower tier: as it is, or as INT4 codes and their scales.

A codec names the per-slot arrays a tier holds (``RowSpec``s), turns a step's keys/values into them on the way
down, and turns fetched arrays back into keys/values on the device. An offloading cache asks its policy for one
(``KVPolicy.row_codec``); every tier transfer goes through it, so there is one place that packs 4-bit rows.

INT4 (the FlexGen/KIVI-style baseline InfiniGen compares against, https://arxiv.org/abs/2303.06865): every
(token, KV head) row of D values is split into groups of ``group_size``; each group keeps a scale and a minimum
(in the model dtype) and 4-bit codes, two per byte. With D = 64 and one group per row a row moves 36 bytes
instead of 128 (bfloat16).
"""

from __future__ import annotations

import torch

from kvserve.kv.tiers import RowSpec


class PlainRows:
    """Keys and values as they are: arrays ``k`` and ``v`` of (Hkv, D) rows in the cache's dtype."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype

    def specs(self) -> dict[str, RowSpec]:
        row = RowSpec((self.num_kv_heads, self.head_dim), self.dtype)
        return {"k": row, "v": row}

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"k": k, "v": v}

    def decode(self, fetched: dict[str, torch.Tensor], shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The fetched arrays as keys and values of ``shape`` (..., Hkv, D)."""
        return fetched["k"].view(shape), fetched["v"].view(shape)


class Int4Rows(PlainRows):
    """Keys and values as 4-bit codes (``k``, ``v``: (Hkv, D / 2) uint8) and per-group (scale, minimum)
    (``k_scale``, ``v_scale``: (Hkv, D / g, 2) in the cache's dtype); dequantised on the device once fetched."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, group_size: int) -> None:
        super().__init__(num_kv_heads, head_dim, dtype)
        self.group_size = group_size

    def specs(self) -> dict[str, RowSpec]:
        codes = RowSpec((self.num_kv_heads, self.head_dim // 2), torch.uint8)
        scales = RowSpec((self.num_kv_heads, self.head_dim // self.group_size, 2), self.dtype)
        return {"k": codes, "k_scale": scales, "v": codes, "v_scale": scales}

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        (kc, ks), (vc, vs) = quantize_int4(k, self.group_size), quantize_int4(v, self.group_size)
        return {"k": kc, "k_scale": ks, "v": vc, "v_scale": vs}

    def decode(self, fetched: dict[str, torch.Tensor], shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        codes = shape[:-1] + (self.head_dim // 2,)
        scales = shape[:-1] + (self.head_dim // self.group_size, 2)
        k = dequantize_int4(fetched["k"].view(codes), fetched["k_scale"].view(scales), self.dtype)
        v = dequantize_int4(fetched["v"].view(codes), fetched["v_scale"].view(scales), self.dtype)
        return k, v


def quantize_int4(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> codes (..., D / 2) uint8 (two per byte, low nibble first) and scales (..., D / g, 2)
    holding each group's (scale, minimum) in x's dtype."""
    groups = x.float().unflatten(-1, (-1, group_size))  # (..., D / g, g)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scale = (high - low).clamp(min=1e-8) / 15
    codes = ((groups - low) / scale).round_().clamp_(0, 15).to(torch.uint8).flatten(-2)  # (..., D)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, torch.cat((scale, low), dim=-1).to(x.dtype)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_int4``: (..., D / 2) codes and (..., D / g, 2) scales -> (..., D) ``dtype``."""
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)  # (..., D)
    groups = codes.unflatten(-1, (scales.shape[-2], -1)).to(scales.dtype)  # (..., D / g, g)
    return (groups * scales[..., :1] + scales[..., 1:]).flatten(-2).to(dtype)
