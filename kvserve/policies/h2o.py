"""Heavy-hitter oracle: H2O (Zhang et al., NeurIPS'23, https://arxiv.org/abs/2306.14048).

Every token's score is the attention it has received, summed over all queries so far (the prompt's
during prefill, then each decoded token's). A layer keeps the most recent half of its budget and
fills the other half with the highest-scoring older tokens; eviction runs while decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.base import SCORES_ACCUMULATED, KVPolicy, recent_and_top


@dataclass(frozen=True)
class HeavyHitters(KVPolicy):
    recent_ratio: float = 0.5  # share of a layer's budget given to the most recent tokens

    name = "h2o"
    scores = SCORES_ACCUMULATED

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.recent_ratio <= 1:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio!r}")

    def votes(self, num_queries: int, num_tokens: int) -> tuple[int, torch.Tensor]:
        """Every query of the chunk, equally (added to the cached slots' scores)."""
        return 0, torch.ones(num_queries, dtype=torch.float32)

    def select(self, scores: torch.Tensor | None, num_candidates: int, keep: int, num_tokens: int) -> torch.Tensor:
        return recent_and_top(scores, num_candidates, keep, round(self.recent_ratio * keep))
