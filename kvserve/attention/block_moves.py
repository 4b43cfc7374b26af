"""Whole blocks copied between two paged caches (a swap to or from the host tier), in every layer, K and V; and
single token slots read and written across every layer (Prompt Cache modules' host copies)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvserve.attention.kv_quant import KVQuant


class BlockPool(Protocol):
    """What a block copy reads of a paged cache: its block count and its (L, blocks, block_size, Hkv, D) K and V
    (D: a quantized cache's row bytes), and what makes two caches' blocks interchangeable."""

    num_blocks: int
    k: torch.Tensor
    v: torch.Tensor
    layer_rows: tuple[int, ...]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_quant: KVQuant | None


def check_peers(a: BlockPool, b: BlockPool) -> None:
    """A ValueError unless blocks of ``a`` and ``b`` hold the same layers, tokens and heads in the same format."""

    def shape(pool: BlockPool) -> tuple:
        fmt = pool.kv_quant.name if pool.kv_quant is not None else "values"
        return (pool.layer_rows, pool.block_size, pool.num_kv_heads, pool.head_dim, pool.k.dtype, fmt)

    if shape(a) != shape(b):
        raise ValueError(
            f"caches differ in (layer rows, block_size, kv_heads, head_dim, dtype, format): {shape(a)} against "
            f"{shape(b)}"
        )


def check_pairs(pairs: Sequence[tuple[int, int]], num_src: int, num_dst: int) -> tuple[list[int], list[int]]:
    src = [int(s) for s, _ in pairs]
    dst = [int(d) for _, d in pairs]
    out_of_range = [(s, d) for s, d in zip(src, dst, strict=True) if not (0 <= s < num_src and 0 <= d < num_dst)]
    if out_of_range:
        raise ValueError(f"block pairs {out_of_range} are out of range ({num_src} source, {num_dst} target blocks)")
    if len(set(dst)) != len(dst):
        raise ValueError(f"a target block appears twice in {list(pairs)}")
    return src, dst


def transfer(src: BlockPool, dst: BlockPool, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy whole blocks (src block, dst block) in every layer, K and V, between two caches."""
    if not pairs:
        return
    src_ids, dst_ids = check_pairs(pairs, src.num_blocks, dst.num_blocks)
    src_dev, dst_dev = src.k.device, dst.k.device
    src_t = torch.tensor(src_ids, dtype=torch.long, device=src_dev)
    dst_t = torch.tensor(dst_ids, dtype=torch.long, device=dst_dev)
    for s, d in ((src.k, dst.k), (src.v, dst.v)):
        if src_dev == dst_dev:
            d.index_copy_(1, dst_t, s.index_select(1, src_t))
        elif dst_dev.type != "cpu":  # host -> device: gather into pinned memory, one async upload
            staged = torch.empty((s.shape[0], len(src_ids), *s.shape[2:]), dtype=s.dtype, pin_memory=True)
            torch.index_select(s, 1, src_t, out=staged)  # (L, n, block_size, Hkv, D)
            d.index_copy_(1, dst_t, staged.to(dst_dev, non_blocking=True))
        else:  # device -> host: gather on the device, then contiguous async copies per layer and run
            staged = s.index_select(1, src_t)  # (L, n, block_size, Hkv, D) on the device
            for first, start, count in runs(dst_ids):
                for layer in range(s.shape[0]):
                    d[layer, start : start + count].copy_(staged[layer, first : first + count], non_blocking=True)


def runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive runs in ``ids`` as (index of its first entry, first id, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if runs and block == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, block, 1))
    return runs


def read_slots(pool: BlockPool, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``slots`` in every layer, each (L, n, Hkv, D), as new tensors; a quantized cache's rows as
    they are stored, (L, n, Hkv, row_bytes) uint8 (``write_slots`` takes them back)."""
    index, shape = _slot_index(pool, slots)
    return pool.k.view(shape).index_select(1, index), pool.v.view(shape).index_select(1, index)


def write_slots(pool: BlockPool, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write (L, n, Hkv, D) keys and values (a quantized cache: its stored rows, from ``read_slots``) into ``slots``
    of every layer."""
    if pool.kv_quant is not None and (k.dtype, v.dtype) != (torch.uint8, torch.uint8):
        raise ValueError(f"a {pool.kv_quant.name} cache writes slots from its own rows (read_slots), got {k.dtype}")
    index, shape = _slot_index(pool, slots)
    pool.k.view(shape).index_copy_(1, index, k.to(pool.k.device, pool.k.dtype, non_blocking=True))
    pool.v.view(shape).index_copy_(1, index, v.to(pool.v.device, pool.v.dtype, non_blocking=True))


def _slot_index(pool: BlockPool, slots: Sequence[int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    if pool.layer_rows != tuple(range(pool.num_layers)):
        raise ValueError("slots name one token of every layer only when each layer has a block row of its own")
    index = torch.tensor(list(slots), dtype=torch.long, device=pool.k.device)
    return index, (pool.num_layers, pool.num_blocks * pool.block_size, pool.num_kv_heads, pool.k.shape[-1])
