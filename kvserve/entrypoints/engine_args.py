"""Command-line options that build an ``EngineConfig``, shared by every command that runs the engine."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

from kvserve.config import (
    KV_CACHE_DTYPES,
    KV_OFFLOAD_MODES,
    KV_QUANT_DTYPES,
    POOL_EVICTIONS,
    PREEMPTION_MODES,
    PREFILL_PARTITIONS,
    PROMPT_CACHE_CONTEXTS,
    PROMPT_CACHE_ENCODES,
    PROMPT_CACHE_TIERS,
    EngineConfig,
)
from kvserve.kv.direct_tier import DISK_IO_MODES
from kvserve.models.dtype import DTYPE_NAMES
from kvserve.policies import KV_POLICY_NAMES
from kvserve.policies.infinigen import parse_alpha
from kvserve.policies.layer_schedule import LAYER_SCHEDULES


def add_kv_cache_dtype_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", *KV_CACHE_DTYPES, *KV_QUANT_DTYPES), default="auto",
        help="KV cache dtype; auto: the model's. bfloat16 or float16 halve a float32 model's cache and the bytes "
        "decode attention reads (the paged cache or a compressing policy's groups; not offloaded); int8 or int4 "
        "quantize the paged cache's rows (Hadamard-rotated, one float16 scale per token and KV head): about 2x and "
        "3.6x the sequences of a bfloat16 cache, and fewer bytes for long-context decode to read",
    )  # fmt: skip


def add_engine_args(parser: argparse.ArgumentParser, kv_cache_memory: str = "1GiB") -> None:
    """The paged engine's options (model, dtype, device and threads come from ``add_model_args``)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--kv-cache-memory", default=kv_cache_memory, help="device KV cache size, e.g. 2GiB")
    add_kv_cache_dtype_arg(group)
    group.add_argument("--swap-space", default="1GiB", help="host tier for preemption by swapping")
    group.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    group.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    group.add_argument(
        "--no-kv-window-groups", action="store_true",
        help="keep every layer's whole context, also in sliding-window layers (Gemma 3, Mistral), instead of "
        "KV groups that keep only the blocks a window sees",
    )  # fmt: skip
    group.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute")
    add_batch_invariant_arg(group)
    group.add_argument(
        "--prefill-parallel", type=int, default=1,
        help="processes for a prompt's prefill (KV-Runahead); the prompt must fit --max-num-batched-tokens",
    )  # fmt: skip
    group.add_argument(
        "--prefill-partition", choices=PREFILL_PARTITIONS, default=None,
        help="context split: even, searched (measured once per length), predicted (the table of "
        "`kvserve tune-runahead`; the default when it exists, else even) or tsp (the all-gather baseline)",
    )  # fmt: skip
    add_kv_policy_args(parser)
    add_prompt_cache_args(parser)
    add_tensor_parallel_args(parser)


def add_tensor_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Tensor parallelism over processes and machines (``parallel/tensor_group.py``)."""
    group = parser.add_argument_group("tensor parallelism (several processes or machines)")
    group.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="processes each layer's heads and MLP are split over: this one and N - 1 workers (default 1)",
    )  # fmt: skip
    group.add_argument("--nnodes", type=int, default=1, help="machines the ranks run on, as many ranks on each")
    group.add_argument(
        "--node-rank", type=int, default=0,
        help="this machine: 0 runs the engine (and serves); 1.. run only their workers, with the same command",
    )  # fmt: skip
    group.add_argument(
        "--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        help="address of node 0, where the ranks meet (default: $MASTER_ADDR or 127.0.0.1)",
    )  # fmt: skip
    group.add_argument(
        "--master-port", type=int, default=int(os.environ.get("MASTER_PORT", "0")),
        help="port on node 0 for the rendezvous (default: $MASTER_PORT; 0: a free one, one machine only)",
    )  # fmt: skip
    group.add_argument(
        "--tensor-parallel-timeout", type=float, default=60.0,
        help="seconds a step waits for a rank before the group is declared lost (default 60)",
    )  # fmt: skip


def tensor_parallel_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "tensor_parallel_size": args.tensor_parallel_size, "nnodes": args.nnodes, "node_rank": args.node_rank,
        "master_addr": args.master_addr, "master_port": args.master_port,
        "tensor_parallel_timeout": args.tensor_parallel_timeout,
    }  # fmt: skip


def run_worker_node(config: EngineConfig) -> int | None:
    """On a machine other than node 0 (``--node-rank`` > 0): run its tensor-parallel ranks until the engine
    stops them, and return the exit status; None on node 0, which runs the command itself."""
    if config.node_rank == 0:
        return None
    from kvserve.parallel.tensor_group import run_node

    return run_node(config)


def add_batch_invariant_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--batch-invariant", action="store_true",
        help="the same numerics for a sequence whatever runs beside it and whether its prefix came from the cache: "
        "one matmul kernel for every batch size, attention per query row (slower; see the README)",
    )  # fmt: skip


def add_prompt_cache_args(parser: argparse.ArgumentParser) -> None:
    """Prompt Cache (kvserve/prompt_cache): where module KV lives, how much of it, when it is encoded."""
    group = parser.add_argument_group("Prompt Cache")
    group.add_argument(
        "--prompt-cache-tier", choices=PROMPT_CACHE_TIERS, default="device",
        help="device: module KV in blocks of the KV cache; host: in CPU memory, copied in when a prompt uses it",
    )  # fmt: skip
    group.add_argument(
        "--prompt-cache-memory",
        default="512MiB",
        help="module KV kept at most, least recently used evicted (device tier: at most half of --kv-cache-memory)",
    )
    group.add_argument(
        "--prompt-cache-encode", choices=PROMPT_CACHE_ENCODES, default="eager",
        help="encode a schema's modules when it is registered (eager) or when a prompt first imports them (lazy)",
    )  # fmt: skip
    group.add_argument(
        "--prompt-cache-context", choices=PROMPT_CACHE_CONTEXTS, default="prefix",
        help="what a module attends to while encoded besides itself: the schema's text before its first module "
        "(prefix: BOS, system turn, as in the plain prompt) or nothing (none: Prompt Cache's rule)",
    )  # fmt: skip
    group.add_argument(
        "--prompt-cache-recompute", type=float, default=0.0, metavar="R",
        help="share in [0, 1] of a prompt's imported module tokens recomputed with attention across modules, "
        "those whose KV deviates most (CacheBlend); 0: none",
    )  # fmt: skip
    group.add_argument(
        "--prompt-cache-dir", default=None, metavar="DIR",
        help="folder where encoded modules are saved (checked against the model, dtype and KV layout); a restarted "
        "server loads them instead of encoding them again (created if missing; read-only: loaded, not written)",
    )  # fmt: skip


def add_schema_arg(parser: argparse.ArgumentParser) -> None:
    """``--schema FILE`` for the commands that take PML prompts (generate, serve)."""
    parser.add_argument(
        "--schema", action="append", default=[], metavar="FILE",
        help="PML schema file to register at start (repeatable); prompts starting with <prompt schema=...> use it",
    )  # fmt: skip


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """``--tokenizer`` and ``--chat-template``, instead of the model's own (generate, serve, eval)."""
    parser.add_argument(
        "--tokenizer", default=None, metavar="PATH",
        help="tokenizer to use instead of the model's: a Hugging Face folder, a tokenizer.json or a GGUF file "
        "(default: the model's)",
    )  # fmt: skip
    parser.add_argument(
        "--chat-template", default=None, metavar="FILE_OR_STRING",
        help="Jinja chat template instead of the model's: a file, or the template itself (default: the model's)",
    )  # fmt: skip


def prompt_cache_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "prompt_cache_tier": args.prompt_cache_tier, "prompt_cache_memory": args.prompt_cache_memory,
        "prompt_cache_encode": args.prompt_cache_encode, "prompt_cache_recompute": args.prompt_cache_recompute,
        "prompt_cache_context": args.prompt_cache_context, "prompt_cache_dir": args.prompt_cache_dir,
    }  # fmt: skip


def check_model_fit(config: EngineConfig) -> None:
    """Before the weights load: the rules that need the model's facts (a KV block within --kv-cache-memory,
    sliding-window layers), checked on its metadata with the plan the engine will make."""
    from kvserve.core.kv_plan import plan_kv
    from kvserve.models.loader import read_model_config

    plan_kv(config, read_model_config(config.model), config.torch_dtype)


def check_schemas(config: EngineConfig, paths: list[str]) -> None:
    """Before the model loads: ``--schema`` files need an engine that runs Prompt Cache, and must be readable."""
    refusal = config.prompt_cache_refusal() if paths else None
    if refusal:
        raise ValueError(f"--schema: {refusal}")
    for path in paths:
        _read_schema(path)


def _read_schema(path: str) -> str:
    from pathlib import Path

    try:
        return Path(path).expanduser().read_text()
    except OSError as exc:
        raise ValueError(f"cannot read schema file {path!r}: {exc.strerror}") from None


def register_schemas(engine: object, paths: list[str], namespace: str = "") -> None:
    """Register each PML schema file with ``engine`` (an ``LLMEngine``) in ``namespace``; errors name the file."""
    for path in paths:
        text = _read_schema(path)
        try:
            engine.register_schema(text, namespace)
        except ValueError as exc:
            raise ValueError(f"schema file {path}: {exc}") from None


def add_kv_policy_args(parser: argparse.ArgumentParser) -> None:
    """Which KV slots each layer keeps (kvserve/policies); every command that builds an engine takes these."""
    group = parser.add_argument_group("KV policy")
    group.add_argument(
        "--kv-policy", choices=KV_POLICY_NAMES, default="full",
        help="full (lossless, default), pyramid (PyramidInfer), local (sinks + recent window), h2o (heavy hitters), "
        "snapkv (per-head selection by an observation window), pyramidkv (snapkv with budgets falling by depth), "
        "adakv (snapkv with each KV head its own budget); "
        "any of those but full gives each layer its own KV blocks, and requests may then pick their own policy; "
        "with --kv-offload: full (fetch everything), int4 (fetch 4-bit KV) or infinigen (fetch predicted rows)",
    )  # fmt: skip
    group.add_argument(
        "--kv-budget", type=float, default=None, help="fraction of the full KV cache kept (default 0.5; full: 1)"
    )
    group.add_argument(
        "--recent-ratio", type=float, default=None,
        help="pyramid: recent-token share of a layer's budget; h2o: recent share (default: pyramid 0.4, h2o 0.5)",
    )  # fmt: skip
    group.add_argument(
        "--observation-window", type=int, default=None,
        help="snapkv/pyramidkv/adakv: the last queries of a prompt that vote, always kept (default 32)",
    )  # fmt: skip
    group.add_argument(
        "--adakv-safeguard", type=float, default=None,
        help="adakv: share of each KV head's even budget it keeps before the heads compete (default 0.2)",
    )  # fmt: skip
    group.add_argument(
        "--layer-schedule", choices=LAYER_SCHEDULES, default=None,
        help="how the budget spreads over layers: uniform, pyramidinfer (cosine, the pyramid default) or pyramidkv "
        "(linear, the pyramidkv default)",
    )  # fmt: skip

    offload = parser.add_argument_group("KV offloading (InfiniGen)")
    offload.add_argument(
        "--kv-offload", choices=KV_OFFLOAD_MODES, default="none",
        help="keep the full KV in host memory or a memory-mapped file (sized by --kv-cache-memory); the device "
        "reads per step what --kv-policy fetches",
    )  # fmt: skip
    offload.add_argument(
        "--kv-offload-path", default=None, help="disk tier: folder of the mapped file (default: the temp dir)"
    )
    offload.add_argument(
        "--kv-disk-io", choices=DISK_IO_MODES, default="mmap",
        help="disk tier: mmap (read through the page cache) or direct (O_DIRECT reads of whole blocks, from the "
        "device; InfiniGen then picks blocks by predicted attention mass)",
    )  # fmt: skip
    offload.add_argument("--infinigen-alpha", type=_alpha_arg, default="auto", metavar="auto|ALPHA",
                         help="fetch tokens whose speculated logit is within alpha of the best; auto (default): "
                         "each layer's alpha calibrated on the model (kvserve infinigen-setup)")  # fmt: skip
    offload.add_argument("--infinigen-partial-ratio", type=float, default=0.3,
                         help="share of skewed query/key dimensions the rehearsal uses (0.3)")  # fmt: skip
    offload.add_argument("--kv-pool-limit", type=float, default=1.0,
                         help="infinigen: slots per sequence, share of prompt + max_tokens")  # fmt: skip
    offload.add_argument("--kv-pool-eviction", choices=POOL_EVICTIONS, default="counter",
                         help="victim when the pool is full: counter (least selected), lru or fifo")  # fmt: skip


def _alpha_arg(text: str) -> str | float:
    try:
        return parse_alpha(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_policy_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "kv_policy": args.kv_policy, "kv_budget": args.kv_budget, "recent_ratio": args.recent_ratio,
        "observation_window": args.observation_window, "layer_schedule": args.layer_schedule,
        "adakv_safeguard": args.adakv_safeguard,
        "kv_offload": args.kv_offload, "kv_offload_path": args.kv_offload_path, "kv_disk_io": args.kv_disk_io,
        "infinigen_alpha": args.infinigen_alpha, "infinigen_partial_ratio": args.infinigen_partial_ratio,
        "kv_pool_limit": args.kv_pool_limit, "kv_pool_eviction": args.kv_pool_eviction,
    }  # fmt: skip


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, weights=args.weights,
        tokenizer=getattr(args, "tokenizer", None), chat_template=getattr(args, "chat_template", None),
        kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
        swap_space=args.swap_space, block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
        kv_window_groups=not args.no_kv_window_groups,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode, max_model_len=args.max_model_len,
        prefill_parallel=args.prefill_parallel, prefill_partition=args.prefill_partition,
        batch_invariant=args.batch_invariant, int8_activations=getattr(args, "int8_activations", False),
        **kv_policy_options(args), **prompt_cache_options(args),
        **tensor_parallel_options(args),
    )  # fmt: skip


def describe_config(config: EngineConfig) -> dict[str, object]:
    """The configuration as plain JSON data, for reports: ``dtype`` is the one that ran (``auto`` resolved)."""
    data = asdict(config)
    data["dtype"] = DTYPE_NAMES[config.torch_dtype]
    if config.dtype != data["dtype"]:
        data["dtype_requested"] = config.dtype
    return data
