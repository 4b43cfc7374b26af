"""One rank's share of a model's weights under Megatron-style tensor parallelism (the vLLM paper, sec. 4.6).

Per layer, rank ``r`` of ``size`` holds:
- q/k/v rows of its attention heads (column parallel): query heads ``r*H/size ..``, and the KV heads those
  read. With more ranks than KV heads each KV head is replicated on ``size / Hkv`` ranks, as vLLM does;
- the matching input columns of o_proj (row parallel: partial sums, all-reduced by ``parallel/tensor_model.py``);
- its share of gate/up rows (column parallel) and the matching down_proj columns (row parallel); in a sparse
  (mixture-of-experts) layer, that share of every expert's and of the shared expert's intermediate dimension,
  with the router and the shared expert's gate replicated (``models/moe.py``): every rank routes alike, and the
  block's output is one partial sum.
A checkpoint storing q/k/v or gate/up fused (Phi-3) gives each rank its rows of every part, fused in the same order.
The embedding and LM head are replicated: the LM head runs on rank 0 only, so no logits are gathered. Its
cost is measured by ``kvserve bench tensor-parallel`` (SmolLM2: 13-16 ms of a 77 ms float32 decode step;
Gemma 3 270M, 262k vocabulary: about half of its step), the figure a vocabulary-parallel head would split.

This file only slices tensors; it knows nothing of processes (only ``parallel/`` imports torch.distributed).
Checkpoint tensors are sliced before they are fused, quantised or packed, so every weight form (float,
GGUF int4 codes, their dense copies) shards the same way.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kvserve.errors import UnsupportedModelError
from kvserve.models.config import ModelConfig
from kvserve.models.moe import checkpoint_names
from kvserve.models.quant_linear import GROUP_SIZE, Int4Weight

_LAYER_TENSOR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)$")
# An expert's matrix (``experts.{e}.``, or all experts stacked: ``experts.``) or the shared expert's.
_EXPERT_TENSOR = re.compile(r"model\.layers\.\d+\.\w+\.(experts(?:\.\d+)?|shared_expert)\.(\w+)\.weight$")


@dataclass(frozen=True)
class TensorShard:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")

    def span(self, total: int) -> slice:
        """This rank's equal share of ``total`` items (``total`` divisible by ``size``)."""
        share = total // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def kv_heads(self, num_kv_heads: int) -> slice:
        """The KV heads this rank holds: its share, or the one head it replicates when ranks outnumber them."""
        if num_kv_heads >= self.size:
            return self.span(num_kv_heads)
        head = self.rank // (self.size // num_kv_heads)
        return slice(head, head + 1)


def check_shardable(config: ModelConfig, size: int, int4: bool = False) -> None:
    """Raise, naming the dimension, when ``config`` cannot run over ``size`` ranks. ``int4``: the weights are
    4-bit codes in groups of 32 inputs, which a row-parallel projection must not split."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    rules = (
        ("num_heads (query heads)", config.num_heads, config.num_heads % size == 0),
        ("num_kv_heads", config.num_kv_heads,
         config.num_kv_heads % size == 0 or size % config.num_kv_heads == 0),
        ("intermediate_size (MLP)", config.intermediate_size, config.intermediate_size % size == 0),
        ("moe_intermediate_size (experts)", config.moe_intermediate_size, config.moe_intermediate_size % size == 0),
        ("shared_expert_intermediate_size", config.shared_expert_intermediate_size,
         config.shared_expert_intermediate_size % size == 0),
    )  # fmt: skip
    for name, value, ok in rules:
        if not ok:
            relation = "a multiple or a divisor of" if name == "num_kv_heads" else "divisible by"
            raise UnsupportedModelError(
                f"tensor_parallel_size={size} does not divide the model: {name}={value} must be {relation} {size}"
            )
    if not int4:
        return
    row_parallel = (
        ("o_proj inputs", config.q_size // size),
        ("down_proj inputs", config.intermediate_size // size),
        ("shared expert down_proj inputs", config.shared_expert_intermediate_size // size),
    )
    for name, columns in row_parallel:
        if columns % GROUP_SIZE:
            raise UnsupportedModelError(
                f"tensor_parallel_size={size} splits the 4-bit {name} into {columns} columns per rank, not a "
                f"multiple of the quantisation group ({GROUP_SIZE}); use another size or weights='dequant'"
            )


def shard_config(config: ModelConfig, shard: TensorShard) -> ModelConfig:
    """The architecture one rank computes: its heads and its share of the MLP (head_dim and hidden unchanged)."""
    kv = shard.kv_heads(config.num_kv_heads)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // shard.size,
        num_kv_heads=kv.stop - kv.start,
        intermediate_size=config.intermediate_size // shard.size,
        moe_intermediate_size=config.moe_intermediate_size // shard.size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // shard.size,
    )


Source = Callable[[], object]


def shard_sources(config: ModelConfig, sources: Mapping[str, Source], shard: TensorShard) -> dict[str, Source]:
    """``sources`` (Hugging Face name -> loader of a float tensor or an ``Int4Weight``) with every per-layer
    projection tensor replaced by a loader of this rank's slice; everything else passes through."""
    return {name: _sliced(config, name, get, shard) for name, get in sources.items()}


def _sliced(config: ModelConfig, name: str, get: Source, shard: TensorShard) -> Source:
    expert = _EXPERT_TENSOR.search(name) if config.sparse_layers else None
    if expert is not None:
        return _expert_slice(config, expert[1], expert[2], get, shard)
    match = _LAYER_TENSOR.search(name)
    if match is None:
        return get
    _, proj, kind = match.groups()
    d = config.head_dim
    rows: slice | list[slice] | None = None
    if proj == "q":
        rows = _scaled(shard.span(config.num_heads), d)
    elif proj in ("k", "v"):
        rows = _scaled(shard.kv_heads(config.num_kv_heads), d)
    elif proj in ("gate", "up"):
        rows = shard.span(config.intermediate_size)
    elif proj == "qkv":  # stored fused (Phi-3): this rank's rows of each part, fused again
        kv = _scaled(shard.kv_heads(config.num_kv_heads), d)
        q_rows = _scaled(shard.span(config.num_heads), d)
        rows = [q_rows, _shifted(kv, config.q_size), _shifted(kv, config.q_size + config.kv_size)]
    elif proj == "gate_up":
        gate = shard.span(config.intermediate_size)
        rows = [gate, _shifted(gate, config.intermediate_size)]
    elif kind == "bias":  # o_proj / down_proj bias: added once, by rank 0, to the reduced sum
        return get if shard.rank == 0 else lambda: torch.zeros_like(_tensor(get()))
    if rows is not None:
        return lambda: _take(get(), rows, columns=False)
    columns = shard.span(config.q_size if proj == "o" else config.intermediate_size)
    return lambda: _take(get(), columns, columns=True)


def _expert_slice(config: ModelConfig, owner: str, proj: str, get: Source, shard: TensorShard) -> Source:
    """This rank's share of an expert's (or the stacked experts', or the shared expert's) intermediate dimension:
    gate and up rows, down columns."""
    if owner == "shared_expert":
        size, down = config.shared_expert_intermediate_size, proj == "down_proj"
    else:
        size, down = config.moe_intermediate_size, proj == checkpoint_names(config.architecture)[1][2]
    part = shard.span(size)
    return lambda: _take(get(), part, columns=down)


def _scaled(heads: slice, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def _shifted(rows: slice, offset: int) -> slice:
    return slice(rows.start + offset, rows.stop + offset)


def _take(weight: object, part: slice | list[slice], columns: bool) -> object:
    """Rows (or input columns) ``part`` of a float tensor (out, in) or a bias (out,), or of an ``Int4Weight``;
    rows given as several slices are concatenated in order."""
    if isinstance(part, list):
        pieces = [_take(weight, p, columns=False) for p in part]
        if isinstance(weight, Int4Weight):
            return Int4Weight.cat(pieces)
        return torch.cat(pieces)
    if isinstance(weight, Int4Weight):
        if not columns:
            return weight.map_rows(lambda t: t[part].contiguous())
        groups = slice(part.start // GROUP_SIZE, part.stop // GROUP_SIZE)
        parts = (weight.codes[:, part], weight.scale[:, groups], weight.offset[:, groups])
        return Int4Weight(*(t.contiguous() for t in parts))
    tensor = _tensor(weight)
    if tensor.dim() == 3:  # stacked experts (E, out, in)
        return (tensor[:, :, part] if columns else tensor[:, part]).contiguous()
    return (tensor[:, part] if columns else tensor[part]).contiguous()


def _tensor(value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(value).__name__}")
    return value
