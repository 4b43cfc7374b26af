"""The interface between a model's attention layers and the KV cache that stores their keys/values."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """What one forward step holds, independent of how the cache is laid out.

    The step's tokens are flattened across sequences: sequence ``i`` contributes
    ``query_lens[i]`` new tokens, appended after the ``context_lens[i]`` tokens it already
    has in the cache. Backends that need more (block tables, slot mappings) subclass this.
    """

    seq_ids: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    # Per layer, how many positions a query sees (its own included; sliding-window layers), or None for
    # the whole context; () means every layer sees everything (``ModelConfig.layer_windows``).
    layer_windows: tuple[int | None, ...] = field(default=(), kw_only=True)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def __post_init__(self) -> None:
        if not len(self.seq_ids) == len(self.query_lens) == len(self.context_lens):
            raise ValueError(
                f"metadata lists differ in length: {len(self.seq_ids)} seq_ids, "
                f"{len(self.query_lens)} query_lens, {len(self.context_lens)} context_lens"
            )


class AttentionBackend(ABC):
    """Stores a layer's new keys/values and attends the step's queries over the sequence's cache."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Causal attention for the step's tokens.

        q (N, H, D), k and v (N, Hkv, D), already rotated; returns (N, H, D). N is
        ``metadata.num_tokens``; the keys/values are written to the cache before attending.
        """

    def observe_input(
        self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> None:
        """Sees ``layer``'s attention input x (N, hidden) and the step's rotary tables before the layer runs.

        A no-op by default; an offloading cache uses it to start fetching the next layer's KV (InfiniGen
        predicts what that layer will read from this input)."""
        return None

    def surviving_rows(self, layer: int, metadata: AttentionMetadata) -> torch.Tensor | None:
        """Rows of ``layer``'s input that go on to the next layer, (N',) long ascending, after its
        ``forward``; None (the default) means every row. A cache that drops tokens during prefill
        (PyramidInfer) drops them from the hidden states too, so deeper layers compute fewer rows."""
        return None
