"""The collectives a tensor-parallel rank's model meets in: an all-reduce after each row-parallel projection
(o_proj, down_proj; a sparse MoE block as a whole), and the mean over ranks of head-averaged attention scores
(compressing policies).

The weights themselves are sliced at load time (``models/sharding.py``); ``parallelize`` only wraps the two
row-parallel projections of every layer, so the model code stays the one-process code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class CommStats:
    """All-reduces this rank has run: count, payload bytes and seconds inside them (for ``kvserve bench``)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def snapshot(self) -> CommStats:
        return CommStats(self.calls, self.bytes, self.seconds)

    def since(self, earlier: CommStats) -> CommStats:
        return CommStats(self.calls - earlier.calls, self.bytes - earlier.bytes, self.seconds - earlier.seconds)


def all_reduce_sum(x: torch.Tensor, group: object, stats: CommStats) -> torch.Tensor:
    """Sum of ``x`` over the ranks. Half-precision partial sums are added in float32 and rounded once, as
    one process's matmul accumulates them (and gloo then needs no bfloat16 support)."""
    start = time.perf_counter()
    total = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    dist.all_reduce(total, group=group)
    stats.calls += 1
    stats.bytes += total.numel() * total.element_size()
    stats.seconds += time.perf_counter() - start
    return total.to(x.dtype) if total is not x else total


class RowParallel(nn.Module):
    """A projection over this rank's share of the input features, its partial outputs summed over the ranks."""

    def __init__(self, inner: nn.Module, group: object, stats: CommStats) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        self.stats = stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(self.inner(x), self.group, self.stats)


def parallelize(model: nn.Module, group: object, stats: CommStats) -> None:
    """Wrap every layer's o_proj and down_proj of a sharded model (``load_model(shard=...)``) in ``RowParallel``;
    a sparse MoE block as a whole (its experts' and shared expert's partial sums are added before one reduce)."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group, stats)
        if hasattr(layer.mlp, "down_proj"):
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group, stats)
        else:
            layer.mlp = RowParallel(layer.mlp, group, stats)


class RankMean:
    """Mean over the ranks of a per-slot score averaged over this rank's query heads: every rank holds as many
    query heads, so it equals the average over all heads that one process computes (``CompressedKVCache``)."""

    def __init__(self, group: object, size: int, stats: CommStats) -> None:
        self.group, self.size, self.stats = group, size, stats

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(scores.contiguous(), self.group, self.stats) / self.size
