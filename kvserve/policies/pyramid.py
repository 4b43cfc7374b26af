"""PyramidInfer (Yang et al., ACL'24 Findings, https://arxiv.org/abs/2405.12532).

Deeper layers keep fewer *pivotal context* tokens (PvCs). At each layer the most recent tokens S_r
vote: their attention over the older tokens, averaged over heads and over S_r with more weight on more
recent queries (the ensemble), ranks the older tokens; the layer keeps S_r, the attention sinks and the
top-ranked older tokens. This runs during prefill, layer by layer, and the tokens a layer drops also
leave the hidden states, so deeper layers compute fewer tokens (``drops_rows``). While decoding, scores
are an exponential moving average of each new token's attention and a layer re-selects when it
outgrows its budget by a block.

The schedule follows the authors' implementation (github.com/mutonix/pyramidinfer): the older part of
the sequence shrinks layer by layer by a factor r_l = (1 - d) (cos(pi l / L) + 1) / 2 + d, so
shallow layers lose little and deep ones more (at a 60% budget the first half of the layers loses
about 7%); S_r is never dropped. Layer l keeps a fraction rho + (1 - rho) prod_{j<=l} r_j of the
sequence, rho = |S_r| / length, with d solved so that the mean over layers is ``budget``.
``layer_retention`` sets the fractions explicitly instead; ``layer_schedule="pyramidkv"`` uses PyramidKV's
linear schedule (``policies/layer_schedule.py``) and ``"uniform"`` the same budget in every layer.

Choices where the paper leaves room:
- rho is ``recent_ratio`` (40% by default, the paper's best trade-off) but at most 80% of the budget,
  so that low budgets still keep PvCs;
- the first ``num_sinks`` tokens are always kept, as in the authors' code;
- ensemble weights grow linearly from 1 (oldest query of S_r) to ``distance_weight`` (newest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from kvserve.policies.base import SCORES_RECENT, KVPolicy
from kvserve.policies.layer_schedule import check_layer_schedule, pyramidkv_schedule

MAX_RECENT_SHARE_OF_BUDGET = 0.8


@dataclass(frozen=True)
class PyramidInfer(KVPolicy):
    recent_ratio: float = 0.4
    num_sinks: int = 4
    distance_weight: float = 1.2
    layer_retention: tuple[float, ...] | None = None  # explicit per-layer fractions (overrides budget)
    layer_schedule: str = "pyramidinfer"  # pyramidinfer | pyramidkv | uniform (without layer_retention)
    decode_decay: float = 0.9  # weight of the old scores at each decode step
    drops_rows: bool = True  # False: every layer computes every token (an ablation; the KV is still compressed)

    name = "pyramid"
    scores = SCORES_RECENT

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.recent_ratio < 1:
            raise ValueError(f"recent_ratio must be in (0, 1), got {self.recent_ratio!r}")
        if not isinstance(self.num_sinks, int) or not 0 <= self.num_sinks < self.min_tokens:
            raise ValueError(
                f"num_sinks must be an integer in [0, min_tokens={self.min_tokens}), got {self.num_sinks!r}"
            )
        if not self.distance_weight >= 1:
            raise ValueError(f"distance_weight must be >= 1, got {self.distance_weight!r}")
        if not 0 <= self.decode_decay < 1:
            raise ValueError(f"decode_decay must be in [0, 1), got {self.decode_decay!r}")
        check_layer_schedule(self.layer_schedule)
        if self.layer_retention is not None:
            object.__setattr__(self, "layer_retention", tuple(float(r) for r in self.layer_retention))
            bad = [r for r in self.layer_retention if not 0 < r <= 1]
            if bad:
                raise ValueError(f"layer_retention fractions must be in (0, 1], got {bad}")
            grows = [
                i for i in range(1, len(self.layer_retention)) if self.layer_retention[i] > self.layer_retention[i - 1]
            ]
            if grows:
                raise ValueError(
                    f"layer_retention must not grow with depth (a deeper layer sees only the tokens shallower ones "
                    f"kept); layer {grows[0]} keeps more than layer {grows[0] - 1}"
                )

    @property
    def recent_share(self) -> float:
        """rho: the share of the sequence that is S_r, always kept."""
        return min(self.recent_ratio, MAX_RECENT_SHARE_OF_BUDGET * self.budget)

    def retention(self, num_layers: int) -> tuple[float, ...]:
        if self.layer_retention is not None:
            if len(self.layer_retention) != num_layers:
                raise ValueError(
                    f"layer_retention has {len(self.layer_retention)} entries; the model has {num_layers} layers"
                )
            return self.layer_retention
        if self.layer_schedule == "pyramidkv":
            return pyramidkv_schedule(num_layers, self.budget)
        if self.layer_schedule == "uniform":
            return super().retention(num_layers)
        return pyramid_schedule(num_layers, self.budget, self.recent_share)

    def recent_count(self, num_tokens: int) -> int:
        """|S_r| for a sequence of ``num_tokens`` tokens: the queries that vote, and the tokens always kept."""
        return max(1, math.ceil(self.recent_share * num_tokens))

    def select(self, scores: torch.Tensor | None, num_candidates: int, keep: int, num_tokens: int) -> torch.Tensor:
        sinks = min(self.num_sinks, keep)
        recent = min(self.recent_count(num_tokens), keep - sinks)
        middle = num_candidates - sinks - recent  # the older tokens competing for the PvC places
        top = torch.topk(scores[sinks : sinks + middle], keep - sinks - recent).indices.sort().values + sinks
        newest = torch.arange(num_candidates - recent, num_candidates, device=scores.device)
        return torch.cat((torch.arange(sinks, device=scores.device), top, newest))

    def votes(self, num_queries: int, num_tokens: int) -> tuple[int, torch.Tensor]:
        """S_r's ensemble: the chunk's last |S_r| queries, weighted towards the most recent (the cached slots'
        earlier scores are not carried: S_r ranks afresh)."""
        first = num_queries - min(self.recent_count(num_tokens), num_queries)
        return first, self.query_weights(num_queries - first)

    def score_update(self) -> tuple[float, float]:
        return self.decode_decay, 1 - self.decode_decay

    def query_weights(self, num_queries: int) -> torch.Tensor:
        return ensemble_weights(num_queries, self.distance_weight)


def ensemble_weights(num_queries: int, distance_weight: float = 1.2) -> torch.Tensor:
    """(num_queries,) float32 weights of S_r's queries, oldest first, rising linearly to ``distance_weight``
    times the oldest one's, summing to 1."""
    weights = torch.linspace(1.0, distance_weight, num_queries, dtype=torch.float32)
    return weights / weights.sum()


@lru_cache(maxsize=64)
def pyramid_schedule(num_layers: int, budget: float, recent_share: float) -> tuple[float, ...]:
    """Per-layer retention rho + (1 - rho) prod_{1<=j<=l} s_j^a, s_j = (cos(pi j / L) + 1) / 2, with a >= 0
    bisected so the mean is ``budget`` (layer 0 keeps everything; a = 0.1 is the authors' default shape)."""
    if budget >= 1 or num_layers == 1:
        return (1.0,) * num_layers if budget >= 1 else (budget,)
    logs = [math.log((math.cos(math.pi * layer / num_layers) + 1) / 2) for layer in range(1, num_layers)]

    def schedule(a: float) -> list[float]:
        context, out = 0.0, [1.0]
        for log in logs:
            context += a * log
            out.append(recent_share + (1 - recent_share) * math.exp(context))
        return out

    low, high = 0.0, 1.0  # the mean falls as a grows, towards rho + (1 - rho) / L
    while sum(schedule(high)) / num_layers > budget and high < 1e6:
        high *= 2
    for _ in range(80):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(schedule(mid)) / num_layers > budget else (low, mid)
    return tuple(schedule(high))
