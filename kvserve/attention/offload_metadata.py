"""An offloaded cache's step metadata, and what the cache's chunk path reads of the cache (``offloaded.py`` holds
the cache, ``offload_chunk.py`` the chunk path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.offload_fetch import TierTransfers
from kvserve.policies.base import OffloadState


@dataclass(frozen=True)
class OffloadAttentionMetadata(AttentionMetadata):
    """Per sequence: its block table and the KV it may reach (prompt + max_tokens, for the pool limit). The step's
    plan and its fetches in flight are the cache's ``OffloadStep`` for it, made beside it (``build_metadata``)."""

    block_tables: tuple[tuple[int, ...], ...] = ()
    full_lengths: tuple[int, ...] = ()
    # Per sequence: the first row of its chunk that is a scored continuation token (prompt logprobs, how the
    # eval tools score): from there on a row reads what decoding it would. Prompt rows before it attend to
    # everything before them, as InfiniGen's prefill does. () or the chunk length: a plain prompt chunk.
    scored_from: tuple[int, ...] = ()
    block_size: int = 16


class OffloadPool(Protocol):
    """What the offloaded cache's parts read of it."""

    device: torch.device
    softcap: float
    num_kv_heads: int
    transfers: TierTransfers
    speculation: OffloadState | None  # the policy's offload state (InfiniGen's speculation and pool)

    def capacity(self, meta: OffloadAttentionMetadata, i: int) -> int: ...

    def speculates(self, layer: int) -> bool: ...

    def window(self, layer: int) -> int | None: ...

    def slots(self, table: tuple[int, ...], end: int, begin: int = 0) -> torch.Tensor: ...

    def write_slots(
        self, layer: int, meta: OffloadAttentionMetadata, i: int, token: int, m: int = 1
    ) -> torch.Tensor: ...

    def store(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor
    ) -> None: ...

    def count(self, layer: int, fetched: int, cached: int) -> None: ...
