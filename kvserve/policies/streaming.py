"""Local window with attention sinks: StreamingLLM (Xiao et al., ICLR'24, https://arxiv.org/abs/2309.17453).

Each layer keeps the first ``num_sinks`` tokens (which absorb attention mass whatever their content)
and the most recent ones: PyramidInfer's "local" baseline, at the same budget in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.base import KVPolicy


@dataclass(frozen=True)
class LocalWindow(KVPolicy):
    num_sinks: int = 4

    name = "local"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.num_sinks, int) or not 0 <= self.num_sinks < self.min_tokens:
            raise ValueError(
                f"num_sinks must be an integer in [0, min_tokens={self.min_tokens}), got {self.num_sinks!r}"
            )

    def select(self, scores: torch.Tensor | None, num_candidates: int, keep: int, num_tokens: int) -> torch.Tensor:
        sinks = min(self.num_sinks, keep)
        return torch.cat((torch.arange(sinks), torch.arange(num_candidates - (keep - sinks), num_candidates)))
