"""Assembles an engine's parts from its configuration: the model, the KV plan and manager, the KV cache, the
executor (with its tensor-parallel group or parallel prefill group), the scheduler and the Prompt Cache.

Each technique's wiring lives here, once, so that the engine (``core/engine.py``) is only its loop. What the
parts started (processes, threads, files) is closed by ``EngineParts.close``; a build that fails part way closes
what it had started before it raises.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kvserve.config import EngineConfig
from kvserve.core.executor import Executor, LocalExecutor, TensorParallelExecutor
from kvserve.core.kv_cache import make_kv_cache
from kvserve.core.kv_plan import KVPlan, plan_kv
from kvserve.core.runner import ModelRunner
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.models.loader import LoadedModel, load_model
from kvserve.platform.cpu_kernels import prepare_cpu_kernels
from kvserve.prompt_cache.cache import PromptCache
from kvserve.prompt_cache.disk import ModuleFiles, model_fingerprint
from kvserve.prompt_cache.store import ModuleStore


@dataclass
class EngineParts:
    loaded: LoadedModel
    max_model_len: int
    plan: KVPlan
    kv: KVCacheManager
    executor: Executor
    scheduler: Scheduler
    prompt_cache: PromptCache

    def close(self) -> None:
        """Stop the executor's processes (parallel prefill workers, tensor-parallel ranks), write out the modules
        encoded so far, release the cache's tier (its transfer thread, a disk tier's file)."""
        if self.prompt_cache.store.files is not None:  # modules encoded so far are on disk when close returns
            self.prompt_cache.store.files.close()
        self.executor.runner.cache.close()
        self.executor.close()


def build_engine(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """The parts of an engine for ``config`` (over ``loaded`` when given, else loading ``config.model``)."""
    with contextlib.ExitStack() as started:  # closed only when the build fails
        group, threads_before = None, torch.get_num_threads()
        if config.tensor_parallel_size > 1:
            group = _start_tensor_parallel(config)
            started.callback(torch.set_num_threads, threads_before)
            started.callback(group.close)
        shard = group.shard if group is not None else None
        if loaded is not None and loaded.shard != shard:
            raise ValueError(f"the model given was loaded with shard={loaded.shard}, this engine runs shard={shard}")
        # On a CPU the compiled kernels load (or build, the first time, with a log line) before the engine takes
        # a request: no first request's TTFT includes a compile. Cheap when cached; nothing on CUDA.
        prepare_cpu_kernels(config.device)
        loaded = loaded or load_model(
            config.model, config.torch_dtype, config.device, weights=config.weights,
            batch_invariant=config.batch_invariant, tokenizer=config.tokenizer, chat_template=config.chat_template,
            shard=shard, int8_activations=config.int8_activations,
        )  # fmt: skip
        if config.batch_invariant and not loaded.batch_invariant:
            raise ValueError("batch_invariant=True needs a model loaded with load_model(..., batch_invariant=True)")
        if config.int8_activations and not loaded.int8_activations:
            raise ValueError("int8_activations=True needs a model loaded with load_model(..., int8_activations=True)")
        cfg = loaded.config
        max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        plan = plan_kv(config, cfg, loaded.dtype)  # raises when this model cannot run the configuration
        kv = KVCacheManager(
            plan.num_blocks, config.block_size, groups=list(plan.groups(cfg.num_layers)),
            num_host_blocks=plan.num_host_blocks, enable_prefix_caching=plan.prefix_caching,
            num_side_blocks=plan.num_side_blocks,
        )  # fmt: skip
        prefill = _start_parallel_prefill(config, loaded) if config.prefill_parallel > 1 else None
        if prefill is not None:
            started.callback(prefill.close)
        cache = make_kv_cache(config, plan, loaded)
        started.callback(cache.close)
        runner = ModelRunner(loaded.model, cache, config.device)
        if group is not None:  # the workers have loaded their shards: meet them
            group.join(loaded.model, cache)
            executor: Executor = TensorParallelExecutor(runner, group, threads_before)
        else:
            executor = LocalExecutor(runner, prefill)
        scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.preemption_mode,
                plan.per_layer_groups,
                layer_windows=plan.group_windows(cfg.layer_windows),
                same_step_prefix_hits=plan.same_step_prefix_hits,
                positioned_windows=plan.windowed,
            ),
            kv,
        )
        prompt_cache = _make_prompt_cache(config, plan, loaded, kv, cache, max_model_len, group is None)
        started.pop_all()  # built: the engine closes them from now on
    return EngineParts(loaded, max_model_len, plan, kv, executor, scheduler, prompt_cache)


def _make_prompt_cache(
    config: EngineConfig, plan: KVPlan, loaded: LoadedModel, kv: KVCacheManager, cache: object, max_model_len: int,
    one_process: bool,
) -> PromptCache:  # fmt: skip
    # Device-tier modules live in the KV pool: at most half of it, so requests always have room to run.
    module_budget = config.prompt_cache_bytes
    if config.prompt_cache_tier == "device":
        module_budget = min(module_budget, plan.num_blocks * plan.block_bytes // 2)
    files = None
    if config.prompt_cache_dir is not None:
        files = ModuleFiles(config.prompt_cache_dir, model_fingerprint(loaded, config))
    store = ModuleStore(
        kv, cache, config.prompt_cache_tier, module_budget, plan.block_bytes // config.block_size,
        plan.per_layer_groups, files,
    )  # fmt: skip
    eager = config.prompt_cache_encode == "eager"
    # A module encoded after the schema's prefix is copied out of a scratch sequence: in this process, one group
    # for every layer (see config.prompt_cache_context).
    context = config.prompt_cache_context == "prefix" and not plan.per_layer_groups and one_process
    windows = loaded.config.layer_windows
    # Recompute selects by layer 1's KV deviation: a window on layer 0 bounds which tokens can deviate there.
    probe_window = windows[0] if len(windows) > 1 else None
    return PromptCache(
        loaded.tokenizer, max_model_len, store, eager, config.prompt_cache_recompute, module_context=context,
        probe_window=probe_window,
    )  # fmt: skip


def _start_tensor_parallel(config: EngineConfig):  # noqa: ANN202 - kvserve.parallel.tensor_group.TensorParallelGroup
    """Spawn this machine's other ranks (they load their shards while this process loads its own); this process
    computes with its share of the cores from now on."""
    from kvserve.parallel.tensor_group import TensorParallelGroup

    if config.node_rank != 0:
        raise ValueError(
            f"node_rank={config.node_rank} runs tensor-parallel workers only (`kvserve serve --node-rank "
            f"{config.node_rank}` does that); the engine runs on node 0"
        )
    group = TensorParallelGroup(config)
    torch.set_num_threads(group.threads)
    return group


def _start_parallel_prefill(config: EngineConfig, loaded: LoadedModel):  # noqa: ANN202 - parallel.prefill.ParallelPrefill
    from kvserve.models.dtype import DTYPE_NAMES
    from kvserve.parallel import partition
    from kvserve.parallel.group import WorkerModel
    from kvserve.parallel.prefill import ParallelPrefill

    choice = config.prefill_partition
    if choice is None:
        choice = "predicted" if partition.default_table_path().is_file() else "even"
    worker_model = WorkerModel(str(loaded.path), DTYPE_NAMES[loaded.dtype], config.weights)
    return ParallelPrefill(loaded.model, worker_model, config.prefill_parallel, choice, kv_quant=config.kv_quant)
