"""PyramidInfer (Yang et al., ACL'24 Findings, https://arxiv.org/abs/2405.12532).

Deeper layers keep fewer *pivotal context* tokens (PvCs). At each layer the most recent tokens S_r
vote: their attention over the older tokens S_c, averaged over heads and over S_r with more weight on
more recent queries (the ensemble), ranks S_c; the layer keeps S_r and the top-ranked S_c. This runs
during prefill, layer by layer, and the tokens a layer drops also leave the hidden states, so deeper
layers compute fewer tokens (``drops_rows``). While decoding, scores are an exponential moving average
of each new token's attention and a layer re-selects when it outgrows its budget by a block.

Choices where the paper leaves room (written down here so measurements can be read against them):

- Retention per layer r_l = max(min_retention, 1 - c * (l / (L - 1)) ** gamma), c solved so the mean is
  ``budget``. gamma = 2.5 reproduces the paper's "reduce less" shape: at a 60% budget the first half of
  the layers loses about 7.5% and layer 0 keeps everything. ``layer_retention`` overrides it.
- S_r is ``recent_ratio`` (default 40%, the paper's best trade-off) of the tokens a layer *keeps*, not
  of the prompt, so that budgets below 40% still leave room for PvCs. At budget 1 nothing is dropped.
- Ensemble weights grow linearly with recency (query j of S_r, oldest first, weighs j + 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from kvserve.policies.base import SCORES_RECENT, KVPolicy, recent_and_top


@dataclass(frozen=True)
class PyramidInfer(KVPolicy):
    recent_ratio: float = 0.4
    gamma: float = 2.5
    min_retention: float = 0.05
    layer_retention: tuple[float, ...] | None = None  # explicit per-layer fractions (overrides budget)
    decode_decay: float = 0.9  # weight of the old scores at each decode step

    name = "pyramid"
    scores = SCORES_RECENT
    drops_rows = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.recent_ratio <= 1:
            raise ValueError(f"recent_ratio must be in (0, 1], got {self.recent_ratio!r}")
        if not 0 <= self.min_retention <= self.budget:
            raise ValueError(f"min_retention must be in [0, kv_budget={self.budget}], got {self.min_retention!r}")
        if not 0 <= self.decode_decay < 1:
            raise ValueError(f"decode_decay must be in [0, 1), got {self.decode_decay!r}")
        if self.layer_retention is not None:
            object.__setattr__(self, "layer_retention", tuple(float(r) for r in self.layer_retention))
            bad = [r for r in self.layer_retention if not 0 < r <= 1]
            if bad:
                raise ValueError(f"layer_retention fractions must be in (0, 1], got {bad}")
            increasing = [
                i for i in range(1, len(self.layer_retention)) if self.layer_retention[i] > self.layer_retention[i - 1]
            ]
            if increasing:
                raise ValueError(
                    f"layer_retention must not grow with depth (a deeper layer sees only the tokens shallower ones "
                    f"kept); layer {increasing[0]} keeps more than layer {increasing[0] - 1}"
                )

    def retention(self, num_layers: int) -> tuple[float, ...]:
        if self.layer_retention is not None:
            if len(self.layer_retention) != num_layers:
                raise ValueError(
                    f"layer_retention has {len(self.layer_retention)} entries; the model has {num_layers} layers"
                )
            return self.layer_retention
        return pyramid_schedule(num_layers, self.budget, self.gamma, self.min_retention)

    def recent_count(self, keep: int) -> int:
        """|S_r| for a layer keeping ``keep`` slots."""
        return max(1, math.ceil(self.recent_ratio * keep))

    def select(self, scores: torch.Tensor | None, num_candidates: int, keep: int) -> torch.Tensor:
        return recent_and_top(scores, num_candidates, keep, self.recent_count(keep))

    def update(self, scores: torch.Tensor, step_weights: torch.Tensor) -> torch.Tensor:
        return self.decode_decay * scores + (1 - self.decode_decay) * step_weights


def ensemble_weights(num_recent: int) -> torch.Tensor:
    """(num_recent,) float32 weights of S_r's queries, oldest first, summing to 1."""
    weights = torch.arange(1, num_recent + 1, dtype=torch.float32)
    return weights / weights.sum()


@lru_cache(maxsize=64)
def pyramid_schedule(num_layers: int, budget: float, gamma: float, min_retention: float) -> tuple[float, ...]:
    """r_l = max(min_retention, 1 - c x_l^gamma), x_l = l / (L - 1), with c bisected so mean(r) = budget."""
    if num_layers == 1 or budget >= 1:
        return (budget,) * num_layers
    x = torch.arange(num_layers, dtype=torch.float64) / (num_layers - 1)

    def schedule(c: float) -> torch.Tensor:
        return torch.clamp(1 - c * x**gamma, min=min_retention)

    low, high = 0.0, 1.0
    while schedule(high).mean() > budget:  # mean falls to min_retention as c grows, and budget >= it
        high *= 2
        if high > 1e12:
            break
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if schedule(mid).mean() > budget else (low, mid)
    return tuple(float(r) for r in schedule(high))
