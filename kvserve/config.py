"""Engine configuration: frozen dataclasses validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.kv_quant import KV_QUANT_BITS
from kvserve.kv.direct_tier import DISK_IO_MODES
from kvserve.kv.sizing import parse_memory_size
from kvserve.kv.tiers import KV_OFFLOAD_MODES
from kvserve.models.dtype import DTYPE_CHOICES, DTYPES, resolve_dtype
from kvserve.models.loader import WEIGHT_MODES
from kvserve.platform.devices import check_device
from kvserve.policies import KV_POLICY_NAMES, make_policy
from kvserve.policies.infinigen import POOL_EVICTIONS

__all__ = [
    "DTYPES", "DTYPE_CHOICES", "WEIGHT_MODES", "PREEMPTION_MODES", "PREFILL_PARTITIONS", "PROMPT_CACHE_TIERS",
    "PROMPT_CACHE_ENCODES", "PROMPT_CACHE_CONTEXTS", "KV_OFFLOAD_MODES", "POOL_EVICTIONS", "EngineConfig",
]  # fmt: skip

PREEMPTION_MODES = ("recompute", "swap")
PREFILL_PARTITIONS = ("even", "searched", "predicted", "tsp")
PROMPT_CACHE_TIERS = ("device", "host")
KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Quantized caches: codes and scales in byte rows (attention/kv_quant.py), attended in the model's dtype.
KV_QUANT_DTYPES = tuple(KV_QUANT_BITS)
PROMPT_CACHE_ENCODES = ("eager", "lazy")
PROMPT_CACHE_CONTEXTS = ("prefix", "none")
# Why a policy with per-head budgets (Ada-KV) cannot import Prompt Cache modules.
HEAD_BUDGETS_AND_MODULES = (
    "kv_policy={name!r} packs a layer's KV heads into its slots, each head its own number of tokens, and a Prompt "
    "Cache module's slots are shared as every head's same tokens: use kv_policy='snapkv' with Prompt Cache"
)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an ``LLMEngine`` needs to start. Sizes accept ``"2GiB"``-style strings or bytes."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct); a path, shipped or Hugging Face name
    tokenizer: str | None = None  # instead of the model's: a Hugging Face folder, a tokenizer.json or a GGUF file
    chat_template: str | None = None  # instead of the model's: a Jinja template file, or the template itself
    dtype: str = "auto"  # auto: bfloat16 where the device accelerates it, float32 otherwise
    device: str = "cpu"
    weights: str = "native"  # GGUF weights: native, int4 or dequant (see models/loader.py)
    kv_cache_memory: str | int = "1GiB"
    # auto: the model's dtype; bfloat16 / float16: a narrower cache (float32 model); int8 / int4: quantized rows
    kv_cache_dtype: str = "auto"
    swap_space: str | int = "1GiB"  # host tier for preemption by swapping
    block_size: int = 16
    # Sliding-window layers (Gemma 3, Mistral) in KV groups of their own that keep only the blocks their
    # window sees (kv/layout.py); False keeps every layer's whole context (the windows still apply).
    kv_window_groups: bool = True
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    max_model_len: int | None = None  # default: the model's context length
    prefill_parallel: int = 1  # processes for a long prompt's prefill (KV-Runahead); 1: this process alone
    prefill_partition: str | None = None  # even | searched | predicted | tsp; None: predicted if a table exists
    # Tensor parallelism (parallel/tensor_group.py): every layer's heads and MLP split over this many processes,
    # this one (rank 0) plus workers; over ``nnodes`` machines, rank 0's at ``master_addr:master_port``.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0  # this machine: 0 runs the engine, the others only workers (`kvserve serve --node-rank`)
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one machine); several machines need a fixed one
    tensor_parallel_timeout: float = 60.0  # seconds a step waits for a rank before the group is lost
    kv_policy: str = "full"  # full | pyramid | local | h2o | snapkv | pyramidkv | adakv | infinigen | int4 (policies/)
    kv_budget: float | None = None  # fraction of the full cache kept; None: 1 for full, 0.5 otherwise
    recent_ratio: float | None = None  # pyramid: |S_r| share of a layer's budget (0.4); h2o: recent share (0.5)
    observation_window: int | None = None  # snapkv/pyramidkv/adakv: the last queries of a prompt that vote (32)
    layer_schedule: str | None = None  # uniform | pyramidinfer | pyramidkv; None: the policy's own
    adakv_safeguard: float | None = None  # adakv: share of a head's even budget it always keeps (0.2)
    # Offloading (kv/tiers.py): the full KV in a slower tier, sized by kv_cache_memory; the device reads per step
    # what kv_policy fetches (full: everything; int4: everything, quantised; infinigen: the predicted rows).
    kv_offload: str = "none"  # none | host | disk
    kv_offload_path: str | None = None  # disk: the folder of the memory-mapped file (default: the temp dir)
    # disk: mmap (through the page cache) | direct (O_DIRECT, whole blocks; InfiniGen picks blocks: kv/direct_tier.py)
    kv_disk_io: str = "mmap"
    # Fetch tokens whose speculated logit is within alpha of the best; "auto": each layer's alpha calibrated on the
    # model (kvserve infinigen-setup, policies/calibration.py); a number: that alpha for every layer.
    infinigen_alpha: float | str = "auto"
    infinigen_partial_ratio: float = 0.3  # share of skewed dimensions in the partial query/key
    kv_pool_limit: float = 1.0  # infinigen: slots per sequence in the slower tier, as a share of its full KV
    kv_pool_eviction: str = "counter"  # counter | lru | fifo: the victim when the pool is full
    # Prompt Cache (kvserve/prompt_cache): where module KV is kept, how much of it, and when it is encoded.
    prompt_cache_tier: str = "device"  # device: blocks of the KV pool; host: CPU memory, copied in on use
    prompt_cache_memory: str | int = "512MiB"  # LRU-evicted past this; on device, at most half of kv_cache_memory
    prompt_cache_encode: str = "eager"  # eager: when a schema is registered; lazy: when a prompt first imports
    # What a module attends to while encoded besides itself. prefix: the schema's text before its first module
    # (BOS, system turn), as in the plain prompt; none: nothing (Prompt Cache's rule). Tensor parallelism and a
    # compressing policy encode modules alone (their slots cannot be copied out of a scratch sequence there).
    prompt_cache_context: str = "prefix"
    # Share of a prompt's imported module tokens recomputed with attention across modules (CacheBlend; 0: none).
    prompt_cache_recompute: float = 0.0
    # A folder where encoded modules are written and, by a restarted engine, loaded instead of encoded
    # (prompt_cache/disk.py); None: modules live in memory only.
    prompt_cache_dir: str | None = None
    # The same numerics for a sequence whatever runs beside it and whether its prefix came from the cache:
    # one matmul kernel for every row count, attention per query row (models/batch_invariant.py,
    # attention/row_invariant.py). Off: a sequence's last bits, and so some greedy tokens, depend on its batch.
    batch_invariant: bool = False
    # The 4-bit projections (and a Q8_0 head) round float32 activations to int8 per group of 32
    # (models/int8_activations.py): lossy, a third to a quarter of their cost at 16 to 128 rows on the CPU.
    int8_activations: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        if not isinstance(self.prefill_parallel, int) or self.prefill_parallel < 1:
            raise ValueError(f"prefill_parallel must be a positive integer, got {self.prefill_parallel!r}")
        if self.prefill_partition not in (None, *PREFILL_PARTITIONS):
            raise ValueError(f"prefill_partition must be one of {PREFILL_PARTITIONS}, got {self.prefill_partition!r}")
        if self.prefill_parallel > 1 and self.device != "cpu":
            raise ValueError(f"prefill_parallel > 1 runs on CPU (gloo) for now, not on device {self.device!r}")
        self._check_tensor_parallel()
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_policy not in KV_POLICY_NAMES:
            raise ValueError(f"kv_policy must be one of {list(KV_POLICY_NAMES)}, got {self.kv_policy!r}")
        policy = make_policy(self.kv_policy, self.kv_budget, **self.kv_policy_knobs)  # raises on a bad knob
        # A rehearsed policy (InfiniGen) also runs without kv_offload: sparse decode over the device cache.
        self._check_offload(policy.offload_only and not policy.rehearsed)
        if policy.head_budgets and self.tensor_parallel_size > 1:
            raise ValueError(
                f"kv_policy={self.kv_policy!r} allocates a layer's budget across its KV heads, which tensor "
                f"parallelism splits over ranks: use tensor_parallel_size=1, got {self.tensor_parallel_size}"
            )
        if parse_memory_size(self.kv_cache_memory) < 1:  # raises on a bad size, naming it
            # Whether it holds a block depends on the model: the engine says so once the model is known.
            raise ValueError(f"kv_cache_memory must be more than 0 bytes, got {self.kv_cache_memory!r}")
        parse_memory_size(self.swap_space)
        parse_memory_size(self.prompt_cache_memory)
        if self.prompt_cache_tier not in PROMPT_CACHE_TIERS:
            raise ValueError(f"prompt_cache_tier must be one of {PROMPT_CACHE_TIERS}, got {self.prompt_cache_tier!r}")
        self._check_batch_invariant()
        self._check_int8_activations()
        self._check_kv_cache_dtype()
        if self.prompt_cache_encode not in PROMPT_CACHE_ENCODES:
            raise ValueError(
                f"prompt_cache_encode must be one of {PROMPT_CACHE_ENCODES}, got {self.prompt_cache_encode!r}"
            )
        if self.prompt_cache_context not in PROMPT_CACHE_CONTEXTS:
            raise ValueError(
                f"prompt_cache_context must be one of {PROMPT_CACHE_CONTEXTS}, got {self.prompt_cache_context!r}"
            )
        self._check_prompt_cache_recompute()
        self._check_prompt_cache_dir(policy.per_layer_groups)
        check_device(self.device)  # last: the rules above name what a device cannot run, wherever it exists

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in (*KV_CACHE_DTYPES, *KV_QUANT_DTYPES):
            choices = ["auto", *KV_CACHE_DTYPES, *KV_QUANT_DTYPES]
            raise ValueError(f"kv_cache_dtype must be one of {choices}, got {self.kv_cache_dtype!r}")
        if self.kv_quant is not None:
            self._check_quantized_cache()
            return
        model, cache = self.torch_dtype, self.kv_dtype(self.torch_dtype)
        if cache == model:
            return
        if model != torch.float32:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} narrows a float32 model's cache; this engine runs "
                f"{str(model).removeprefix('torch.')}: leave kv_cache_dtype='auto'"
            )
        self._require(
            f"kv_cache_dtype={self.kv_cache_dtype!r} runs on the paged cache",
            {"kv_offload": "none", "batch_invariant": False, "prefill_parallel": 1, "prompt_cache_recompute": 0.0},
        )  # fmt: skip

    def _require(self, feature: str, needed: dict[str, object]) -> None:
        """A ValueError naming the first option that ``feature`` needs at another value."""
        for name, value in needed.items():
            if getattr(self, name) != value:
                raise ValueError(f"{feature}: it needs {name}={value!r}, got {getattr(self, name)!r}")

    def _check_quantized_cache(self) -> None:
        """What an int8/int4 cache does not run with yet, each refusal saying why."""
        name = self.kv_cache_dtype
        if self.kv_policy != "full":
            raise ValueError(
                f"kv_cache_dtype={name!r} quantizes the paged cache; kv_policy={self.kv_policy!r} keeps its own "
                "per-layer slots in the model's dtype: use kv_policy='full' with a quantized cache"
            )
        if self.kv_offload != "none":
            raise ValueError(
                f"kv_cache_dtype={name!r} quantizes the paged cache on the device; kv_offload={self.kv_offload!r} "
                "moves rows through its own tier codec (kv_policy='int4' for 4-bit tier rows): use kv_offload='none'"
            )
        if self.batch_invariant:
            raise ValueError(
                f"kv_cache_dtype={name!r}: batch_invariant=True attends in calls shaped by each row's position over "
                "a float cache; use one or the other"
            )
        if self.prompt_cache_recompute > 0:
            raise ValueError(
                f"kv_cache_dtype={name!r}: prompt_cache_recompute recomputes module tokens by reading and blending "
                "float KV in place; use prompt_cache_recompute=0 with a quantized cache"
            )

    @property
    def kv_quant(self) -> str | None:
        """``int8`` or ``int4`` for a quantized cache, else None."""
        return self.kv_cache_dtype if self.kv_cache_dtype in KV_QUANT_DTYPES else None

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache is attended in for a model running in ``model_dtype`` (a quantized cache: the
        model's; its rows are bytes)."""
        if self.kv_cache_dtype == "auto" or self.kv_quant is not None:
            return model_dtype
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    def prompt_cache_refusal(self) -> str | None:
        """Why this engine cannot take Prompt Cache schemas, or None. (A model's sliding-window groups are refused
        by the engine, which knows the model.)"""
        if self.tensor_parallel_size > 1 and self.prompt_cache_tier == "host":
            return (
                "prompt_cache_tier='host' keeps a module's KV in the engine's process, but under tensor parallelism "
                "each rank holds its own heads' KV: use prompt_cache_tier='device' (modules are blocks like any KV)"
            )
        if self.kv_offload != "none" and self.prompt_cache_tier == "host":
            return (
                f"an offloading engine keeps every block, modules' too, in its {self.kv_offload} tier already; "
                "prompt_cache_tier='host' would copy them into it a second time: use prompt_cache_tier='device' "
                "(modules stay in the offloaded pool)"
            )
        if self.kv_offload != "none" and self.kv_pool_limit < 1:
            return (
                f"kv_pool_limit={self.kv_pool_limit} overwrites a sequence's slots in place once its pool is full, "
                "and a module's blocks are shared by every request that imports it: use kv_pool_limit=1"
            )
        policy = make_policy(self.kv_policy, self.kv_budget, **self.kv_policy_knobs)
        if policy.head_budgets:
            return HEAD_BUDGETS_AND_MODULES.format(name=policy.name)
        if policy.per_layer_groups and self.prompt_cache_tier == "host":
            return (
                f"a compressing kv_policy ({policy.name!r}) keeps each module's own slots per layer, and "
                "prompt_cache_tier='host' copies a module's tokens across every layer at once: use "
                "prompt_cache_tier='device'"
            )
        return None

    def _check_prompt_cache_recompute(self) -> None:
        """Selective recompute (attention/blend.py) rewrites a request's own copy of paged module blocks."""
        share = self.prompt_cache_recompute
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 <= share <= 1.0:
            raise ValueError(f"prompt_cache_recompute must be a share in [0, 1] of the imported module tokens, "
                             f"got {share!r}")  # fmt: skip
        if share == 0:
            return
        others = {
            "kv_policy": (self.kv_policy, "full", "a compressing policy keeps some slots per layer"),
            "kv_offload": (self.kv_offload, "none", "an offloaded cache is not read in place by the recompute"),
            "tensor_parallel_size": (self.tensor_parallel_size, 1, "the recompute runs on one rank's cache"),
            "prefill_parallel": (self.prefill_parallel, 1, "KV-Runahead prefills whole prompts, not chosen tokens"),
        }  # fmt: skip
        for name, (value, needed, why) in others.items():
            if value != needed:
                raise ValueError(f"prompt_cache_recompute={share} needs {name}={needed!r}, got {value!r}: {why}")

    def _check_prompt_cache_dir(self, per_layer_groups: bool) -> None:
        """A module file holds every layer's keys and values of every KV head, read from the paged cache."""
        if self.prompt_cache_dir is None:
            return
        if per_layer_groups:
            raise ValueError(f"prompt_cache_dir: a compressing kv_policy ({self.kv_policy!r}) keeps each module's "
                             "own slots per layer, which are not saved: use kv_policy='full'")  # fmt: skip
        self._require("prompt_cache_dir saves modules read from the paged cache of one process",
                      {"kv_offload": "none", "tensor_parallel_size": 1})  # fmt: skip

    def _check_batch_invariant(self) -> None:
        if self.batch_invariant:
            self._require(
                "batch_invariant runs on the paged cache of one CPU process",
                {"kv_policy": "full", "kv_offload": "none", "prefill_parallel": 1, "device": "cpu",
                 "tensor_parallel_size": 1},
            )  # fmt: skip

    def _check_int8_activations(self) -> None:
        if not self.int8_activations:
            return
        if self.torch_dtype != torch.float32:
            raise ValueError(
                f"int8_activations rounds float32 activations; this engine runs "
                f"{str(self.torch_dtype).removeprefix('torch.')}: set dtype='float32'"
            )
        self._require(
            "int8_activations runs kvserve's CPU kernels on a GGUF model's 4-bit codes in one process",
            {"device": "cpu", "tensor_parallel_size": 1, "prefill_parallel": 1},
        )  # fmt: skip
        if self.weights == "dequant":
            raise ValueError("int8_activations runs on 4-bit codes: it needs weights='native' or 'int4', got 'dequant'")

    def _check_tensor_parallel(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of nnodes={self.nnodes} "
                "(each machine runs as many ranks)"
            )
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in 0..{self.nnodes - 1} (nnodes={self.nnodes}), got {self.node_rank!r}"
            )
        if not isinstance(self.master_port, int) or not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be a TCP port (0-65535), got {self.master_port!r}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("nnodes > 1 needs a fixed master_port that every machine can reach on master_addr")
        if self.tensor_parallel_timeout <= 0:
            raise ValueError(f"tensor_parallel_timeout must be > 0 seconds, got {self.tensor_parallel_timeout!r}")
        if self.tensor_parallel_size > 1 and self.kv_pool_limit < 1:
            raise ValueError(
                f"kv_pool_limit={self.kv_pool_limit} evicts by InfiniGen's selection counts, which each "
                "tensor-parallel rank keeps for its own heads only: use kv_pool_limit=1 with tensor_parallel_size > 1"
            )
        if self.tensor_parallel_size > 1 and self.prefill_parallel > 1:
            raise ValueError(
                "prefill_parallel > 1 (KV-Runahead) with tensor_parallel_size > 1 is not supported: its prefill "
                "group would need every chunk's ranks to be a tensor-parallel group of their own, and each process "
                "joins one torch.distributed world; use one or the other"
            )

    def _check_offload(self, offload_only: bool) -> None:
        if self.kv_offload not in KV_OFFLOAD_MODES:
            raise ValueError(f"kv_offload must be one of {list(KV_OFFLOAD_MODES)}, got {self.kv_offload!r}")
        if self.kv_offload_path is not None and self.kv_offload != "disk":
            raise ValueError(f"kv_offload_path is the disk tier's folder; kv_offload is {self.kv_offload!r}")
        self._check_disk_io()
        if self.kv_offload == "none":
            if offload_only:
                raise ValueError(
                    f"kv_policy={self.kv_policy!r} fetches from an offloaded cache: set kv_offload to 'host' or 'disk'"
                )
            if self.kv_pool_limit != 1:
                raise ValueError(
                    f"kv_pool_limit={self.kv_pool_limit} limits an offloaded cache: set kv_offload and "
                    "kv_policy='infinigen'"
                )
            return
        if self.kv_pool_limit != 1 and self.kv_policy != "infinigen":
            raise ValueError(
                f"kv_pool_limit evicts by InfiniGen's selection counts: it needs kv_policy='infinigen', "
                f"got {self.kv_policy!r}"
            )
        if self.preemption_mode == "swap":
            raise ValueError(
                "an offloaded cache preempts by recompute (its KV is already off the device); "
                "preemption_mode='swap' does not apply"
            )
        if self.prefill_parallel > 1 and self.kv_pool_limit < 1:
            raise ValueError(
                f"kv_pool_limit={self.kv_pool_limit} picks each evicted row by InfiniGen's selection as the prompt is "
                "stored row by row, which a parallel prefill does not run; prefill_parallel must be 1"
            )

    def _check_disk_io(self) -> None:
        if self.kv_disk_io not in DISK_IO_MODES:
            raise ValueError(f"kv_disk_io must be one of {list(DISK_IO_MODES)}, got {self.kv_disk_io!r}")
        if self.kv_disk_io == "mmap":
            return
        if self.kv_offload != "disk":
            raise ValueError(f"kv_disk_io='direct' is how the disk tier is read: set kv_offload='disk', not "
                             f"{self.kv_offload!r}")  # fmt: skip
        if self.kv_policy not in ("full", "infinigen"):
            raise ValueError(
                f"kv_disk_io='direct' reads whole blocks of K and V rows for kv_policy 'full' or 'infinigen', not "
                f"{self.kv_policy!r}: use kv_disk_io='mmap'"
            )
        if self.kv_pool_limit != 1:
            raise ValueError(
                f"kv_pool_limit={self.kv_pool_limit} overwrites single rows in place, and kv_disk_io='direct' writes "
                "whole blocks: use kv_pool_limit=1 or kv_disk_io='mmap'"
            )

    @property
    def kv_policy_knobs(self) -> dict[str, float | str]:
        """Policy options set on the engine (each policy takes the ones it knows)."""
        knobs: dict[str, float | str] = {
            "alpha": self.infinigen_alpha, "partial_ratio": self.infinigen_partial_ratio,
            "pool_limit": self.kv_pool_limit, "pool_eviction": self.kv_pool_eviction,
        }  # fmt: skip
        if self.recent_ratio is not None:
            knobs["recent_ratio"] = self.recent_ratio
        if self.observation_window is not None:
            knobs["window"] = self.observation_window
        if self.layer_schedule is not None:
            knobs["layer_schedule"] = self.layer_schedule
        if self.adakv_safeguard is not None:
            knobs["safeguard"] = self.adakv_safeguard
        return knobs

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the engine runs in (``auto`` resolved for this machine and device)."""
        return resolve_dtype(self.dtype, self.device)

    @property
    def kv_cache_bytes(self) -> int:
        return parse_memory_size(self.kv_cache_memory)

    @property
    def swap_space_bytes(self) -> int:
        return parse_memory_size(self.swap_space)

    @property
    def prompt_cache_bytes(self) -> int:
        return parse_memory_size(self.prompt_cache_memory)
