"""Which imported module tokens selective recompute may rewrite, and which module blocks stay shared (plain data).

CacheBlend (Yao et al., EuroSys'25, https://arxiv.org/abs/2405.16444): modules encoded alone miss attention to
each other; recomputing the few tokens whose KV deviates most once they are put together recovers most of it.
A token needs no recompute when every token at an earlier position is its own module's or one it was encoded
after (its *context*: the schema's prefix, ``PromptCache``'s module context): it attends to what it attended to
when encoded (the first segment; a module right after the prefix it was encoded behind). Every other module
token is a *candidate*; the runner picks ``count`` of them by deviation (``attention/blend.py``).

The runner measures deviation at layer 1, after layer 0. When layer 0 is a sliding-window layer, a candidate whose
window holds no other module's token gets layer 1's keys and values exactly as encoded: its deviation is zero, and
it can only be chosen after every candidate that deviates. The plan names the others (the *probe*), so the
selection pass runs only them through layer 0 (Gemma 3: the first window of each module, not the whole prompt).

The request rewrites its own copy of the blocks holding candidates: only the leading full blocks before the
first candidate stay shared with the module store; the others are copied slot by slot like module tails.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RecomputePlan:
    candidates: tuple[int, ...]  # token indices (sequence order) that may be recomputed, ascending
    count: int  # how many of them the runner recomputes
    num_shared: int  # leading full blocks still shared (they hold no candidate)
    probe: tuple[int, ...] = ()  # the candidates whose layer-1 KV can deviate (all of them without a probe window)


def plan_recompute(
    owners: list[int], positions: list[int], num_full_blocks: int, block_size: int, share: float,
    contexts: Sequence[Collection[int]] = (), probe_window: int | None = None,
) -> RecomputePlan:  # fmt: skip
    """``owners[i]``, ``positions[i]``: module and position of imported token i (sequence order);
    ``num_full_blocks``: the shared full blocks the tokens start with; ``share``: of the candidates, in (0, 1];
    ``contexts[m]``: the positions module m was encoded after (none if absent); ``probe_window``: layer 0's
    sliding window, if it has one."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"recompute share must be in (0, 1], got {share!r}")
    foreign = _last_foreign(owners, positions, contexts)
    candidates = tuple(i for i, last in enumerate(foreign) if last is not None)
    if not candidates:
        return RecomputePlan((), 0, num_full_blocks)
    count = min(len(candidates), math.ceil(share * len(candidates)))
    probe = candidates
    if probe_window is not None:  # a foreign token within the window: the window is [p - w + 1, p]
        probe = tuple(i for i in candidates if foreign[i] > positions[i] - probe_window)
    return RecomputePlan(candidates, count, min(num_full_blocks, candidates[0] // block_size), probe)


def _last_foreign(owners: list[int], positions: list[int], contexts: Sequence[Collection[int]]) -> list[int | None]:
    """Per token, the last earlier position held by another module's token outside the token's module's context
    (None: there is none, so the token attends to what it was encoded with). Array passes per module: a schema of
    many modules and long prompts stays cheap."""
    owner_of, position_of = np.asarray(owners), np.asarray(positions)
    last = np.full(len(owners), -1, dtype=np.int64)
    for owner in np.unique(owner_of):
        own = owner_of == owner
        context = np.asarray(list(contexts[owner]) if owner < len(contexts) else [], dtype=position_of.dtype)
        foreign = np.sort(position_of[~own & ~np.isin(position_of, context)])
        earlier = np.searchsorted(foreign, position_of[own])  # foreign positions before each own token
        last[own] = np.where(earlier > 0, foreign[np.maximum(earlier - 1, 0)] if len(foreign) else -1, -1)
    return [int(p) if p >= 0 else None for p in last]
