"""Builds the KV cache an engine runs from its configuration and KV plan: the one place that knows the kinds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.compressed import CompressedKVCache
from kvserve.attention.offloaded import OffloadedKVCache
from kvserve.attention.paged import PagedKVCache
from kvserve.policies.infinigen import InfiniGen, Rehearsal
from kvserve.policies.skewing import skewing_for

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.kv_plan import KVPlan
    from kvserve.models.loader import LoadedModel


def make_kv_cache(config: EngineConfig, plan: KVPlan, loaded: LoadedModel) -> AttentionBackend:
    """Per-layer groups for a compressing policy (in the offloaded tier when ``kv_offload`` is set), the offloaded
    cache for ``kv_offload`` with the full cache, INT4 or InfiniGen, else the paged cache (with KV groups for
    sliding-window layers and a host tier for swapping)."""
    # The model's own config: under tensor parallelism, this rank's KV heads only.
    cfg, dtype = loaded.model.config, loaded.dtype
    shape = (cfg.num_layers, plan.num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim, dtype, config.device)
    if plan.per_layer_groups:
        return CompressedKVCache(
            *shape, num_host_blocks=plan.num_host_blocks, tier=plan.offload, path=config.kv_offload_path,
            layer_windows=cfg.layer_windows,
        )  # fmt: skip
    if plan.offload == "none":
        return PagedKVCache(
            *shape, layer_rows=plan.layout.layer_rows, batch_invariant=config.batch_invariant,
            num_host_blocks=plan.num_host_blocks, layer_to_group=plan.layout.layer_to_group,
            layer_windows=cfg.layer_windows,
        )  # fmt: skip
    rehearsal = None
    if isinstance(plan.policy, InfiniGen):
        skew = skewing_for(loaded)[0].partial(plan.policy.partial_dims(cfg.head_dim))  # (L, Hkv, D, r)
        if loaded.shard is not None:  # this rank's KV heads
            skew = skew[:, loaded.shard.kv_heads(loaded.config.num_kv_heads)]
        rehearsal = Rehearsal(loaded.model, skew)
    return OffloadedKVCache(plan.policy, plan.offload, *shape, path=config.kv_offload_path, rehearsal=rehearsal)
