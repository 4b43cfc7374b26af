"""How an engine lays out its KV cache for a model: the rules that need the model's facts (layers, KV heads,
sliding windows) beside the engine's configuration. The engine builds its cache from this plan, and the command
line makes the same plan from the model's metadata before any weight loads, so a refusal comes first."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.offloaded import offload_block_bytes
from kvserve.config import EngineConfig
from kvserve.kv.layout import KVLayout, single_group_layout, window_group_layout
from kvserve.kv.sizing import kv_block_bytes
from kvserve.models.config import ModelConfig
from kvserve.policies import KVPolicy, make_policy


@dataclass(frozen=True)
class KVPlan:
    policy: KVPolicy
    layout: KVLayout
    block_layers: int  # layers one block holds (1 with a group per layer)
    block_bytes: int  # one block of the pool
    num_blocks: int


def plan_kv(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> KVPlan:
    """The plan, or a ValueError saying why ``config`` cannot run ``model`` (the reason and the numbers)."""
    policy = make_policy(config.kv_policy, config.kv_budget, **config.kv_policy_knobs)
    policy.retention(model.num_layers)  # raises now if explicit per-layer fractions do not fit
    layout = kv_layout(config, model, policy)
    # A compressing policy keeps different slots per layer: one KV group (block table) per layer.
    block_layers = 1 if policy.per_layer_groups else layout.rows
    if config.kv_offload != "none":
        block_bytes = offload_block_bytes(
            policy, model.num_layers, model.num_kv_heads, model.head_dim, dtype, config.block_size
        )
    else:
        dtype_size = torch.empty((), dtype=dtype).element_size()
        block_bytes = kv_block_bytes(block_layers, model.num_kv_heads, model.head_dim, dtype_size, config.block_size)
    num_blocks = config.kv_cache_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory!r} holds no block; one block of {config.block_size} "
            f"tokens needs {block_bytes} bytes"
        )
    return KVPlan(policy, layout, block_layers, block_bytes, num_blocks)


def kv_layout(config: EngineConfig, model: ModelConfig, policy: KVPolicy) -> KVLayout:
    """Window groups for a model with sliding-window layers (unless switched off), else one group;
    refuses the techniques that do not run over window groups, with the reason."""
    if not any(w is not None for w in model.layer_windows):
        return single_group_layout(model.num_layers)
    refusal = windowed_model_refusal(config, policy)
    if refusal:
        raise ValueError(f"{model.architecture} has sliding-window layers: {refusal}")
    if not config.kv_window_groups:
        return single_group_layout(model.num_layers)
    return window_group_layout(model.layer_windows)


def windowed_model_refusal(config: EngineConfig, policy: KVPolicy) -> str | None:
    """Why an engine over a model with sliding-window layers cannot run ``config``, or None."""
    if policy.per_layer_groups:
        return (
            f"kv_policy={policy.name!r} keeps its own slots per layer, and a sliding-window layer would need both "
            "its window and the policy's choice; use kv_policy='full' (window groups already keep only the window)"
        )
    if config.kv_offload != "none":
        return f"kv_offload={config.kv_offload!r} tiers every layer's whole context; use kv_offload='none'"
    if config.prefill_parallel > 1:
        return "parallel prefill (KV-Runahead) passes whole caches between processes without windows; use 1"
    return None
