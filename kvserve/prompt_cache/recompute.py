"""Which imported module tokens selective recompute may rewrite, and which module blocks stay shared (plain data).

CacheBlend (Yao et al., EuroSys'25, https://arxiv.org/abs/2405.16444): modules encoded alone miss attention to
each other; recomputing the few tokens whose KV deviates most once they are put together recovers most of it.
A token needs no recompute when no other module has a token at an earlier position: everything it attends to
in the assembled prompt is in its own module already, as when it was encoded (the first segment). Every other
module token is a *candidate*; the runner picks ``count`` of them by deviation (``attention/blend.py``).

The request rewrites its own copy of the blocks holding candidates: only the leading full blocks before the
first candidate stay shared with the module store; the others are copied slot by slot like module tails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RecomputePlan:
    candidates: tuple[int, ...]  # token indices (sequence order) that may be recomputed, ascending
    count: int  # how many of them the runner recomputes
    num_shared: int  # leading full blocks still shared (they hold no candidate)


def plan_recompute(
    owners: list[int], positions: list[int], num_full_blocks: int, block_size: int, share: float
) -> RecomputePlan:
    """``owners[i]``, ``positions[i]``: module and position of imported token i (sequence order);
    ``num_full_blocks``: the shared full blocks the tokens start with; ``share``: of the candidates, in (0, 1]."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"recompute share must be in (0, 1], got {share!r}")
    candidates = tuple(i for i, first in enumerate(_first_other(owners, positions)) if first < positions[i])
    if not candidates:
        return RecomputePlan((), 0, num_full_blocks)
    count = min(len(candidates), math.ceil(share * len(candidates)))
    return RecomputePlan(candidates, count, min(num_full_blocks, candidates[0] // block_size))


def _first_other(owners: list[int], positions: list[int]) -> list[float]:
    """Per token, the earliest position held by a token of another module (inf: none)."""
    first: dict[int, float] = {}
    for owner, position in zip(owners, positions, strict=True):
        first[owner] = min(first.get(owner, math.inf), position)
    return [min((p for o, p in first.items() if o != owner), default=math.inf) for owner in owners]
