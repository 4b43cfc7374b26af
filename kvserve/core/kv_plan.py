"""How an engine lays out its KV cache for a model: the rules that need the model's facts (layers, KV heads,
sliding windows) beside the engine's configuration. The engine builds its cache from this plan, and the command
line makes the same plan from the model's metadata before any weight loads, so a refusal comes first."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.attention.kv_quant import KVQuant
from kvserve.attention.offloaded import offload_block_bytes
from kvserve.config import EngineConfig
from kvserve.kv.layout import KVLayout, single_group_layout, split_offload_layout, window_group_layout
from kvserve.kv.manager import KVGroupSpec
from kvserve.kv.sizing import kv_block_bytes
from kvserve.models.config import ModelConfig
from kvserve.policies import KVPolicy, make_policy
from kvserve.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVPlan:
    policy: KVPolicy
    layout: KVLayout
    block_layers: int  # layers one block holds (1 with a group per layer)
    block_bytes: int  # one block of the pool
    num_blocks: int
    offload: str = "none"  # the tier the pool lives in: none (the device), host or disk
    num_host_blocks: int = 0  # host tier for preemption by swapping
    prefix_caching: bool = True  # full blocks findable by their tokens' hash
    windowed: bool = False  # the model has sliding-window layers
    # A split layout (offloaded global layers, window layers on the device): the device's side pool.
    num_side_blocks: int = 0
    side_block_bytes: int = 0

    @property
    def per_layer_groups(self) -> bool:
        """A compressing policy keeps different slots per layer: one KV group (block table) per layer."""
        return self.policy.per_layer_groups

    @property
    def same_step_prefix_hits(self) -> bool:
        """Whether a block is a prefix hit in the step that computes it: not for an offloaded cache, which
        fetches a decode's rows ahead of the layer that writes them (``SchedulerConfig``)."""
        return self.offload == "none"

    def groups(self, num_layers: int) -> tuple[KVGroupSpec, ...]:
        """The KV groups the manager keeps a block table for, per sequence."""
        if self.per_layer_groups:
            return tuple(KVGroupSpec((layer,)) for layer in range(num_layers))
        return self.layout.groups

    def group_windows(self, layer_windows: Sequence[int | None]) -> tuple[int | None, ...]:
        """With per-layer groups on a model with sliding-window layers, each layer's window; else ()."""
        return tuple(layer_windows) if self.per_layer_groups and self.windowed else ()

    def prompt_cache_refusal(self, config: EngineConfig) -> str | None:
        """Why this engine cannot take Prompt Cache schemas, or None."""
        refusal = config.prompt_cache_refusal()
        if refusal:
            return refusal
        if self.windowed and (self.per_layer_groups or self.offload != "none"):
            return (
                "this model's sliding-window layers count a window in cache slots under a compressing policy or an "
                "offloaded cache, and imported modules leave gaps in positions (and may not be evicted from a "
                "window): use kv_policy='full' without kv_offload for Prompt Cache"
            )
        if not self.layout.windowed:
            return None
        # Window groups: modules keep blocks in every group, and importers release theirs by position.
        if config.prompt_cache_recompute > 0:
            return (
                "prompt_cache_recompute rewrites imported module tokens at their positions in the step a prompt is "
                "admitted, and this model's sliding-window KV groups give back, by position, blocks of those same "
                "module tokens as the prompt starts: start the engine with kv_window_groups=False "
                "(--no-kv-window-groups) for selective recompute"
            )
        if len(self.layout.groups) > 1 and (config.prompt_cache_tier == "host" or config.prompt_cache_dir):
            what = "prompt_cache_tier='host'" if config.prompt_cache_tier == "host" else "prompt_cache_dir"
            return (
                f"{what} reads and writes a module's tokens as one row per layer, and this model's sliding-window "
                f"layers share rows of blocks across {len(self.layout.groups)} KV groups: use "
                "prompt_cache_tier='device' without prompt_cache_dir, or start the engine with "
                "kv_window_groups=False (--no-kv-window-groups)"
            )
        return None

    def summary(self, block_size: int, num_layers: int, dtype: torch.dtype | str) -> str:
        """One line for the log: the pool, where it lives, the policy and the host tier."""
        tokens = self.num_blocks * block_size * self.block_layers // num_layers
        where = f"offloaded to the {self.offload} tier" if self.offload != "none" else "on the device"
        depth = " (one layer each)" if self.per_layer_groups else ""
        if self.layout.windowed and not self.per_layer_groups:
            groups = len(self.layout.groups)
            depth = f" ({self.block_layers} layers each, {groups} groups; window groups keep their window)"
        if self.layout.split:
            tier_layers, side_gib = self.layout.rows, self.num_side_blocks * self.side_block_bytes / 2**30
            return (
                f"KV cache: the {tier_layers} global layers' in {self.num_blocks} blocks x {block_size} tokens "
                f"{where} ({self.num_blocks * self.block_bytes / 2**30:.2f} GiB, {dtype}); the "
                f"{num_layers - tier_layers} window layers' on the device in {self.num_side_blocks} blocks "
                f"({side_gib:.2f} GiB, {len(self.layout.groups) - 1} window groups); policy {self.policy.name} "
                f"(budget {self.policy.budget:g})"
            )
        return (
            f"KV cache: {self.num_blocks} blocks x {block_size} tokens{depth} = {tokens:,} full-cache tokens {where} "
            f"({self.num_blocks * self.block_bytes / 2**30:.2f} GiB, {dtype}); policy {self.policy.name} "
            f"(budget {self.policy.budget:g}); host tier for swapping: {self.num_host_blocks} blocks"
        )


def plan_kv(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> KVPlan:
    """The plan, or a ValueError saying why ``config`` cannot run ``model`` in ``dtype`` (the reason and the
    numbers); blocks are sized in the KV cache's dtype (``config.kv_cache_dtype``)."""
    dtype = config.kv_dtype(dtype)
    if model.attention_softcap and config.prefill_parallel > 1:
        raise ValueError(
            f"{model.architecture} soft-caps its attention logits (Gemma 2's attn_logit_softcapping="
            f"{model.attention_softcap:g}), which parallel prefill (KV-Runahead) does not apply: use prefill_parallel=1"
        )
    policy = make_policy(config.kv_policy, config.kv_budget, **config.kv_policy_knobs)
    policy.retention(model.num_layers)  # raises now if explicit per-layer fractions do not fit
    layout = kv_layout(config, model, policy)
    # A compressing policy keeps different slots per layer: one KV group (block table) per layer.
    block_layers = 1 if policy.per_layer_groups else layout.rows
    if config.kv_offload != "none" and not policy.per_layer_groups:  # the tier's layers: the global ones if split
        tier_layers = layout.rows if layout.split else model.num_layers
        block_bytes = offload_block_bytes(
            policy, tier_layers, model.num_kv_heads, model.head_dim, dtype, config.block_size
        )
    elif config.kv_quant is not None:  # byte rows of codes and scales (attention/kv_quant.py)
        row_bytes = KVQuant(config.kv_quant, model.head_dim).row_bytes
        block_bytes = kv_block_bytes(block_layers, model.num_kv_heads, row_bytes, 1, config.block_size)
    else:
        dtype_size = torch.empty((), dtype=dtype).element_size()
        block_bytes = kv_block_bytes(block_layers, model.num_kv_heads, model.head_dim, dtype_size, config.block_size)
    if policy.rehearsed and config.kv_offload == "none":  # InfiniGen's partial keys beside the device cache
        dtype_size = torch.empty((), dtype=dtype).element_size()
        partial = policy.partial_dims(model.head_dim)
        block_bytes += kv_block_bytes(block_layers, model.num_kv_heads, partial, dtype_size, config.block_size) // 2
    num_blocks = config.kv_cache_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory!r} holds no block; one block of {config.block_size} "
            f"tokens needs {block_bytes} bytes"
        )
    offloaded = config.kv_offload != "none"
    num_host_blocks = 0 if offloaded else config.swap_space_bytes // block_bytes
    # Slots no longer match token blocks once a policy compacts them, or a pool limit overwrites victims in place.
    in_place = offloaded and config.kv_pool_limit < 1
    prefix_caching = config.enable_prefix_caching and not policy.per_layer_groups and not in_place
    windowed = any(w is not None for w in model.layer_windows)
    side_blocks, side_bytes = side_pool(config, model, layout, dtype, num_blocks) if layout.split else (0, 0)
    return KVPlan(
        policy,
        layout,
        block_layers,
        block_bytes,
        num_blocks,
        config.kv_offload,
        num_host_blocks,
        prefix_caching,
        windowed,
        side_blocks,
        side_bytes,
    )


def side_pool(
    config: EngineConfig, model: ModelConfig, layout: KVLayout, dtype: torch.dtype, num_tier_blocks: int
) -> tuple[int, int]:
    """The device pool of a split layout's window groups: (blocks, bytes a block). Sized so that it rarely binds
    before the tier does: each sequence that may be resident at once (``max_num_seqs``, and no more than the tier
    has blocks, one at least each) holds its window's blocks and two more, and a step's tokens
    (``max_num_batched_tokens``) take blocks beside them; at most as many bytes as the tier's ``kv_cache_memory``.
    The KV manager checks each pool, so a pool that does bind makes sequences wait or be preempted, never fail."""
    dtype_size = torch.empty((), dtype=dtype).element_size()
    block_bytes = kv_block_bytes(layout.side_rows, model.num_kv_heads, model.head_dim, dtype_size, config.block_size)
    seqs, bs = min(config.max_num_seqs, num_tier_blocks), config.block_size
    step_blocks = -(-config.max_num_batched_tokens // bs)
    blocks = sum(
        seqs * (-(-(spec.sliding_window - 1) // bs) + 2) + step_blocks
        for spec in layout.groups
        if spec.pool == 1 and spec.sliding_window is not None
    )
    return max(1, min(blocks, config.kv_cache_bytes // block_bytes)), block_bytes


def one_request_config(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, num_tokens: int) -> EngineConfig:
    """``config`` for an engine that runs one request of at most ``num_tokens`` tokens (``kvserve generate``): a KV
    pool of the blocks it can hold (every KV group's blocks for all its tokens, and one more each), at most
    ``kv_cache_memory``, and no host tier for swapping, which one sequence never needs. The pool is zeroed as the
    engine starts: the 1 GiB defaults cost seconds before the first token."""
    plan = plan_kv(config, model, dtype)
    blocks = len(plan.groups(model.num_layers)) * (-(-num_tokens // config.block_size) + 1)
    kv_bytes = min(config.kv_cache_bytes, blocks * plan.block_bytes)
    if plan.layout.split:  # the window layers' device pool, sized for one sequence, is capped by the same bytes
        one = dataclasses.replace(config, max_num_seqs=1)
        side_blocks, side_bytes = side_pool(one, model, plan.layout, config.kv_dtype(dtype), plan.num_blocks)
        kv_bytes = min(config.kv_cache_bytes, max(kv_bytes, side_blocks * side_bytes))
        return dataclasses.replace(config, kv_cache_memory=kv_bytes, swap_space=0, max_num_seqs=1)
    return dataclasses.replace(config, kv_cache_memory=kv_bytes, swap_space=0)


def kv_layout(config: EngineConfig, model: ModelConfig, policy: KVPolicy) -> KVLayout:
    """Window groups for a model with sliding-window layers (unless switched off), else one group;
    refuses the techniques that do not run over window groups, with the reason."""
    if not any(w is not None for w in model.layer_windows):
        return single_group_layout(model.num_layers)
    refusal = windowed_model_refusal(config, policy, None in model.layer_windows)
    if refusal:
        raise ValueError(f"{model.architecture} has sliding-window layers: {refusal}")
    if not config.kv_window_groups:
        return single_group_layout(model.num_layers)
    if config.kv_offload != "none":
        # The tier keeps the global layers, the device the window layers (attention/split_offload.py); the tier
        # keeps every layer's whole context where a compressing policy keeps a group per layer, or no layer is
        # global.
        if policy.per_layer_groups or None not in model.layer_windows:
            return single_group_layout(model.num_layers)
        return split_offload_layout(model.layer_windows)
    return window_group_layout(model.layer_windows)


def windowed_model_refusal(config: EngineConfig, policy: KVPolicy, has_global_layers: bool = True) -> str | None:
    """Why an engine over a model with sliding-window layers cannot run ``config``, or None."""
    if config.kv_offload != "none" and config.kv_pool_limit < 1:
        return (
            f"kv_pool_limit={config.kv_pool_limit} overwrites slots in place, so a window layer could no longer find "
            "its window by position; use kv_pool_limit=1"
        )
    # An offloading engine with window groups keeps the window layers in a paged cache on the device (split).
    split = config.kv_offload != "none" and config.kv_window_groups and has_global_layers
    if config.prefill_parallel > 1 and (policy.per_layer_groups or (config.kv_offload != "none" and not split)):
        return (
            "parallel prefill (KV-Runahead) windows its processes' attention over the paged cache only; a compressing "
            "kv_policy, or kv_offload keeping every layer in its tier (window groups off, or no global layer), "
            "stores the prompt's window layers by rules of its own: use prefill_parallel=1"
        )
    return None


def request_policy(plan: KVPlan, config: EngineConfig, params: SamplingParams, num_layers: int) -> KVPolicy:
    """A request's KV policy: the engine's, unless ``params`` names another policy or budget; a ValueError
    naming why when this engine cannot run the one asked for."""
    if params.kv_policy is None and params.kv_budget is None:
        policy = plan.policy
    else:
        policy = _requested_policy(plan, config, params, num_layers)
    if not policy.per_layer_groups:  # the full cache, or what an offloading engine fetches by
        return policy
    if not plan.per_layer_groups:
        raise ValueError(
            f"kv_policy={policy.name!r} needs per-layer KV groups; this engine was started with kv_policy="
            f"{plan.policy.name!r} (start it with a compressing kv_policy to choose policies per request)"
        )
    if params.best_of > 1:  # the full cache forks fine over per-layer groups: it never compacts
        raise ValueError(
            f"kv_policy={policy.name!r} compacts each sequence's own blocks, so samples cannot share them: "
            f"n and best_of must be 1, got best_of={params.best_of}"
        )
    return policy


def _requested_policy(plan: KVPlan, config: EngineConfig, params: SamplingParams, num_layers: int) -> KVPolicy:
    name = params.kv_policy or plan.policy.name
    budget = params.kv_budget if params.kv_budget is not None else (
        plan.policy.budget if name == plan.policy.name else None
    )  # fmt: skip
    policy = make_policy(name, budget, **config.kv_policy_knobs)
    policy.retention(num_layers)
    if plan.offload != "none" and not plan.per_layer_groups and policy != plan.policy:
        raise ValueError(
            f"this engine offloads its KV and fetches it by kv_policy={plan.policy.name!r} for every request; "
            f"a request cannot pick kv_policy={policy.name!r}"
        )
    if plan.policy.rehearsed and policy != plan.policy:
        raise ValueError(
            f"this engine's decodes read the rows kv_policy={plan.policy.name!r} selects for every request; "
            f"a request cannot pick kv_policy={policy.name!r}"
        )
    if policy.rehearsed and policy != plan.policy:  # its partial keys are kept beside the cache from the start
        raise ValueError(
            f"kv_policy={policy.name!r} keeps partial keys beside the KV cache from the engine's start, and this "
            f"engine was started with kv_policy={plan.policy.name!r}: a request cannot pick kv_policy={policy.name!r}"
        )
    # What this engine's configuration would refuse at start-up (EngineConfig's rules, not a copy of them),
    # a request cannot pick either: the server refuses what the command line refuses.
    try:
        dataclasses.replace(config, kv_policy=name, kv_budget=budget)
    except ValueError as exc:
        raise ValueError(f"this engine cannot run kv_policy={name!r} for a request: {exc}") from None
    return policy
