"""PyramidKV's layer schedule (Cai et al. 2024, https://arxiv.org/abs/2406.02069): budgets falling linearly.

PyramidKV observes that attention funnels: lower layers spread it over the whole prompt, upper ones
concentrate it on a few tokens. So the budget falls linearly with depth, from the first layer to the last,
the last keeping ``1 / beta`` of the mean (the authors' code: ``min_num = capacity // beta``,
``max_num = 2 * capacity - min_num``). Where the first layers would keep more than everything, they keep
everything and the line is raised so the mean stays ``budget``.
"""

from __future__ import annotations

from functools import lru_cache

LAYER_SCHEDULES = ("uniform", "pyramidinfer", "pyramidkv")


def check_layer_schedule(name: object) -> None:
    """A ValueError naming ``name`` unless it is one of ``LAYER_SCHEDULES``."""
    if name not in LAYER_SCHEDULES:
        raise ValueError(f"layer_schedule must be one of {list(LAYER_SCHEDULES)}, got {name!r}")


@lru_cache(maxsize=64)
def pyramidkv_schedule(num_layers: int, budget: float, beta: float = 20.0) -> tuple[float, ...]:
    """Per-layer fractions min(1, top - (top - budget / beta) l / (L - 1)), non-increasing, with ``top`` chosen
    so that their mean is ``budget``."""
    if budget >= 1 or num_layers == 1:
        return (min(budget, 1.0),) * num_layers
    # The last layer keeps budget / beta, unless even every other layer keeping everything falls short.
    bottom = max(budget / beta, num_layers * budget - (num_layers - 1))

    def schedule(top: float) -> list[float]:
        return [min(1.0, top - (top - bottom) * layer / (num_layers - 1)) for layer in range(num_layers)]

    low, high = budget, 2 * budget - bottom  # the unclamped line's top, where the mean is budget exactly
    while sum(schedule(high)) / num_layers < budget and high < 1e6:
        high *= 2
    for _ in range(80):  # the mean grows with top
        mid = (low + high) / 2
        low, high = (mid, high) if sum(schedule(mid)) / num_layers < budget else (low, mid)
    return tuple(schedule(high))
