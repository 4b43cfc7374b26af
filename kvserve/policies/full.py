"""The full cache: every layer keeps every token (kvserve's default, lossless)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.policies.base import KVPolicy


@dataclass(frozen=True)
class FullCache(KVPolicy):
    """Keep everything. ``budget`` must stay 1."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget != 1:
            raise ValueError(f"kv_policy='full' keeps the whole cache; kv_budget must be 1, got {self.budget}")
