"""The ``kvserve`` command: ``generate``, ``serve``, ``bench``, ``eval`` and ``kernels``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from kvserve import __version__
from kvserve.config import PREFILL_PARTITIONS, EngineConfig
from kvserve.entrypoints.cli_common import add_model_args, check_model_args, load_from_args
from kvserve.entrypoints.cli_parser import Parser
from kvserve.entrypoints.console import EngineStream, GenerationSummary, print_stream
from kvserve.entrypoints.engine_args import (
    add_batch_invariant_arg,
    add_kv_cache_dtype_arg,
    add_kv_policy_args,
    add_prompt_cache_args,
    add_schema_arg,
    add_tensor_parallel_args,
    add_tokenizer_args,
    check_model_fit,
    check_schemas,
    run_worker_node,
)
from kvserve.entrypoints.generation import Generator
from kvserve.errors import KVServeError
from kvserve.log import get_logger
from kvserve.models.dtype import resolve_dtype_name
from kvserve.models.loader import LoadedModel
from kvserve.policies.calibration import ThresholdCalibration
from kvserve.policies.infinigen import InfiniGen, speculated_layers
from kvserve.sampling.sampling_params import SamplingParams


def cmd_generate(args: argparse.Namespace) -> int:
    params, prompt = _generate_request(args)
    config = _engine_config(args)  # every engine flag checked before the model loads, also where the Generator runs
    node = run_worker_node(config)
    if node is not None:
        return node
    check_schemas(config, args.schema)
    check_model_fit(config)
    loaded = load_from_args(args)
    # The whole prompt in one parallel step.
    config = dataclasses.replace(config, max_num_batched_tokens=loaded.config.max_position_embeddings)
    if args.chat:
        prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    # The batch-invariant mode runs the engine too, so that the text is what a server in that mode gives.
    engine_only = args.prefill_parallel > 1 or args.kv_policy != "full" or args.kv_offload != "none"
    engine_only = engine_only or args.batch_invariant or args.tensor_parallel_size > 1
    echo = args.prompt if args.echo and not args.chat and args.pml_prompt is None else ""
    if engine_only and not args.schema and args.nnodes == 1:  # a Prompt Cache keeps its modules in the pool
        config = _sized_for(config, loaded, prompt, args.max_tokens)
    if engine_only or args.pml_prompt is not None:
        with EngineStream(loaded, config, args.schema, prompt, params) as stream:  # its log lines before the text
            print_stream(stream, echo, sys.stdout)
        summary = stream.summary()
    else:
        stream = Generator(loaded, args.device).stream(prompt, params)
        print_stream(stream, echo, sys.stdout)
        summary = GenerationSummary.of_generation(stream.output)
    if args.summary:
        get_logger().info(summary.line())
    return 0


def _sized_for(config: EngineConfig, loaded: LoadedModel, prompt: str | list[int], max_tokens: int) -> EngineConfig:
    """The engine's KV pool sized for this one request (its prompt and ``max_tokens``), not the server's 1 GiB."""
    from kvserve.core.kv_plan import one_request_config

    num_tokens = len(prompt) if isinstance(prompt, list) else len(loaded.tokenizer.encode(prompt))
    num_tokens = min(num_tokens + max_tokens, loaded.config.max_position_embeddings)
    return one_request_config(config, loaded.config, loaded.dtype, num_tokens)


def _generate_request(args: argparse.Namespace) -> tuple[SamplingParams, str]:
    """The sampling parameters and the prompt of ``generate``, checked before the model loads."""
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or [],
    )
    if (args.prompt is None) == (args.pml_prompt is None):
        raise ValueError("give a prompt, or --pml-prompt with --schema, not both")
    if args.pml_prompt is not None and not args.schema:
        raise ValueError("--pml-prompt needs the schema it imports from: --schema FILE")
    return params, args.prompt if args.pml_prompt is None else args.pml_prompt


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options of ``generate`` (validated on construction)."""
    from kvserve.entrypoints.engine_args import kv_policy_options, prompt_cache_options, tensor_parallel_options

    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, weights=args.weights,
        tokenizer=args.tokenizer, chat_template=args.chat_template,
        prefill_parallel=args.prefill_parallel, prefill_partition=args.prefill_partition,
        batch_invariant=args.batch_invariant, int8_activations=args.int8_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        **kv_policy_options(args), **prompt_cache_options(args), **tensor_parallel_options(args),
    )  # fmt: skip


def cmd_prefill_worker(args: argparse.Namespace) -> int:
    from kvserve.parallel.remote import serve_worker

    return serve_worker(load_from_args(args).model, args.timeout)


def cmd_tune_runahead(args: argparse.Namespace) -> int:
    from kvserve.parallel.partition import default_table_path
    from kvserve.parallel.tune import default_lengths, tune_runahead

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else default_lengths(args.max_context)
    output = Path(args.output).expanduser() if args.output else default_table_path()
    loaded = load_from_args(args)
    print(f"tune-runahead: {loaded.path.name}, p={args.prefill_parallel}, lengths {lengths}", file=sys.stderr)
    tune_runahead(loaded, args.weights, args.prefill_parallel, lengths, output, args.step,
                  log=lambda line: print(line, file=sys.stderr))  # fmt: skip
    return 0


def cmd_infinigen_setup(args: argparse.Namespace) -> int:
    from kvserve.policies.skewing import skewing_for

    target = ThresholdCalibration(  # raises on a bad value
        args.calibration_mass, args.calibration_quantile, args.calibration_window_mass
    )
    InfiniGen(partial_ratio=args.partial_ratio)  # raises on a bad ratio, before the model loads
    loaded = load_from_args(args)
    directory = Path(args.output).expanduser() if args.output else None
    dims = InfiniGen(partial_ratio=args.partial_ratio).partial_dims(loaded.config.head_dim)
    skewing, file = skewing_for(loaded, directory, refresh=args.refresh, partial_dims=dims, target=target)
    layers, heads, dim = skewing.ranking.shape
    windows = loaded.config.layer_windows
    first = min(speculated_layers(windows))  # a full-attention layer 0 reads everything: no alpha
    alphas = " ".join(f"{a:.2f}" for a in skewing.alphas[dims][first:])
    print(f"infinigen-setup: {loaded.path.name}: alpha auto, layers {first}-{layers - 1} ({dims} of {dim} partial "
          f"dims; keeps {target.describe(windows)}): {alphas}")  # fmt: skip
    print(f"infinigen-setup: {loaded.path.name}: skewing for {layers} layers x {heads} KV heads (head dim {dim}) "
          f"in {file}")  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvserve", description="KV-cache-centred LLM inference engine")
    parser.add_argument("--version", action="version", version=f"kvserve {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a continuation of a prompt, streamed to the terminal")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (or --pml-prompt)")
    gen.add_argument("--pml-prompt", default=None, help="a Prompt Cache prompt, <prompt schema=...>, over --schema")
    add_model_args(gen)
    add_tokenizer_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-echo", dest="echo", action="store_false", help="print only the generated text, not the "
                     "prompt before it (a --chat or --pml-prompt prompt is never echoed)")  # fmt: skip
    gen.add_argument("--no-summary", dest="summary", action="store_false",
                     help="no summary line (tokens, TTFT, tokens/s) on stderr after the text")  # fmt: skip
    gen.add_argument("--prefill-parallel", type=int, default=1, help="processes for the prompt's prefill (KV-Runahead)")
    gen.add_argument("--prefill-partition", choices=PREFILL_PARTITIONS, default=None,
                     help="even, searched, predicted (default when a table exists) or tsp")  # fmt: skip
    add_batch_invariant_arg(gen)
    add_kv_cache_dtype_arg(gen)
    add_kv_policy_args(gen)
    add_prompt_cache_args(gen)
    add_tensor_parallel_args(gen)
    add_schema_arg(gen)
    gen.set_defaults(func=cmd_generate)

    tune = sub.add_parser("tune-runahead", help="search KV-Runahead partitions on this machine and save the table")
    add_model_args(tune)
    tune.add_argument("--max-context", type=int, required=True, help="longest prompt to tune for (tokens)")
    tune.add_argument("--prefill-parallel", type=int, default=2, help="processes (this one + workers)")
    tune.add_argument("--lengths", default=None, help="comma-separated context lengths (default: 512, 1024, ... "
                      "up to --max-context)")  # fmt: skip
    tune.add_argument("--step", type=int, default=64, help="partition boundaries are multiples of this")
    tune.add_argument("--output", default=None, help="table file (default: $KVSERVE_RUNAHEAD_TABLE or "
                      "~/.cache/kvserve/runahead-table.json, which engines load)")  # fmt: skip
    tune.set_defaults(func=cmd_tune_runahead)

    setup = sub.add_parser(
        "infinigen-setup", help="compute InfiniGen's skewing matrices for a model and cache them (engines with "
        "--kv-policy infinigen otherwise do it on first use)",
    )  # fmt: skip
    add_model_args(setup)
    setup.add_argument("--output", default=None, help="folder (default: $KVSERVE_INFINIGEN_DIR or "
                       "~/.cache/kvserve/infinigen)")  # fmt: skip
    setup.add_argument("--refresh", action="store_true", help="recompute even if a cached file exists")
    setup.add_argument("--partial-ratio", type=float, default=InfiniGen.partial_ratio,
                       help="calibrate alpha auto for this --infinigen-partial-ratio (%(default)s; engines calibrate "
                       "another one on first use)")  # fmt: skip
    setup.add_argument("--calibration-mass", type=float, default=ThresholdCalibration.mass,
                       help="share of a row's attention the selection keeps (%(default)s)")  # fmt: skip
    setup.add_argument("--calibration-quantile", type=float, default=ThresholdCalibration.quantile,
                       help="share of the sample's rows that keep it (%(default)s)")  # fmt: skip
    setup.add_argument("--calibration-window-mass", type=float, default=ThresholdCalibration.window_mass,
                       help="--calibration-mass in sliding-window layers (%(default)s)")  # fmt: skip
    setup.set_defaults(func=cmd_infinigen_setup)

    worker = sub.add_parser(
        "prefill-worker", help="a parallel prefill worker joining a group torchrun-style (RANK, WORLD_SIZE, "
        "MASTER_ADDR, MASTER_PORT); the engine is the last rank",
    )  # fmt: skip
    add_model_args(worker)
    worker.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a KV message mid-prefill")
    worker.set_defaults(func=cmd_prefill_worker)

    from kvserve.bench.cli import add_bench_parser
    from kvserve.entrypoints.kernels_cli import add_kernels_parser
    from kvserve.eval.cli import add_eval_parser
    from kvserve.server.cli import add_serve_parser

    add_serve_parser(sub, add_model_args)
    add_bench_parser(sub, add_model_args)
    add_eval_parser(sub, add_model_args)
    add_kernels_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "device", None) is not None:  # the commands that load a model
            check_model_args(args)
        if getattr(args, "dtype", None) is not None:  # every report, log and file name shows the dtype that runs
            args.dtype = resolve_dtype_name(args.dtype, args.device)
        return args.func(args)
    except (KVServeError, ValueError) as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
