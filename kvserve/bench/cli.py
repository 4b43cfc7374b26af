"""``kvserve bench ...`` subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from kvserve.bench.latency import KVServeEngine, TransformersEngine, measure
from kvserve.bench.prefill import METHODS as PREFILL_METHODS
from kvserve.bench.report import new_report, write_report
from kvserve.bench.results_dir import add_output_arg, output_path
from kvserve.bench.workload import AUSTEN
from kvserve.config import PREEMPTION_MODES
from kvserve.entrypoints.engine_args import add_kv_policy_args, kv_policy_options
from kvserve.errors import KVServeError
from kvserve.models import gguf_file
from kvserve.models.catalog import default_model_path, resolve_model_path
from kvserve.models.dtype import resolve_dtype
from kvserve.platform.extras import extra_imports
from kvserve.text.tokenizer import Tokenizer


def add_bench_parser(sub: argparse._SubParsersAction, add_model_args: Callable) -> None:
    bench = sub.add_parser("bench", help="benchmarks against a peer engine")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    lat = bench_sub.add_parser("latency", help="load, prefill and batch-1 decode: kvserve vs transformers")
    add_model_args(lat)
    lat.add_argument("--prefill-lengths", default="512,2048", help="comma-separated prompt lengths")
    lat.add_argument("--decode-tokens", type=int, default=128)
    lat.add_argument("--repeats", type=int, default=3)
    lat.add_argument("--text", default=str(AUSTEN), help="text file the prompts are cut from")
    lat.add_argument("--no-peer", action="store_true", help="measure kvserve only")
    add_output_arg(lat, "latency", "latency-DTYPE", "OUTPUT.json/.md")
    lat.set_defaults(func=cmd_bench_latency)

    spd = bench_sub.add_parser(
        "speed", help="CPU speed on one GGUF: kvserve vs llama.cpp (and transformers), with roofline fractions"
    )
    add_model_args(spd)
    spd.add_argument("--peers", default="llamacpp,transformers", help="comma-separated: llamacpp, transformers")
    spd.add_argument("--llamacpp-python", default=None, help="interpreter with llama_cpp (default: this one)")
    spd.add_argument("--prefill-lengths", default="512,2048", help="comma-separated prompt lengths")
    spd.add_argument("--decode-tokens", type=int, default=128, help="batch-1 decode: tokens timed")
    spd.add_argument(
        "--long-decode-contexts", default="4096", help="comma-separated: batch-1 decode also after this many tokens"
    )
    spd.add_argument("--batch-sizes", default="8,32", help="comma-separated numbers of concurrent sequences")
    spd.add_argument("--batch-prompt-tokens", type=int, default=64, help="prompt length of each concurrent sequence")
    spd.add_argument("--batch-new-tokens", type=int, default=128, help="tokens each concurrent sequence produces")
    spd.add_argument("--repeats", type=int, default=3)
    spd.add_argument(
        "--kv-cache-dtype", default="auto",
        help="comma-separated KV cache dtypes (auto, float32, bfloat16, float16): kvserve runs once per entry, the "
        "first is the one the ratio rows compare",
    )  # fmt: skip
    spd.add_argument(
        "--batch-invariant", action="store_true",
        help="also run kvserve in the batch-invariant mode, after the default: its cost is the ratio row",
    )  # fmt: skip
    spd.add_argument(
        "--n-ctx", type=int, default=0,
        help="llama.cpp's n_ctx, one KV pool shared by all sequences, and kvserve's KV memory sized to hold as many "
        "tokens with no swap space (comparable memory); 0: llama.cpp a stream per sequence, kvserve's defaults",
    )  # fmt: skip
    spd.add_argument("--kv-cache-memory", default=None, help="kvserve's KV memory (default: --n-ctx's, or 1GiB)")
    spd.add_argument("--swap-space", default=None, help="kvserve's host tier for swapping (default: 0 with --n-ctx)")
    spd.add_argument(
        "--in-process", action="store_true",
        help="run kvserve in this process (no peak resident set of its own) instead of a worker process",
    )  # fmt: skip
    add_output_arg(spd, "speed", "speed-WEIGHTS")
    spd.set_defaults(func=cmd_bench_speed)

    tp = bench_sub.add_parser(
        "tensor-parallel", help="step time and all-reduce cost of tensor parallelism at sizes 1..N, with a projection"
    )
    add_model_args(tp)
    tp.add_argument("--models", default="smollm2-135m,gemma3-270m", help="comma-separated (each in its own run)")
    tp.add_argument("--sizes", default="1,2,3", help="comma-separated tensor-parallel sizes")
    tp.add_argument("--prompt-tokens", type=int, default=512, help="the prefill's prompt length")
    tp.add_argument("--batch", type=int, default=8, help="sequences of the batched decode")
    tp.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per repeat")
    tp.add_argument("--repeats", type=int, default=3)
    add_output_arg(tp, "tensor-parallel", "tensor-parallel-DTYPE")
    tp.set_defaults(func=cmd_bench_tensor_parallel)

    pfl = bench_sub.add_parser(
        "prefill", help="TTFT of long prompts: single process vs KV-Runahead (even/searched/predicted) vs TSP"
    )
    add_model_args(pfl)
    pfl.add_argument("--prefill-parallel", type=int, default=2, help="processes for the parallel methods")
    pfl.add_argument("--lengths", default="1000,2000,4000,8000", help="comma-separated prompt lengths (tokens)")
    pfl.add_argument("--methods", default=",".join(PREFILL_METHODS), help=f"comma-separated: {PREFILL_METHODS}")
    pfl.add_argument("--repeats", type=int, default=3)
    pfl.add_argument("--table", default=None, help="KVR-P table (default: the engine's; built first if missing)")
    add_output_arg(pfl, "prefill", "prefill-pP")
    pfl.set_defaults(func=cmd_bench_prefill)

    thr = bench_sub.add_parser("throughput", help="replayed Azure trace: paged engine vs transformers static batches")
    add_model_args(thr)
    thr.add_argument("--num-requests", type=int, default=64, help="first N requests of the trace")
    thr.add_argument("--scale", type=float, default=4.0, help="divide the trace's token counts by this")
    thr.add_argument("--hf-batch-size", type=int, default=8, help="transformers static batch size")
    thr.add_argument("--kv-cache-memory", default="2GiB")
    thr.add_argument("--max-num-seqs", type=int, default=64)
    thr.add_argument("--max-num-batched-tokens", type=int, default=2048)
    thr.add_argument("--batch-sizes", default="1,4,16,64", help="decode-scaling batch sizes")
    thr.add_argument("--decode-tokens", type=int, default=32, help="tokens per request in the decode-scaling runs")
    thr.add_argument("--no-peer", action="store_true", help="measure kvserve only")
    add_kv_policy_args(thr)  # e.g. --kv-offload host --kv-policy infinigen
    add_output_arg(thr, "throughput", "throughput-DTYPE")
    thr.set_defaults(func=cmd_bench_throughput)

    pre = bench_sub.add_parser("prefix", help="requests sharing a long system prompt: prefix caching on vs off")
    add_model_args(pre)
    pre.add_argument("--num-requests", type=int, default=32)
    pre.add_argument("--shared-tokens", type=int, default=1500, help="length of the shared system prompt")
    pre.add_argument("--max-tokens", type=int, default=16)
    pre.add_argument("--kv-cache-memory", default="2GiB")
    add_output_arg(pre, "prefix", "prefix-DTYPE", "OUTPUT.json/.md")
    pre.set_defaults(func=cmd_bench_prefix)

    cmp = bench_sub.add_parser(
        "compression", help="KV policies at a fixed KV memory: KV per sequence, peak batch, throughput"
    )
    add_model_args(cmp)
    cmp.add_argument("--policies", default="full,pyramid,h2o", help="comma-separated, full first (the baseline)")
    cmp.add_argument("--kv-budget", type=_budgets, default=(0.5,),
                     help="budget of every compressing policy, or several (comma-separated): one run each")  # fmt: skip
    cmp.add_argument("--kv-cache-memory", default="400MiB", help="the same KV memory for every policy")
    cmp.add_argument("--num-requests", type=int, default=32)
    cmp.add_argument("--prompt-tokens", default="1024,2048", help="prompt lengths drawn uniformly from MIN,MAX")
    cmp.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    cmp.add_argument("--max-num-seqs", type=int, default=128)
    cmp.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute",
                     help="how a sequence that outgrows the pool gives way: its prompt recomputed later, or its blocks "
                     "swapped to host memory")  # fmt: skip
    add_output_arg(cmp, "compression", "efficiency")
    cmp.set_defaults(func=cmd_bench_compression)

    off = bench_sub.add_parser(
        "offload", help="decode with offloaded KV: InfiniGen vs fetch-everything vs INT4 vs H2O, latency and bytes"
    )
    add_model_args(off)
    off.add_argument("--contexts", default="2048,4096,8000", help="prompt lengths in tokens (below the context)")
    off.add_argument("--batches", default="8,4,1", help="batch sizes (the first prefills the prompts)")
    off.add_argument("--policies", default="full,infinigen,int4,h2o", help="comma-separated; h2o is not offloaded")
    off.add_argument("--tiers", default="host,disk",
                     help="slower tiers: host, disk (memory-mapped), disk-direct (O_DIRECT reads of whole blocks; "
                     "InfiniGen picks blocks); or 'device' alone: the workload 'sparse decode by context length' "
                     "(no offload; full attention against InfiniGen's sparse decode, batch 1, their steps alternating; "
                     "--policies and --batches do not apply)")  # fmt: skip
    off.add_argument("--window-layers", default="device",
                     help="sliding-window models (Gemma 2/3): where window layers keep their KV, comma-separated: "
                     "device (window groups on the device, only the global layers in the tier), tier (every "
                     "layer's whole context in the tier, --no-kv-window-groups); cells of 'tier' are named "
                     "'<tier>/all-layers'")  # fmt: skip
    off.add_argument("--steps", type=int, default=8, help="measured decode steps per cell")
    off.add_argument("--kv-cache-memory", default="4GiB", help="the slower tier's size")
    off.add_argument("--kv-offload-path", default=None, help="disk tier folder (default: the temp dir)")
    off.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a disk-direct page)")
    add_output_arg(off, "offload", "decode")
    off.set_defaults(func=cmd_bench_offload)

    pc = bench_sub.add_parser(
        "prompt-cache", help="time to first token: Prompt Cache (device, host) vs no cache vs prefix caching"
    )
    add_model_args(pc)
    pc.add_argument("--lengths", default="1024,2048,4096,8000", help="document lengths in tokens")
    pc.add_argument("--questions", type=int, default=3, help="measured questions per length (one more warms up)")
    pc.add_argument("--kv-cache-memory", default="1GiB", help="KV cache of each engine")
    pc.add_argument(
        "--layout", choices=("prefix", "behind-parameter", "modules"), default="prefix",
        help="prefix: the document leads every prompt; behind-parameter: a per-request reader name comes first; "
        "modules: the document cut into 4 modules, each encoded alone",
    )  # fmt: skip
    pc.add_argument(
        "--prompt-cache-recompute",
        type=float,
        default=0.0,
        metavar="R",
        help="also time Prompt Cache recomputing this share of the module tokens (CacheBlend); 0: not timed",
    )
    add_output_arg(pc, "prompt-cache", "ttft or ttft-behind-parameter")
    pc.set_defaults(func=cmd_bench_prompt_cache)

    win = bench_sub.add_parser(
        "window", help="sliding-window KV groups vs every layer full: KV per sequence, sequences in one KV memory"
    )
    add_model_args(win)
    win.set_defaults(model="gemma3-270m", dtype="bfloat16", threads=2, func=cmd_bench_window)
    win.add_argument("--context", type=int, default=8192, help="part 1: tokens of the long sequence (prompt + new)")
    win.add_argument("--context-new-tokens", type=int, default=16, help="part 1: tokens it generates")
    win.add_argument("--prefill-chunk", type=int, default=2048, help="part 1: max_num_batched_tokens")
    win.add_argument("--seq-tokens", type=int, default=4096, help="part 2: tokens of each sequence (prompt + new)")
    win.add_argument("--max-tokens", type=int, default=32, help="part 2: tokens each sequence generates")
    win.add_argument("--kv-cache-memory", default="1GiB", help="KV memory of every engine")
    win.add_argument("--max-num-batched-tokens", type=int, default=8192, help="part 2: tokens a step computes")
    win.add_argument("--max-num-seqs", type=int, default=256, help="part 2: the scheduler's sequence limit")
    win.add_argument("--max-sequences", type=int, default=64, help="part 2: at most this many requests")
    win.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    add_output_arg(win, "window", "window")

    kvc = bench_sub.add_parser(
        "kv-cache", help="KV cache dtypes (auto, int8, int4): bytes per token, sequences per GiB, decode speed by "
        "context, perplexity and greedy agreement (llama.cpp's quantized KV beside)",
    )  # fmt: skip
    add_model_args(kvc)
    kvc.set_defaults(threads=2, func=cmd_bench_kv_cache)
    kvc.add_argument("--kv-cache-dtypes", default="auto,int8,int4",
                     help="comma-separated kv_cache_dtype values; ratios and agreement are against auto "
                     "(else the first)")  # fmt: skip
    kvc.add_argument("--seq-len", type=int, default=4096, help="capacity: tokens of each sequence")
    kvc.add_argument("--kv-cache-memory", default="1GiB", help="capacity: the KV memory the plan fits sequences in")
    kvc.add_argument("--check-sequences", type=int, default=3,
                     help="capacity check: its KV memory holds this many sequences of the auto cache")  # fmt: skip
    kvc.add_argument("--check-kv-cache-memory", default=None, help="capacity check: this KV memory instead")
    kvc.add_argument("--check-max-requests", type=int, default=64, help="capacity check: at most this many requests")
    kvc.add_argument("--contexts", default="1024,4096,8192", help="decode speed: comma-separated context lengths")
    kvc.add_argument("--batch-sizes", default="1,8", help="decode speed: comma-separated numbers of sequences")
    kvc.add_argument("--decode-tokens", type=int, default=32, help="decode speed: tokens timed per sequence")
    kvc.add_argument("--prefill-chunk", type=int, default=2048, help="decode speed: max_num_batched_tokens")
    kvc.add_argument("--ppl-tokens", type=int, default=16384, help="accuracy: WikiText-2 tokens scored")
    kvc.add_argument("--ppl-context", type=int, default=1024, help="accuracy: perplexity window")
    kvc.add_argument("--ppl-stride", type=int, default=512, help="accuracy: perplexity stride")
    kvc.add_argument("--ppl-chunk", type=int, default=256,
                     help="accuracy: max_num_batched_tokens, so a window's later chunks read the cache")  # fmt: skip
    kvc.add_argument("--agreement-prompts", type=int, default=20, help="accuracy: prompts of the greedy agreement")
    kvc.add_argument("--agreement-tokens", type=int, default=64, help="accuracy: greedy tokens per prompt")
    kvc.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    kvc.add_argument("--peers", default="", help="comma-separated: llamacpp (default: none)")
    kvc.add_argument("--llamacpp-python", default=None, help="interpreter with llama_cpp (default: this one)")
    kvc.add_argument("--skip-capacity", action="store_true", help="leave out bytes per token and sequences")
    kvc.add_argument("--skip-speed", action="store_true", help="leave out decode speed (and the peer)")
    kvc.add_argument("--skip-accuracy", action="store_true", help="leave out perplexity and agreement")
    add_output_arg(kvc, "kv-cache", "kv-cache-MODEL")

    srv = bench_sub.add_parser("serve", help="load generator against any OpenAI-compatible server (streaming)")
    srv.add_argument("--base-url", required=True, help="the server's API root, e.g. http://127.0.0.1:8000/v1")
    srv.add_argument("--model", default=None, help="model name to request (default: the first in GET /models)")
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    srv.add_argument("--num-requests", type=int, default=64)
    srv.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second, or inf")
    srv.add_argument("--sweep-rates", default=None, help="comma-separated rates (e.g. 1,2,4,inf); draws a PNG")
    srv.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    srv.add_argument("--workload", choices=["azure", "synthetic"], default="azure")
    srv.add_argument("--scale", type=float, default=4.0, help="azure: divide the trace's token counts by this")
    srv.add_argument("--input-len", type=int, default=256, help="synthetic: prompt tokens")
    srv.add_argument("--output-len", type=int, default=128, help="synthetic: output tokens")
    srv.add_argument("--max-model-len", type=int, default=2048, help="azure: clamp prompt + output to this")
    srv.add_argument("--tokenizer", default=None, help="GGUF or HF folder whose tokenizer builds the prompts "
                     "(default: SmolLM2-135M-Instruct)")  # fmt: skip
    srv.add_argument("--seed", type=int, default=0, help="prompt offsets and arrival times")
    srv.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    srv.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    srv.add_argument("--label", default=None, help="name of the server under test (default: the model name)")
    srv.add_argument("--compare-with", action="append", default=[], metavar="REPORT.json",
                     help="another server's `bench serve` report to draw in the same PNG (repeatable)")  # fmt: skip
    add_output_arg(srv, "serve", "serve-LABEL", "OUTPUT.json/.md(/.png)")
    srv.set_defaults(func=cmd_bench_serve)

    soak = bench_sub.add_parser(
        "soak", help="minutes of mixed, partly hostile traffic against kvserve serve on loopback (robustness)"
    )
    soak.add_argument("--model", default=None, help="GGUF file, Hugging Face folder or catalog name (default model)")
    soak.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default: 600)")
    soak.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests")
    soak.add_argument("--concurrency", type=int, default=8, help="clients sending at once (default: 8)")
    soak.add_argument("--prefill-parallel", type=int, default=2, help="the server's prefill processes (default: 2)")
    soak.add_argument("--kill-worker-at", type=float, default=0.5,
                      help="SIGKILL a prefill worker at this fraction of the duration; negative: never")  # fmt: skip
    soak.add_argument("--max-request-bytes", type=int, default=1 << 20, help="the server's body limit (default: 1 MiB)")
    soak.add_argument("--threads", type=int, default=None, help="the server's torch threads")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument(
        "--chaos", action="store_true",
        help="inject I/O faults at the tiers (swap, disk tier, module directory), preempt to swap, persist Prompt "
        "Cache modules, restart the server mid-way, and let clients hang up",
    )  # fmt: skip
    soak.add_argument("--restart-at", type=float, default=0.5,
                      help="--chaos: restart the server at this fraction of the duration; negative: never")  # fmt: skip
    soak.add_argument("--faults", default=None, metavar="SPEC",
                      help="--chaos: the server's KVSERVE_FAULTS, e.g. 'swap=0.05,module-dir-write=0.3:ENOSPC' "
                      "(default: every point, see kvserve/bench/soak.py)")  # fmt: skip
    soak.add_argument("--server-args", default="", help="more arguments for kvserve serve, in one string")
    add_output_arg(soak, "soak", "soak")
    soak.set_defaults(func=cmd_bench_soak)

    st = bench_sub.add_parser(
        "structured", help="JSON-schema requests with and without guided decoding: validity and the mask's cost"
    )
    add_model_args(st)
    st.add_argument("--num-prompts", type=int, default=50, help="prompts asking for JSON matching a schema")
    st.add_argument("--max-tokens", type=int, default=128)
    st.add_argument("--kv-cache-memory", default="1GiB")
    add_output_arg(st, "structured", "structured", "OUTPUT.json/.md")
    st.set_defaults(func=cmd_bench_structured)


def cmd_bench_latency(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, args.device)
    lengths = [int(x) for x in args.prefill_lengths.split(",")]
    text_path = Path(args.text)
    if not text_path.is_file():
        raise ValueError(f"--text {text_path} does not exist")
    model_path = resolve_model_path(args.model)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    kv = KVServeEngine(str(model_path), dtype, args.weights)  # also provides the tokenizer for the prompt
    prompt_ids = _prompt_ids(kv.loaded.tokenizer, text_path, max(lengths))
    del kv
    log(f"bench latency: {model_path.name}, {args.dtype}, {torch.get_num_threads()} threads")
    engines = [lambda: KVServeEngine(str(model_path), dtype, args.weights)]
    if not args.no_peer:
        engines.append(lambda: TransformersEngine(model_path, dtype))
    results = [measure(make, prompt_ids, lengths, args.decode_tokens, args.repeats, log) for make in engines]

    report = new_report(
        "latency", model=model_path.name, dtype=args.dtype, weights=args.weights, results=[asdict(r) for r in results]
    )
    write_report(output_path(args, f"latency-{args.dtype}"), report, _markdown_table(report))
    return 0


def _prompt_ids(tokenizer: Tokenizer, text_path: Path, length: int) -> list[int]:
    text = text_path.read_text(errors="replace")[: length * 8]
    ids = tokenizer.encode(text)
    if len(ids) < length:
        raise ValueError(f"{text_path} gives only {len(ids)} tokens, the benchmark needs {length}")
    return ids[:length]


def _markdown_table(report: dict) -> str:
    results = report["results"]
    m = report["machine"]
    lines = [
        f"# Latency: {report['model']}, {report['dtype']}",
        "",
        f"`{report['command']}` on {report['date']}: {m['cpu']}, {m['nproc']} CPUs, {m['memory_gib']} GiB, "
        f"torch {m['torch']} ({m['cpu_capability']}), {m['torch_threads']} threads.",
        "",
        "| engine | load (s) | "
        + " | ".join(f"prefill {n} (ms)" for n in results[0]["prefill_s"])
        + " | decode (tok/s) |",
        "| --- | ---: | " + " | ".join("---:" for _ in results[0]["prefill_s"]) + " | ---: |",
    ]
    for r in results:
        prefill = " | ".join(f"{s * 1000:.0f}" for s in r["prefill_s"].values())
        lines.append(f"| {r['engine']} | {r['load_s']:.2f} | {prefill} | {r['decode_tokens_per_s']:.1f} |")
    if len(results) == 2:
        ours, peer = results
        ratios = " | ".join(f"{peer['prefill_s'][n] / ours['prefill_s'][n]:.2f}x" for n in ours["prefill_s"])
        lines.append(
            f"| **kvserve speed-up** | {peer['load_s'] / ours['load_s']:.2f}x | {ratios} | "
            f"{ours['decode_tokens_per_s'] / peer['decode_tokens_per_s']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def cmd_bench_tensor_parallel(args: argparse.Namespace) -> int:
    from kvserve.bench import tensor_parallel as tp
    from kvserve.bench.plots import plot_tensor_parallel
    from kvserve.entrypoints.llm import LLM
    from kvserve.models.loader import read_model_config
    from kvserve.models.sharding import check_shardable

    def log(line: str) -> None:
        print(f"bench tensor-parallel: {line}", file=sys.stderr, flush=True)

    sizes = [int(n) for n in args.sizes.split(",")]
    dtype = resolve_dtype(args.dtype, args.device)
    models = {}
    for name in [m for m in args.models.split(",") if m]:
        config = read_model_config(name)

        def refusal(size: int, config=config) -> str | None:  # noqa: ANN001 - bound per model
            try:
                check_shardable(config, size, int4=args.weights != "dequant" and dtype == torch.bfloat16)
            except KVServeError as exc:
                return str(exc)
            return None

        def make_llm(size: int, name=name) -> LLM:  # noqa: ANN001 - bound per model
            return LLM(
                name, tensor_parallel_size=size, dtype=args.dtype, device=args.device, weights=args.weights,
                enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.prompt_tokens),
                max_num_seqs=max(64, args.batch),
            )  # fmt: skip

        tokenizer = _load_tokenizer(resolve_model_path(name))
        prompt = _prompt_ids(tokenizer, Path(AUSTEN), args.prompt_tokens)
        log(f"{name}: {config.num_heads} query heads, {config.num_kv_heads} KV heads, sizes {sizes}")
        result = tp.run(make_llm, sizes, refusal, prompt, args.batch, args.decode_steps, args.repeats, log)
        result["parameters"] = tp.parameter_count(config)
        result["projection"] = tp.projection(result, result["parameters"])
        large = tp.LARGE_MODEL
        scale = (large["hidden"] / config.hidden_size, large["layers"] / config.num_layers)
        result["projection_large"] = tp.projection(result, int(large["parameters"]), scale)
        models[name] = result
    # What ran: GGUF Q4 weights run as int4 only with bfloat16 activations on CPU.
    weights = args.weights if dtype == torch.bfloat16 and args.device == "cpu" else "dequant"
    report = new_report(
        "tensor-parallel", dtype=str(dtype).removeprefix("torch."), weights=weights, sizes=sizes,
        prompt_tokens=args.prompt_tokens, batch=args.batch, links=tp.LINKS, large_model=tp.LARGE_MODEL,
        models=models,
    )  # fmt: skip
    out = output_path(args, f"tensor-parallel-{report['dtype']}")
    write_report(out, report, _tensor_parallel_table(report))
    plot_tensor_parallel(report, out.with_suffix(".png"))
    return 0


def _tensor_parallel_table(report: dict) -> str:
    from kvserve.platform.machine import machine_line

    lines = [
        f"# Tensor parallelism: step time and all-reduce cost ({report['dtype']}, weights {report['weights']})",
        "",
        f"`{report['command']}` on {report['date']}: {machine_line(report['machine'])}. Each size shares the "
        "machine's cores among its processes (size 1: all of them). All-reduce figures are rank 0's: time inside "
        "the all-reduces (waiting for the slowest rank included), calls and float32 payload bytes per step.",
        "",
    ]
    for model, result in report["models"].items():
        lines += [f"## {model}", "",
                  "| size | phase | step (ms) | vs size 1 | all-reduce (ms) | share | calls | KiB | LM head (ms) |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        base = result["costs"].get("1") or result["costs"].get(1)
        for size, phases in result["costs"].items():
            for phase, c in phases.items():
                ratio = f"{base[phase]['step_ms'] / c['step_ms']:.2f}x" if base else "-"
                share = c["allreduce_ms"] / c["step_ms"]
                lines.append(
                    f"| {size} | {phase} | {c['step_ms']:.1f} | {ratio} | {c['allreduce_ms']:.2f} | {share:.0%} | "
                    f"{c['allreduce_calls']:.0f} | {c['allreduce_bytes'] / 1024:.0f} | {c['head_ms']:.2f} |"
                )
        for size, reason in result["skipped"].items():
            lines.append(f"| {size} | skipped | {reason} | | | | | | |")
        lines.append("")
        for key, title in (("projection", model), ("projection_large", report["large_model"]["name"])):
            if not result[key]:
                continue
            lines += [f"Projected on H100s, {title} (see the README for the model):", "",
                      "| size | phase | link | all-reduce per step (us) | one GPU's step (us) | speed-up |",
                      "| ---: | --- | --- | ---: | ---: | ---: |"]  # fmt: skip
            for r in result[key]:
                lines.append(
                    f"| {r['size']} | {r['phase']} | {r['link']} | {r['comm_us']:.0f} | {r['one_gpu_us']:.0f} | "
                    f"{r['speedup']:.2f}x |"
                )
            lines.append("")
    return "\n".join(lines)


def cmd_bench_prefill(args: argparse.Namespace) -> int:
    import os

    from kvserve.bench import prefill
    from kvserve.bench.plots import plot_prefill_parallel
    from kvserve.entrypoints.llm import LLM
    from kvserve.parallel.partition import TABLE_PATH_ENV, default_table_path
    from kvserve.parallel.tune import default_lengths, tune_runahead

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(PREFILL_METHODS)
    if unknown:
        raise ValueError(f"--methods: unknown {sorted(unknown)}; choose from {PREFILL_METHODS}")
    lengths = [int(n) for n in args.lengths.split(",")]
    p = args.prefill_parallel
    if args.table:
        os.environ[TABLE_PATH_ENV] = args.table  # the engine reads the table from there
    common = dict(model=args.model, dtype=args.dtype, weights=args.weights, enable_prefix_caching=False,
                  max_num_batched_tokens=max(lengths))  # fmt: skip
    single = LLM(**common)
    tokenizer = single.get_tokenizer()
    ids = _prompt_ids(tokenizer, Path(AUSTEN), max(lengths))
    prompts = {n: ids[:n] for n in lengths}
    table_path = default_table_path()
    if "KVR-P" in methods and not table_path.is_file():
        log(f"no KVR-P table at {table_path}: building it (kvserve tune-runahead)")
        tune_runahead(single.engine.loaded, args.weights, p, default_lengths(max(lengths)), table_path, log=log)
    log(f"bench prefill: {single.engine.loaded.path.name}, {args.dtype}, p={p}, {torch.get_num_threads()} threads")
    parallel = LLM(**common, prefill_parallel=p, prefill_partition="even") if methods != ["single"] else None
    try:
        result = prefill.run(single, parallel, prompts, methods, args.repeats, log)
    finally:
        if parallel is not None:
            parallel.engine.close()
    report = new_report(
        "prefill", model=single.engine.loaded.path.name, dtype=args.dtype, weights=args.weights, prefill_parallel=p,
        threads=torch.get_num_threads(), table=str(table_path) if "KVR-P" in methods else None,
        results=asdict(result),
    )  # fmt: skip
    out = output_path(args, f"prefill-p{p}")
    write_report(out, report, _prefill_table(report))
    plot_prefill_parallel(report, out.with_suffix(".png"))
    return 0


def _prefill_table(report: dict) -> str:
    m, r = report["machine"], report["results"]
    methods = list(r["ttft_s"])
    lengths = list(next(iter(r["ttft_s"].values())))
    lines = [
        f"# Prefill over {report['prefill_parallel']} processes: {report['model']}, {report['dtype']}",
        "",
        f"`{report['command']}` on {report['date']}: {m['cpu']}, {m['nproc']} CPUs, torch {m['torch']}; single "
        f"process with {report['threads']} threads, parallel methods with the cores shared among processes.",
        "",
        "| TTFT (ms) | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "| --- |" + " ---: |" * len(lengths),
    ]
    for method in methods:
        lines.append(f"| {method} | " + " | ".join(f"{r['ttft_s'][method][n] * 1000:.0f}" for n in lengths) + " |")
    if r["bound_s"]:
        lines.append("| bound TTFT*(p) | " + " | ".join(f"{r['bound_s'][n] * 1000:.0f}" for n in lengths) + " |")
    if "KVR-S" in r["ttft_s"] and "TSP" in r["ttft_s"]:
        ratios = " | ".join(f"{r['ttft_s']['TSP'][n] / r['ttft_s']['KVR-S'][n]:.2f}x" for n in lengths)
        lines.append(f"| **KVR-S speed-up over TSP** | {ratios} |")
    if "KVR-S" in r["ttft_s"] and "single" in r["ttft_s"]:
        ratios = " | ".join(f"{r['ttft_s']['single'][n] / r['ttft_s']['KVR-S'][n]:.2f}x" for n in lengths)
        lines.append(f"| **KVR-S speed-up over single** | {ratios} |")
    if r["partitions"]:
        header = "| chunks (tokens per process) | " + " | ".join(f"{n} tokens" for n in lengths) + " |"
        lines += ["", header, "| --- |" + " ---: |" * len(lengths)]
        for method, by_length in r["partitions"].items():
            cells = (" + ".join(map(str, by_length.get(n, []))) for n in lengths)
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cmd_bench_speed(args: argparse.Namespace) -> int:
    from kvserve.bench import speed
    from kvserve.bench.plots import plot_speed_ratios
    from kvserve.bench.workload import fixed_length_prompts

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - {"llamacpp", "transformers"}
    if unknown:
        raise ValueError(f"--peers: unknown peer(s) {sorted(unknown)}; choose from llamacpp, transformers")
    llamacpp_python = speed.find_llamacpp_python(args.llamacpp_python) if "llamacpp" in peers else None
    lengths = [int(x) for x in args.prefill_lengths.split(",")]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    model_path = resolve_model_path(args.model)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if model_path.suffix != ".gguf":
        raise ValueError(f"bench speed compares engines on one GGUF file; {model_path} is not a .gguf file")
    dtype = resolve_dtype(args.dtype, args.device)
    reader = gguf_file.open_gguf(model_path)
    tokenizer, config = Tokenizer.from_gguf(reader), gguf_file.read_config(reader)
    long_contexts = [int(x) for x in args.long_decode_contexts.split(",") if x.strip()]
    prompt_ids = _prompt_ids(tokenizer, Path(AUSTEN), max([*lengths, *long_contexts]))
    batch_prompts = fixed_length_prompts(tokenizer, max(batch_sizes), args.batch_prompt_tokens)
    roofline = speed.measure_roofline(dtype, device=args.device)
    log(
        f"bench speed: {model_path.name}, {threads} threads; roofline: copy {roofline.copy_gb_per_s:.1f} GB/s, "
        f"{roofline.matmul_dtype} matmul {roofline.matmul_gflop_per_s:,.0f} GFLOP/s"
    )
    kv_dtypes = [d for d in args.kv_cache_dtype.split(",") if d]
    swap_space = args.swap_space if args.swap_space is not None else (0 if args.n_ctx else None)

    def kvserve(kv_cache_dtype: str = "auto", **options: object) -> speed.SpeedEngine:
        kv_memory = args.kv_cache_memory
        if kv_memory is None and args.n_ctx:
            kv_memory = speed.kv_memory_for_tokens(config, args.n_ctx, dtype, kv_cache_dtype)
        options = dict(
            model=str(model_path), dtype=args.dtype, weights=args.weights, max_seqs=max(batch_sizes),
            device=args.device, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=kv_memory, swap_space=swap_space,
            **options,
        )  # fmt: skip
        if args.in_process:
            return speed.KVServeSpeed(**options)
        return speed.KVServeProcess(threads, **options)

    engines: list[Callable[[], speed.SpeedEngine]] = [
        functools.partial(kvserve, kv_dtype, int8_activations=args.int8_activations) for kv_dtype in kv_dtypes
    ]
    if args.int8_activations:  # float32 activations too, as the row the int8 speedup is read against
        engines.append(kvserve)
    if args.batch_invariant:
        engines.append(functools.partial(kvserve, batch_invariant=True))
    seq_len = (
        max(
            [
                *lengths,
                *(n + args.decode_tokens for n in long_contexts),
                args.batch_prompt_tokens + args.batch_new_tokens,
            ]
        )
        + 64
    )
    peer_info = {}
    if llamacpp_python:
        engines.append(
            lambda: speed.LlamaCppSpeed(llamacpp_python, model_path, threads, seq_len, max(batch_sizes), args.n_ctx)
        )
    if "transformers" in peers:
        engines.append(lambda: speed.TransformersSpeed(model_path, dtype, args.device))
    results = []
    memory: dict[str, object] = {}
    for make in engines:
        engine = make()
        if isinstance(engine, speed.KVServeSpeed | speed.KVServeProcess) and "kvserve" not in memory:
            summary = engine.kv_summary if isinstance(engine, speed.KVServeProcess) else engine.llm.engine.kv_summary
            memory["kvserve"] = summary
            log(f"  {engine.name}: {summary}")
        try:
            results.append(
                speed.measure(
                    engine,
                    prompt_ids,
                    lengths,
                    args.decode_tokens,
                    batch_prompts,
                    batch_sizes,
                    args.batch_new_tokens,
                    args.repeats,
                    log,
                    long_contexts,
                )  # fmt: skip
            )
        finally:
            engine.close()
        if isinstance(engine, speed.LlamaCppSpeed):
            peer_info["llama.cpp"] = {"version": engine.version, "system_info": engine.system_info,
                                      "settings": "use_extra_bufts=False, flash attention off"}  # fmt: skip
            pool = "one pool shared by all sequences" if engine.kv_unified else "a stream per sequence"
            memory["llama.cpp"] = f"n_ctx {engine.n_ctx} ({pool})"
    report = new_report(
        "speed",
        model=model_path.name,
        dtype=str(dtype).removeprefix("torch."),
        weights=args.weights,
        device=args.device,
        kv_cache_dtypes=kv_dtypes,
        int8_activations=args.int8_activations,
        threads=threads,
        roofline=asdict(roofline),
        prefill_gflop={n: speed.prefill_flops(config, n) / 1e9 for n in lengths},
        workload={
            "decode_tokens": args.decode_tokens,
            "batch_prompt_tokens": args.batch_prompt_tokens,
            "batch_new_tokens": args.batch_new_tokens,
        },  # fmt: skip
        peers=peer_info,
        kv_memory=memory,
        results=[asdict(r) for r in results],
    )
    # Leaves the default's own report alone.
    suffix = ("-batch-invariant" if args.batch_invariant else "") + ("-int8" if args.int8_activations else "")
    out = output_path(args, f"speed-{args.weights}{suffix}")
    write_report(out, report, _speed_table(report))
    plot_speed_ratios(report, out.with_suffix(".png"))
    return 0


def _speed_table(report: dict) -> str:
    m, roof, results = report["machine"], report["roofline"], report["results"]
    # Reports from before the roofline followed the run's dtype measured bfloat16 whatever the run.
    peak = roof.get("matmul_gflop_per_s", roof.get("bf16_gflop_per_s"))
    peak_dtype = roof.get("matmul_dtype", "bfloat16")
    lengths = list(results[0]["prefill_s"])
    sizes = list(results[0]["batch_tokens_per_s"])
    contexts = list(results[0].get("long_decode_tokens_per_s", {}))
    w = report["workload"]
    on_gpu = report.get("device", "cpu").startswith("cuda")  # the roofline is the GPU's; llama.cpp stays on the CPU
    lines = [
        f"# {'GPU' if on_gpu else 'CPU'} speed: {report['model']}",
        "",
        f"`{report['command']}` on {report['date']}: {m['gpu'] + ' (kvserve, transformers), ' if on_gpu else ''}"
        f"{m['cpu']}, {m['nproc']} CPUs, {m['memory_gib']} GiB, "
        f"torch {m['torch']}, {report['threads']} threads; kvserve {report['dtype']} activations"
        f"{' (int8 in the 4-bit projections)' if report.get('int8_activations') else ''}, weights "
        f"`{report['weights']}`.",
    ]
    for name, info in report["peers"].items():
        lines.append(f"{name} {info['version']} ({info['settings']}).")
    lines += [
        "",
        f"Roofline measured in the same run: copy {roof['copy_gb_per_s']:.1f} GB/s (read + write), {peak_dtype} "
        f"matmul {peak:,.0f} GFLOP/s. Batch columns: N prompts of "
        f"{w['batch_prompt_tokens']} tokens in at once, {w['batch_new_tokens']} new tokens each, end to end.",
        "",
        "| engine | load (s) | "
        + " | ".join(f"prefill {n} (ms)" for n in lengths)
        + " | decode b=1 (tok/s) | "
        + "".join(f"decode b=1 after {n} (tok/s) | " for n in contexts)
        + " | ".join(f"{b} seqs (tok/s)" for b in sizes)
        + " |",
        "| --- | ---: |" + " ---: |" * (len(lengths) + 1 + len(contexts) + len(sizes)),
    ]

    def row(label: str, load: str, prefill: list[str], decode: list[str], batch: list[str]) -> str:
        return f"| {label} | {load} | " + " | ".join([*prefill, *decode, *batch]) + " |"

    def decodes(r: dict) -> list[float]:
        return [r["decode_tokens_per_s"], *(r["long_decode_tokens_per_s"][n] for n in contexts)]

    for r in results:
        lines.append(row(
            r["engine"], f"{r['load_s']:.2f}", [f"{r['prefill_s'][n] * 1000:.0f}" for n in lengths],
            [f"{d:.1f}" for d in decodes(r)], [f"{r['batch_tokens_per_s'][b]:.1f}" for b in sizes],
        ))  # fmt: skip
    ours = results[0]
    for peer in results[1:]:
        lines.append(row(
            f"**kvserve / {peer['engine']}**", "",
            [f"{peer['prefill_s'][n] / ours['prefill_s'][n]:.2f}x" for n in lengths],
            [f"{a / b:.2f}x" for a, b in zip(decodes(ours), decodes(peer), strict=True)],
            [f"{ours['batch_tokens_per_s'][b] / peer['batch_tokens_per_s'][b]:.2f}x" for b in sizes],
        ))  # fmt: skip
    lines += ["", "Roofline fractions: decode = weight bytes per token x tokens/s / copy bandwidth; prefill = "
              f"matmul FLOPs / time / {peak_dtype} peak.", "",
              "| engine | weight MB / token | decode | " + " | ".join(f"prefill {n}" for n in lengths) + " |",
              "| --- | ---: | ---: |" + " ---: |" * len(lengths)]  # fmt: skip
    for r in results:
        per_token = r["decode_bytes_per_token"]
        decode = per_token * r["decode_tokens_per_s"] / (roof["copy_gb_per_s"] * 1e9)
        prefill = [report["prefill_gflop"][n] / r["prefill_s"][n] / peak for n in lengths]
        fractions = " | ".join(f"{f:.0%}" for f in prefill)
        lines.append(f"| {r['engine']} | {per_token / 1e6:.1f} | {decode:.0%} | {fractions} |")
    lines += _speed_memory_table(report)
    return "\n".join(lines) + "\n"


def _speed_memory_table(report: dict) -> list[str]:
    """Rates and memory side by side (reports that measured them): prefill tokens/s, decode tokens/s at batch 1 and
    of each batch's decode steps alone, each engine's process's peak resident set, and batch-1 decode as a share of
    the copy bandwidth; kvserve over each peer beneath."""
    results = report["results"]
    if not any(r.get("peak_rss_bytes") or r.get("batch_decode_tokens_per_s") for r in results):
        return []
    copy = report["roofline"]["copy_gb_per_s"] * 1e9
    lengths = list(results[0]["prefill_s"])
    sizes = list(results[0].get("batch_decode_tokens_per_s", {}))

    def figures(r: dict) -> list[float | None]:
        rss = r.get("peak_rss_bytes")
        return [
            r["load_s"], *(int(n) / r["prefill_s"][n] for n in lengths), r["decode_tokens_per_s"],
            *(r.get("batch_decode_tokens_per_s", {}).get(b) for b in sizes), rss / 2**30 if rss else None,
            r["decode_bytes_per_token"] * r["decode_tokens_per_s"] / copy if r["decode_bytes_per_token"] else None,
        ]  # fmt: skip

    formats = ["{:.2f}", *["{:.0f}"] * len(lengths), "{:.1f}", *["{:.1f}"] * len(sizes), "{:.2f}", "{:.0%}"]
    lines = [
        "",
        "Rates and memory. Batch decode: the steps after every sequence's first token. Peak RSS: the resident "
        "high-water mark (VmHWM) of the engine's own process, after all of the above.",
    ]
    if report.get("kv_memory"):
        lines += ["", "KV memory: " + "; ".join(f"{name}: {text}" for name, text in report["kv_memory"].items()) + "."]
    lines += [
        "",
        "| engine | load (s) | " + "".join(f"prefill {n} (tok/s) | " for n in lengths) + "decode b=1 (tok/s) | "
        + "".join(f"decode {b} seqs (tok/s) | " for b in sizes) + "peak RSS (GiB) | decode b=1 / copy bandwidth |",
        "| --- |" + " ---: |" * len(formats),
    ]  # fmt: skip
    for r in results:
        cells = ["-" if v is None else f.format(v) for f, v in zip(formats, figures(r), strict=True)]
        lines.append(f"| {r['engine']} | " + " | ".join(cells) + " |")
    ours = figures(results[0])
    for peer in results[1:]:
        cells = [
            "-" if a is None or b is None or not b else f"{a / b:.2f}x"
            for a, b in zip(ours, figures(peer), strict=True)
        ]
        lines.append(f"| **kvserve / {peer['engine']}** | " + " | ".join(cells) + " |")
    lines += ["", "The ratio row is kvserve's figure over the peer's: above 1 is faster for a rate, larger for load "
              "time and memory."]  # fmt: skip
    return lines


def cmd_bench_compression(args: argparse.Namespace) -> int:
    import random

    from kvserve.bench.compression import markdown, run_policy
    from kvserve.bench.plots import plot_compression
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine
    from kvserve.entrypoints.cli_common import load_from_args

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    loaded = load_from_args(args)
    low, high = (int(n) for n in args.prompt_tokens.split(","))
    text = loaded.tokenizer.encode(AUSTEN.read_text(errors="replace"), add_special_tokens=False)
    rng = random.Random(0)
    prompts = []
    for _ in range(args.num_requests):
        n = rng.randint(low, high)
        begin = rng.randrange(0, len(text) - n)
        prompts.append(text[begin : begin + n])
    results = []
    points = [(p, None) if p == "full" else (p, b) for p in args.policies.split(",") for b in args.kv_budget]
    for policy, budget in dict.fromkeys(points):  # full once, whatever the budgets
        config = EngineConfig(
            dtype=args.dtype, device=args.device, weights=args.weights, kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, kv_policy=policy, kv_budget=budget,
            int8_activations=args.int8_activations, preemption_mode=args.preemption_mode,
        )  # fmt: skip
        engine = LLMEngine(config, loaded)
        log(f"bench compression: {engine.kv_summary}")
        result = run_policy(engine, prompts, args.max_tokens, log)
        log(
            f"  {policy}: peak batch {result.peak_running}, {result.output_tokens_per_s:.1f} output tok/s, "
            f"{result.decode_tokens_per_s:.1f} decode tok/s, KV/seq {result.kv_bytes_per_seq / 1e6:.1f} MB"
        )
        results.append(result.as_dict())
    report = new_report(
        "compression", model=loaded.path.name, dtype=args.dtype, weights=args.weights,
        int8_activations=args.int8_activations,
        threads=torch.get_num_threads(), kv_cache_memory=args.kv_cache_memory,
        workload=f"{len(prompts)} requests, prompts {low}-{high} tokens (Austen), {args.max_tokens} output tokens, "
        f"preemption by {args.preemption_mode}",
        results=results,
    )  # fmt: skip
    out = output_path(args, "efficiency")
    write_report(out, report, markdown(report))
    plot_compression(report, out.with_suffix(".png"))
    return 0


def _budgets(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected budgets such as 0.25,0.5, got {text!r}") from None


def cmd_bench_sparse_decode(args: argparse.Namespace) -> int:
    """``kvserve bench offload --tiers device``: sparse decode by context length (``bench/sparse_decode.py``)."""
    from kvserve.bench import sparse_decode
    from kvserve.bench.plots import plot_sparse_decode
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine
    from kvserve.entrypoints.cli_common import load_from_args

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    loaded = load_from_args(args)
    contexts = [int(n) for n in args.contexts.split(",")]
    text = loaded.tokenizer.encode(AUSTEN.read_text(errors="replace"), add_special_tokens=False)
    if len(text) < max(contexts):
        raise ValueError(f"the sample text has {len(text)} tokens, too few for a {max(contexts)}-token prompt")
    options = dict(dtype=args.dtype, device=args.device, weights=args.weights, kv_cache_memory=args.kv_cache_memory,
                   swap_space=0, max_num_batched_tokens=max(contexts), enable_prefix_caching=False)  # fmt: skip
    full = LLMEngine(EngineConfig(**options), loaded)
    sparse = LLMEngine(EngineConfig(**options, kv_policy="infinigen"), loaded)
    log(f"bench offload --tiers device: full ({full.kv_summary}) against infinigen ({sparse.kv_summary})")
    cells = []
    try:
        for context in contexts:
            log(f"  context {context}")
            cells.append(sparse_decode.measure(full, sparse, text[:context], args.steps, log))
    finally:
        full.close()
        sparse.close()
    report = new_report(
        "sparse-decode", model=loaded.path.name, dtype=args.dtype, weights=args.weights,
        threads=torch.get_num_threads(), kv_cache_memory=args.kv_cache_memory,
        note="Prompt: the first tokens of Jane Austen's Emma; greedy, EOS ignored; KV on the device, no offload; "
        "infinigen_alpha auto; the two engines' decode steps alternate (medians of each).",
        results=sparse_decode.as_rows(cells),
    )  # fmt: skip
    out = output_path(args, "sparse-decode")
    write_report(out, report, sparse_decode.markdown(report))
    plot_sparse_decode(report, out.with_suffix(".png"))
    return 0


def cmd_bench_offload(args: argparse.Namespace) -> int:
    if args.tiers == "device":
        return cmd_bench_sparse_decode(args)
    from kvserve.bench import offload
    from kvserve.bench.plots import plot_offload
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine
    from kvserve.entrypoints.cli_common import load_from_args

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    loaded = load_from_args(args)
    contexts = [int(n) for n in args.contexts.split(",")]
    batches = sorted((int(n) for n in args.batches.split(",")), reverse=True)
    text = loaded.tokenizer.encode(AUSTEN.read_text(errors="replace"), add_special_tokens=False)
    prompts = {c: [text[i * c : (i + 1) * c] for i in range(batches[0])] for c in contexts}
    if len(prompts[max(contexts)][-1]) < max(contexts):
        raise ValueError(f"the sample text has {len(text)} tokens, too few for {batches[0]} x {max(contexts)}")
    window_layers = args.window_layers.split(",")
    if not set(window_layers) <= {"device", "tier"}:
        raise ValueError(f"--window-layers takes device and/or tier, got {args.window_layers!r}")
    cells = []
    for tier, placement in itertools.product(args.tiers.split(","), window_layers):
        for policy in args.policies.split(","):
            if policy == "h2o" and cells and any(c.policy == "h2o" for c in cells):
                continue  # not offloaded: once is enough
            offloaded = policy != "h2o"
            config = EngineConfig(
                dtype=args.dtype, device=args.device, weights=args.weights, kv_cache_memory=args.kv_cache_memory,
                max_num_batched_tokens=max(contexts), kv_policy=policy, kv_budget=0.2 if policy == "h2o" else None,
                block_size=args.block_size, max_num_seqs=batches[0], kv_window_groups=placement == "device",
                kv_offload=tier.removesuffix("-direct") if offloaded else "none",
                kv_offload_path=args.kv_offload_path if offloaded and tier.startswith("disk") else None,
                kv_disk_io="direct" if offloaded and tier == "disk-direct" else "mmap",
            )  # fmt: skip
            engine = LLMEngine(config, loaded)
            log(f"bench offload: {policy} ({engine.kv_summary})")
            where = (tier if placement == "device" else f"{tier}/all-layers") if offloaded else "memory"
            try:
                for context in contexts:
                    log(f"  context {context}")
                    for batch in batches:
                        cell = offload.measure(engine, prompts[context][:batch], args.steps, log)
                        cells.append(offload.DecodeCell(where, policy, context, batch, *cell))
            finally:
                engine.close()
    report = new_report(
        "offload", model=loaded.path.name, dtype=args.dtype, weights=args.weights,
        threads=torch.get_num_threads(), kv_cache_memory=args.kv_cache_memory, policies=args.policies.split(","),
        block_size=args.block_size,
        note="Prompts: Jane Austen's Emma cut into distinct pieces; greedy, EOS ignored; h2o at a 20% budget, "
        "not offloaded (its KV is gathered from host memory each step).",
        results=offload.as_rows(cells),
    )  # fmt: skip
    out = output_path(args, "decode")
    write_report(out, report, offload.markdown(report))
    plot_offload(report, out.with_suffix(".png"))
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from kvserve.bench import throughput
    from kvserve.bench.plots import plot_decode_scaling
    from kvserve.bench.workload import fixed_length_prompts, load_trace_requests
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine
    from kvserve.entrypoints.cli_common import load_from_args

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    config = EngineConfig(  # its options are checked before the model loads
        dtype=args.dtype, device=args.device, weights=args.weights, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        **kv_policy_options(args),
    )  # fmt: skip
    loaded = load_from_args(args)
    engine = LLMEngine(config, loaded)
    log(f"bench throughput: {loaded.path.name}, {args.dtype}, {torch.get_num_threads()} threads; {engine.kv_summary}")
    requests = load_trace_requests(loaded.tokenizer, args.num_requests, args.scale, engine.max_model_len)
    log(
        f"workload: {len(requests)} requests, {sum(len(r.prompt_ids) for r in requests):,} prompt tokens, "
        f"{sum(r.output_len for r in requests):,} output tokens"
    )
    results = [throughput.run_kvserve(engine, requests, log)]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = fixed_length_prompts(loaded.tokenizer, max(batch_sizes), 32)
    scaling_engine = LLMEngine(dataclasses.replace(config, enable_prefix_caching=False), loaded)
    scaling = {"kvserve": {}}
    for b in batch_sizes:
        scaling["kvserve"][b] = throughput.decode_scaling_kvserve(scaling_engine, prompts[:b], args.decode_tokens)
        log(f"  kvserve decode, batch {b}: {scaling['kvserve'][b]:.1f} tokens/s")
    if not args.no_peer:
        with extra_imports("bench", "the transformers peer (--no-peer skips it)"):
            from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            loaded.path.parent, gguf_file=loaded.path.name, dtype=loaded.dtype
        ).eval()
        pad = loaded.tokenizer.eos_token_ids[0]
        results.append(throughput.run_transformers(hf, requests, args.hf_batch_size, pad, log))
        scaling["transformers"] = {}
        for b in batch_sizes:
            scaling["transformers"][b] = throughput.decode_scaling_transformers(hf, prompts[:b], args.decode_tokens)
            log(f"  transformers decode, batch {b}: {scaling['transformers'][b]:.1f} tokens/s")

    report = new_report(
        "throughput",
        model=loaded.path.name,
        dtype=args.dtype,
        weights=args.weights,
        workload={
            "trace": "azure_llm_inference_conv_2023.csv",
            "num_requests": len(requests),
            "scale": args.scale,
            "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
            "output_tokens": sum(r.output_len for r in requests),
            "hf_batch_size": args.hf_batch_size,
        },
        results=[
            {**asdict(r), "requests_per_s": r.requests_per_s, "output_tokens_per_s": r.output_tokens_per_s}
            for r in results
        ],
        decode_scaling_tokens_per_s=scaling,
        decode_tokens=args.decode_tokens,
    )
    out = output_path(args, f"throughput-{args.dtype}")
    write_report(out, report, _throughput_table(report))
    plot_decode_scaling(scaling, out.with_suffix(".png"), f"{loaded.path.name}, {args.dtype}")
    return 0


def _throughput_table(report: dict) -> str:
    m, w = report["machine"], report["workload"]
    lines = [
        f"# Throughput: {report['model']}, {report['dtype']}",
        "",
        f"`{report['command']}` on {report['date']}: {m['cpu']}, {m['nproc']} CPUs, {m['memory_gib']} GiB, "
        f"torch {m['torch']}, {m['torch_threads']} threads.",
        "",
        f"Workload: the first {w['num_requests']} requests of {w['trace']}, token counts divided by {w['scale']:g} "
        f"({w['prompt_tokens']:,} prompt and {w['output_tokens']:,} output tokens), greedy, EOS ignored. "
        f"transformers: static batches of {w['hf_batch_size']}.",
        "",
        "| engine | time (s) | requests/s | output tokens/s | KV waste % |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    results = report["results"]
    for r in results:
        lines.append(
            f"| {r['engine']} | {r['seconds']:.1f} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
            f"{r['kv_waste_pct']:.1f} |"
        )
    if len(results) == 2:
        ratio = results[0]["output_tokens_per_s"] / results[1]["output_tokens_per_s"]
        lines.append(f"| **kvserve / transformers** | | | **{ratio:.2f}x** | |")
    scaling = report["decode_scaling_tokens_per_s"]
    engines = list(scaling)
    lines += [
        "",
        f"Decode tokens/s by batch size ({report['decode_tokens']} tokens per request, 32-token prompts):",
        "",
    ]
    lines.append("| batch | " + " | ".join(engines) + (" | ratio |" if len(engines) == 2 else " |"))
    lines.append("| ---: | " + " | ".join("---:" for _ in engines) + (" | ---: |" if len(engines) == 2 else " |"))
    for b in scaling["kvserve"]:
        values = [scaling[e][b] for e in engines]
        ratio = f" | {values[0] / values[1]:.2f}x" if len(values) == 2 else ""
        lines.append(f"| {b} | " + " | ".join(f"{v:.1f}" for v in values) + ratio + " |")
    return "\n".join(lines) + "\n"


def cmd_bench_prefix(args: argparse.Namespace) -> int:
    from kvserve.bench.prefix import markdown, run_shared_prefix
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine
    from kvserve.entrypoints.cli_common import load_from_args

    loaded = load_from_args(args)
    tok = loaded.tokenizer
    text = AUSTEN.read_text(errors="replace")
    shared = tok.encode(text[: args.shared_tokens * 8], add_special_tokens=False)[: args.shared_tokens]
    questions = [line for line in text.splitlines() if len(line) > 60][1000 : 1000 + args.num_requests]
    prompts = [shared + tok.encode(f"\nQuestion {i}: {q}\nAnswer:", add_special_tokens=False)
               for i, q in enumerate(questions)]  # fmt: skip
    results = []
    for caching in (True, False):
        config = EngineConfig(
            dtype=args.dtype, device=args.device, weights=args.weights, kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=caching,
        )  # fmt: skip
        result = run_shared_prefix(LLMEngine(config, loaded), prompts, args.max_tokens)
        print(f"  prefix caching {'on' if caching else 'off'}: {result.seconds:.1f} s, mean TTFT "
              f"{result.mean_ttft_s:.2f} s, hit rate {result.prefix_hit_rate:.1%}", file=sys.stderr)  # fmt: skip
        results.append(result)
    report = new_report(
        "prefix",
        model=loaded.path.name,
        dtype=args.dtype,
        weights=args.weights,
        workload={"num_requests": len(prompts), "shared_tokens": len(shared), "max_tokens": args.max_tokens},
        results=[asdict(r) for r in results],
    )
    write_report(output_path(args, f"prefix-{args.dtype}"), report, markdown(report))
    return 0


def cmd_bench_prompt_cache(args: argparse.Namespace) -> int:
    from kvserve.bench.plots import plot_prompt_cache
    from kvserve.bench.prompt_cache import leval_text_and_questions, markdown, run_length, warm_up
    from kvserve.entrypoints.cli_common import load_from_args

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    loaded = load_from_args(args)
    lengths = [int(n) for n in args.lengths.split(",")]
    text, questions = leval_text_and_questions(args.questions + 1)
    text_ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    options = dict(dtype=args.dtype, device=args.device, weights=args.weights, kv_cache_memory=args.kv_cache_memory,
                   swap_space=0)  # fmt: skip
    if any(w is not None for w in loaded.config.layer_windows):  # Prompt Cache needs every layer in one KV group
        options["kv_window_groups"] = False
        log("bench prompt-cache: sliding-window layers kept in one KV group (kv_window_groups=False) for every method")
    warm_up(loaded, options, text_ids)
    results = []
    for tokens in lengths:
        log(f"bench prompt-cache: {tokens}-token document, {len(questions) - 1} questions measured")
        runs = run_length(loaded, options, tokens, text_ids, questions, args.layout, log, args.prompt_cache_recompute)
        results += [{"target_tokens": tokens, **r.as_dict()} for r in runs]
    report = new_report(
        "prompt-cache", model=loaded.path.name, dtype=args.dtype, weights=args.weights,
        threads=torch.get_num_threads(), lengths=lengths, layout=args.layout, results=results,
        prompt_cache_recompute=args.prompt_cache_recompute,
        workload=(
            "L-Eval QuALITY stories cut to each length as "
            + ("4 modules" if args.layout == "modules" else "one module")
            + f", {len(questions) - 1} questions as new text"
            + (", behind a reader module whose name parameter differs per request" if args.layout != "prefix" else "")
            + ", one request at a time, TTFT = arrival to first token (median); max_num_batched_tokens 2048"
        ),
    )  # fmt: skip
    default = "ttft" if args.layout == "prefix" else f"ttft-{args.layout}"
    out = output_path(args, default)
    write_report(out, report, markdown(report))
    plot_prompt_cache(report, out.with_suffix(".png"))
    return 0


def cmd_bench_window(args: argparse.Namespace) -> int:
    from kvserve.bench import window
    from kvserve.bench.plots import plot_window
    from kvserve.entrypoints.cli_common import load_from_args

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    bench = window.WindowBench(
        engine_options=dict(dtype=args.dtype, device=args.device, weights=args.weights,
                            kv_cache_memory=args.kv_cache_memory, block_size=args.block_size),
        context_tokens=args.context, context_new_tokens=args.context_new_tokens, prefill_chunk=args.prefill_chunk,
        seq_tokens=args.seq_tokens, max_tokens=args.max_tokens, batch_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_sequences=args.max_sequences,
    )  # fmt: skip
    loaded = load_from_args(args)
    log(f"bench window: {loaded.path.name}, {args.dtype}, {torch.get_num_threads()} threads")
    results = window.run(loaded, bench, log)
    settings = {k: v for k, v in dataclasses.asdict(bench).items() if k != "engine_options"}
    report = new_report(
        "window", model=loaded.path.name, dtype=args.dtype, weights=args.weights, threads=torch.get_num_threads(),
        kv_cache_memory=args.kv_cache_memory, block_size=args.block_size, settings=settings, results=results,
    )  # fmt: skip
    report["cpu"] = window.cpu_label(report["machine"])
    out = output_path(args, "window")
    write_report(out, report, window.markdown(report))
    plot_window(report, out.with_suffix(".png"))
    return 0


def cmd_bench_kv_cache(args: argparse.Namespace) -> int:
    from kvserve.bench import kv_cache_dtype as kvc
    from kvserve.bench import speed, window
    from kvserve.bench.plots import plot_kv_cache
    from kvserve.entrypoints.cli_common import load_from_args

    def log(line: str) -> None:
        print(f"bench kv-cache: {line}", file=sys.stderr, flush=True)

    def numbers(text: str, flag: str) -> tuple[int, ...]:
        try:
            return tuple(int(n) for n in text.split(",") if n.strip())
        except ValueError:
            raise ValueError(f"{flag} takes comma-separated whole numbers, got {text!r}") from None

    peers = [p for p in args.peers.split(",") if p]
    if set(peers) - {"llamacpp"}:
        raise ValueError(f"--peers: unknown peer(s) {sorted(set(peers) - {'llamacpp'})}; choose from llamacpp")
    bench = kvc.KVCacheBench(
        kv_cache_dtypes=tuple(d for d in args.kv_cache_dtypes.split(",") if d),
        engine_options=dict(dtype=args.dtype, device=args.device, weights=args.weights,
                            int8_activations=args.int8_activations),
        block_size=args.block_size, seq_len=args.seq_len, kv_cache_memory=args.kv_cache_memory,
        check_sequences=args.check_sequences, check_kv_cache_memory=args.check_kv_cache_memory,
        check_max_requests=args.check_max_requests, contexts=numbers(args.contexts, "--contexts"),
        batch_sizes=numbers(args.batch_sizes, "--batch-sizes"), decode_tokens=args.decode_tokens,
        prefill_chunk=args.prefill_chunk, ppl_tokens=args.ppl_tokens, ppl_context=args.ppl_context,
        ppl_stride=args.ppl_stride, ppl_chunk=args.ppl_chunk, agreement_prompts=args.agreement_prompts,
        agreement_tokens=args.agreement_tokens,
        capacity=not args.skip_capacity, speed=not args.skip_speed, accuracy=not args.skip_accuracy,
    )  # fmt: skip
    for kv_dtype in bench.kv_cache_dtypes:  # a bad name or pair is refused before the model loads
        bench.config(kv_dtype, bench.kv_cache_memory)
    model_path = resolve_model_path(args.model)
    llamacpp = None
    if "llamacpp" in peers and bench.speed:
        if model_path.suffix != ".gguf":
            raise ValueError(f"--peers llamacpp runs a GGUF file; {model_path} is not one")
        try:
            llamacpp = (speed.find_llamacpp_python(args.llamacpp_python), model_path)
        except RuntimeError as exc:  # no llama_cpp: said in one line, before the model loads
            raise ValueError(str(exc)) from None
    loaded = load_from_args(args)
    model_dtype = str(loaded.dtype).removeprefix("torch.")
    log(
        f"{loaded.path.name}, {model_dtype}, {torch.get_num_threads()} threads; KV dtypes {list(bench.kv_cache_dtypes)}"
    )
    results = kvc.run(loaded, bench, log, llamacpp)
    settings = {k: v for k, v in dataclasses.asdict(bench).items() if k != "engine_options"}
    report = new_report(
        "kv-cache", model=loaded.path.name, dtype=model_dtype, weights=loaded.weights, device=args.device,
        threads=torch.get_num_threads(), kv_cache_dtypes=list(bench.kv_cache_dtypes), settings=settings,
        peers=(
            {"llama.cpp": {**results["speed"]["llama.cpp"], "settings": "type_k = type_v per row, flash attention on, "
                           "use_extra_bufts=False, one KV pool shared by the batch"}}
            if llamacpp else {}
        ),
        results=results,
    )  # fmt: skip
    report["cpu"] = window.cpu_label(report["machine"])
    out = output_path(args, f"kv-cache-{model_path.stem.lower()}")
    write_report(out, report, kvc.markdown(report))
    plot_kv_cache(report, out.with_suffix(".png"))
    return 0


def cmd_bench_soak(args: argparse.Namespace) -> int:
    with extra_imports("bench", "kvserve bench soak"):
        from kvserve.bench import soak
    from kvserve.bench.plots import plot_soak
    from kvserve.models.catalog import resolve_model_path
    from kvserve.platform.faults import parse_faults

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.restart_at >= 1:
        raise SystemExit(f"kvserve bench soak: --restart-at {args.restart_at:g} is not within the run (0 to 1)")
    opts = soak.SoakOptions(
        model=args.model, duration_s=args.duration, max_requests=args.max_requests, concurrency=args.concurrency,
        prefill_parallel=args.prefill_parallel, kill_worker_at=args.kill_worker_at,
        max_request_bytes=args.max_request_bytes, threads=args.threads, seed=args.seed,
        extra_server_args=tuple(shlex.split(args.server_args)), chaos=args.chaos, restart_at=args.restart_at,
        faults=args.faults if args.faults is not None else soak.CHAOS_FAULTS,
    )  # fmt: skip
    if args.faults:
        parse_faults(args.faults)  # a bad spec is an error here, not a server that fails to start
    results = soak.run_soak(opts, log)
    report = new_report("soak", model=resolve_model_path(args.model).name, results=results)
    out = output_path(args, "soak")
    write_report(out, report, soak.soak_table(report))
    plot_soak(report, out.with_suffix(".png"))
    return 0 if results["exactly_once"] and not results["processes_left_after_stop"] else 1


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import re

    with extra_imports("bench", "kvserve bench serve"):
        from kvserve.bench import serve
    from kvserve.bench.plots import plot_serving_latency

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rates = _parse_rates(args.sweep_rates) if args.sweep_rates else [args.request_rate]
    extra_body = _parse_extra_body(args.extra_body)
    others = _other_reports(args.compare_with)
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    tokenizer_path = Path(args.tokenizer) if args.tokenizer else default_model_path()
    requests, workload = _serve_workload(args, _load_tokenizer(tokenizer_path))
    model = args.model or asyncio.run(serve.first_model_id(args.base_url, args.api_key))
    label = args.label or Path(model).name
    target = serve.ServeTarget(args.base_url, model, args.endpoint, args.api_key, args.request_timeout, extra_body)
    log(f"bench serve: {label} at {target.url()}, model {model!r}; {workload['description']}")
    runs = []
    for rate in rates:
        log(f"request rate {rate:g}/s, concurrency {args.concurrency or 'unlimited'}:")
        results, duration = asyncio.run(serve.run_load(target, requests, rate, args.concurrency, args.seed, log))
        summary = serve.summarize(results, duration)
        if summary["failed"]:
            log(f"  {summary['failed']} requests failed, e.g. {summary['errors'][0]}")
        if summary["short_requests"]:
            log(f"  warning: {summary['short_requests']} requests got fewer tokens than they asked for: the server "
                "stopped them early (EOS not ignored? streams interrupted by newer requests?)")  # fmt: skip
        runs.append({"request_rate": rate, "concurrency": args.concurrency, "summary": summary})

    report = new_report(
        "serve",
        label=label,
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        tokenizer=tokenizer_path.name,
        workload=workload,
        runs=[{**run, "request_rate": _rate_json(run["request_rate"])} for run in runs],
    )
    out = output_path(args, f"serve-{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}")
    m = report["machine"]
    text = "\n".join([
        f"# Serving: {label}",
        "",
        f"`{report['command']}` on {report['date']}: {m['cpu']}, {m['nproc']} CPUs, {m['memory_gib']} GiB. "
        f"Model {model!r} via {target.url()}; {workload['description']}; greedy, EOS ignored, streamed.",
        "",
        serve.table(runs),
    ])  # fmt: skip
    write_report(out, report, text)
    servers = {label: runs}
    for name, other_runs in others:
        while name in servers:
            name += "'"
        servers[name] = other_runs
    if len(runs) > 1 or len(servers) > 1:
        plot_serving_latency(servers, out.with_suffix(".png"), workload["description"])
    return 0 if all(run["summary"]["completed"] for run in runs) else 1


def _other_reports(paths: list[str]) -> list[tuple[str, list[dict]]]:
    """(label, runs) of other ``bench serve`` reports, read before the benchmark runs so a bad path fails early."""
    reports = []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            reports.append((str(report["label"]), list(report["runs"])))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"--compare-with {path} is not a readable `kvserve bench serve` report: {exc}") from exc
    return reports


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"--sweep-rates must be comma-separated numbers or inf, got {text!r}") from exc
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--sweep-rates must be positive numbers or inf, got {text!r}")
    return rates


def _parse_extra_body(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {text!r}")
    return body


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _load_tokenizer(path: Path) -> Tokenizer:
    from kvserve.models import gguf_file

    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    if not path.is_file():
        raise ValueError(f"--tokenizer {path} does not exist")
    return Tokenizer.from_gguf(gguf_file.open_gguf(path))


def _serve_workload(args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[list, dict]:
    from kvserve.bench import serve
    from kvserve.bench.workload import (
        AZURE_CONV_TRACE,
        TraceRequest,
        fixed_length_prompts,
        load_trace_requests,
    )

    if args.workload == "azure":
        trace = load_trace_requests(tokenizer, args.num_requests, args.scale, args.max_model_len, seed=args.seed)
        description = f"first {len(trace)} requests of {AZURE_CONV_TRACE.name}, token counts / {args.scale:g}"
    else:
        if args.input_len < 1 or args.output_len < 1:
            raise ValueError(f"--input-len and --output-len must be >= 1, got {args.input_len}, {args.output_len}")
        prompts = fixed_length_prompts(tokenizer, args.num_requests, args.input_len, seed=args.seed + 1)
        trace = [TraceRequest(p, args.output_len) for p in prompts]
        description = f"{len(trace)} synthetic requests, {args.input_len} prompt + {args.output_len} output tokens"
    workload = {
        "kind": args.workload,
        "description": description,
        "num_requests": len(trace),
        "scale": args.scale if args.workload == "azure" else None,
        "prompt_tokens": sum(len(r.prompt_ids) for r in trace),
        "output_tokens": sum(r.output_len for r in trace),
        "seed": args.seed,
    }
    return serve.build_requests(tokenizer, trace), workload


def cmd_bench_structured(args: argparse.Namespace) -> int:
    import importlib.metadata

    from kvserve.bench.structured import markdown as structured_markdown
    from kvserve.bench.structured import prompts, run_batch
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine
    from kvserve.entrypoints.cli_common import load_from_args

    if args.num_prompts < 2:
        raise KVServeError(f"--num-prompts must be >= 2 (half the batch is constrained), got {args.num_prompts}")
    loaded = load_from_args(args)
    config = EngineConfig(
        dtype=args.dtype, device=args.device, weights=args.weights, kv_cache_memory=args.kv_cache_memory,
        swap_space=0, max_num_seqs=args.num_prompts,
    )  # fmt: skip
    engine = LLMEngine(config, loaded)
    chat = [(name, engine.tokenizer.encode_chat([{"role": "user", "content": text}])) for name, text in prompts(
        args.num_prompts)]  # fmt: skip
    n = len(chat)
    run_batch(engine, chat, [i % 2 == 0 for i in range(n)], 8)  # warm-up: kernels for these shapes, grammars
    runs = []
    for label, constrain in (("unconstrained", [False] * n), ("all constrained", [True] * n),
                             ("half constrained", [i % 2 == 0 for i in range(n)])):  # fmt: skip
        run = run_batch(engine, chat, constrain, args.max_tokens)
        run.label = label
        print(f"  {label}: {run.tokens_per_s:.1f} tokens/s, {run.valid}/{n} valid", file=sys.stderr, flush=True)
        runs.append(run.as_dict())
    none, every, half = runs
    report = new_report(
        "structured", model=loaded.path.name, dtype=str(loaded.dtype).removeprefix("torch."), weights=args.weights,
        threads=torch.get_num_threads(), xgrammar=importlib.metadata.version("xgrammar"), requests=n,
        max_tokens=args.max_tokens, runs=runs,
        summary={
            "valid_without": none["valid"] / n, "valid_with": every["valid"] / n,
            "valid_with_completed": every["valid"] / max(1, n - every["cut"]),
            "half_vs_none_tokens_per_s": half["tokens_per_s"] / none["tokens_per_s"],
            "mask_ms_per_step": every["mean_mask_ms_per_step"],
        },
    )  # fmt: skip
    write_report(output_path(args, "structured"), report, structured_markdown(report))
    return 0
