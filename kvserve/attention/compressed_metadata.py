"""A compressing cache's step metadata, the step state its layers fill in beside it, and what the cache's parts
(``compaction.py``, ``compressed_prefill.py``, ``compressed_decode.py``) read of the cache (``compressed.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvserve.attention.backend import AttentionMetadata, InPlaceDecode
from kvserve.kv.tiers import TierStore
from kvserve.policies.base import KVPolicy


@dataclass
class CompressedStep:
    """What changes while the layers run: rows still live per sequence, slots each group keeps. The cache makes one
    beside each step's metadata (``build_metadata``); ``report`` turns it into a ``StepReport``."""

    rows: list[int]  # per sequence: its rows in the current hidden states
    held_after: list[list[int]]  # per sequence, per layer: slots held after the step
    heads_after: list[list[tuple[int, ...]]]  # per sequence, per layer: tokens per KV head packed (Ada-KV), or ()
    survivors: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> rows going on
    in_place: InPlaceDecode | None = None  # the step's layers run as one call: what in_place_decode gave them


@dataclass(frozen=True)
class CompressedAttentionMetadata(AttentionMetadata):
    """Per sequence: its policy, and per layer its block table, held slots and target after the step."""

    policies: tuple[KVPolicy, ...] = ()
    group_slots: tuple[tuple[int, ...], ...] = ()  # [seq][layer] slots holding keys before the step
    group_targets: tuple[tuple[int, ...], ...] = ()  # [seq][layer] most slots kept after the step
    group_frozen: tuple[tuple[int, ...], ...] = ()  # [seq][layer] leading slots in shared module blocks, or ()
    group_heads: tuple[tuple[tuple[int, ...], ...], ...] = ()  # [seq][layer] tokens per KV head packed, or ()
    block_tables: tuple[tuple[tuple[int, ...], ...], ...] = ()  # [seq][layer] block ids
    keep_all_rows: tuple[bool, ...] = ()  # [seq] every row's logits are needed: drop no rows
    block_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        n = len(self.seq_ids)
        for name in ("policies", "group_slots", "group_targets", "block_tables", "keep_all_rows"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} sequences")

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class CompressedSlab(Protocol):
    """What the compressed cache's parts read of it."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    softcap: float
    layer_windows: tuple[int | None, ...]
    k: torch.Tensor  # (1, num_blocks, block_size, Hkv, D)
    v: torch.Tensor
    scores: torch.Tensor  # (slots,) float32: each slot's score
    tier: TierStore | None  # the slower tier the slab lives in, or None (the device)
    rank_mean: Callable[[torch.Tensor], torch.Tensor] | None
    step: CompressedStep | None
    # The cache's other parts (they take this protocol themselves, so they are not named here).
    compaction: Any  # Compaction (compaction.py)
    prefill: Any  # CompressedPrefill (compressed_prefill.py)

    @property
    def windowed(self) -> bool: ...

    def check_metadata(self, metadata: AttentionMetadata) -> CompressedAttentionMetadata: ...

    def read(self, index: torch.Tensor, blocks: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def slot_ids(self, table: tuple[int, ...], begin: int, end: int, device: torch.device) -> torch.Tensor: ...
