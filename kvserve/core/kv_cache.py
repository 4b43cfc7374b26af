"""Builds the KV cache an engine runs from its configuration and KV plan: the one place that knows the kinds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.compressed import CompressedKVCache
from kvserve.attention.kv_quant import KVQuant
from kvserve.attention.offloaded import OffloadedKVCache
from kvserve.attention.paged import PagedKVCache
from kvserve.attention.sparse_decode import SparseDecodeKVCache
from kvserve.attention.split_offload import SplitOffloadKVCache
from kvserve.log import get_logger
from kvserve.policies.infinigen import AUTO, InfiniGen, Rehearsal
from kvserve.policies.skewing import skewing_for

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.core.kv_plan import KVPlan
    from kvserve.models.loader import LoadedModel


def make_kv_cache(config: EngineConfig, plan: KVPlan, loaded: LoadedModel) -> AttentionBackend:
    """Per-layer groups for a compressing policy (in the offloaded tier when ``kv_offload`` is set), the offloaded
    cache for ``kv_offload`` with the full cache, INT4 or InfiniGen (split with the device on a sliding-window model:
    ``split_offload_cache``), else the paged cache (with KV groups for
    sliding-window layers and a host tier for swapping), InfiniGen's sparse decode over it without ``kv_offload``."""
    # The model's own config: under tensor parallelism, this rank's KV heads only.
    cfg, dtype = loaded.model.config, config.kv_dtype(loaded.dtype)
    shape = (cfg.num_layers, plan.num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim, dtype, config.device)
    if plan.per_layer_groups:
        return CompressedKVCache(
            *shape, num_host_blocks=plan.num_host_blocks, tier=plan.offload, path=config.kv_offload_path,
            layer_windows=cfg.layer_windows, softcap=cfg.attention_softcap,
        )  # fmt: skip
    if plan.offload == "none":
        quant = KVQuant(config.kv_quant, cfg.head_dim) if config.kv_quant is not None else None
        paged = dict(
            layer_rows=plan.layout.layer_rows, batch_invariant=config.batch_invariant,
            num_host_blocks=plan.num_host_blocks, layer_to_group=plan.layout.layer_to_group,
            layer_windows=cfg.layer_windows, softcap=cfg.attention_softcap, kv_quant=quant,
        )  # fmt: skip
        if plan.policy.rehearsed:  # InfiniGen on the device: sparse decode over the paged cache
            return SparseDecodeKVCache(*infinigen_rehearsal(plan.policy, loaded), *shape, **paged)
        return PagedKVCache(*shape, **paged)
    if plan.layout.split:  # global layers in the tier, window layers on the device
        return split_offload_cache(config, plan, loaded)
    policy, rehearsal = plan.policy, None
    if policy.rehearsed:  # InfiniGen selects rows by a rehearsal of the model's next layer
        policy, rehearsal = infinigen_rehearsal(policy, loaded)
    return OffloadedKVCache(
        policy, plan.offload, *shape, path=config.kv_offload_path, rehearsal=rehearsal, layer_windows=cfg.layer_windows,
        softcap=cfg.attention_softcap, disk_io=config.kv_disk_io,
    )  # fmt: skip


def split_offload_cache(config: EngineConfig, plan: KVPlan, loaded: LoadedModel) -> SplitOffloadKVCache:
    """The global layers' KV in the offload tier (the main pool), the window layers' in a paged cache on the device
    (the side pool), as ``split_offload_layout`` groups them."""
    cfg, dtype, layout = loaded.model.config, config.kv_dtype(loaded.dtype), plan.layout
    heads = (config.block_size, cfg.num_kv_heads, cfg.head_dim, dtype, config.device)
    tier_groups, device_groups = layout.pool_groups(0), layout.pool_groups(1)
    global_layers = layout.groups[tier_groups[0]].layer_ids
    policy, rehearsal = plan.policy, None
    if policy.rehearsed:  # InfiniGen over the global layers: their alphas and rehearsal
        policy, rehearsal = infinigen_rehearsal(policy, loaded)
        policy, rehearsal = policy.of_layers(global_layers), rehearsal.of_layers(global_layers)
    tier = OffloadedKVCache(
        policy, plan.offload, len(global_layers), plan.num_blocks, *heads, path=config.kv_offload_path,
        rehearsal=rehearsal, softcap=cfg.attention_softcap, disk_io=config.kv_disk_io, first_fetch_at_own_input=False,
    )  # fmt: skip
    device_group = {g: i for i, g in enumerate(device_groups)}
    window_rows = [0 if g in tier_groups else r for g, r in zip(layout.layer_to_group, layout.layer_rows, strict=True)]
    device = PagedKVCache(
        cfg.num_layers, plan.num_side_blocks, *heads, layer_rows=window_rows,
        layer_to_group=[device_group.get(g, 0) for g in layout.layer_to_group], layer_windows=cfg.layer_windows,
        softcap=cfg.attention_softcap,
    )  # fmt: skip
    return SplitOffloadKVCache(tier, device, global_layers, tier_groups, device_groups)


def infinigen_rehearsal(policy: InfiniGen, loaded: LoadedModel) -> tuple[InfiniGen, Rehearsal]:
    """The policy with ``infinigen_alpha="auto"`` resolved into the model's calibrated per-layer alphas, and
    the rehearsal over the skewing's partial dimensions (this rank's KV heads under tensor parallelism)."""
    dims = policy.partial_dims(loaded.model.config.head_dim)
    auto = policy.alpha == AUTO
    skewing = skewing_for(loaded, partial_dims=dims if auto else None)[0]
    policy = policy.resolve_alpha(skewing.alphas.get(dims))
    if auto:
        get_logger().info(
            "InfiniGen: infinigen_alpha='auto' -> per-layer alphas %s (each keeps %s)",
            " ".join(f"{a:.2f}" for a in policy.alpha),
            skewing.target.describe(loaded.config.layer_windows),
        )
    skew = skewing.partial(dims)  # (L, Hkv, D, r)
    if loaded.shard is not None:  # this rank's KV heads
        skew = skew[:, loaded.shard.kv_heads(loaded.config.num_kv_heads)]
    return policy, Rehearsal(loaded.model, skew)
