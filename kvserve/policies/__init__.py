"""KV policies: which cached slots each layer keeps. ``make_policy`` builds one by name."""

from __future__ import annotations

from typing import Any

from kvserve.policies.adakv import AdaKV
from kvserve.policies.base import KVPolicy
from kvserve.policies.full import FullCache
from kvserve.policies.h2o import HeavyHitters
from kvserve.policies.infinigen import InfiniGen
from kvserve.policies.pyramid import PyramidInfer
from kvserve.policies.quant import Int4KV
from kvserve.policies.snapkv import PyramidKV, SnapKV
from kvserve.policies.streaming import LocalWindow

POLICIES: dict[str, type[KVPolicy]] = {
    "full": FullCache,
    "pyramid": PyramidInfer,
    "local": LocalWindow,
    "h2o": HeavyHitters,
    "snapkv": SnapKV,
    "pyramidkv": PyramidKV,
    "adakv": AdaKV,
    "infinigen": InfiniGen,
    "int4": Int4KV,
}
KV_POLICY_NAMES = tuple(POLICIES)

__all__ = [
    "AdaKV",
    "KV_POLICY_NAMES",
    "POLICIES",
    "FullCache",
    "HeavyHitters",
    "InfiniGen",
    "Int4KV",
    "KVPolicy",
    "LocalWindow",
    "PyramidInfer",
    "PyramidKV",
    "SnapKV",
    "make_policy",
]


def make_policy(name: str, budget: float | None = None, **knobs: Any) -> KVPolicy:
    """The policy called ``name`` with ``budget`` (None: 1 for full, 0.5 otherwise) and its own knobs.

    Knobs another policy would take (``recent_ratio`` for local) are ignored, so one set of engine
    options can serve requests that pick different policies.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"kv_policy must be one of {list(KV_POLICY_NAMES)}, got {name!r}")
    if budget is None:
        budget = 1.0 if name == "full" or cls.offload_only else 0.5
    fields = set(cls.__dataclass_fields__)
    return cls(budget=budget, **{k: v for k, v in knobs.items() if k in fields and v is not None})
