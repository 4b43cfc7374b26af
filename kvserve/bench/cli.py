"""``kvserve bench ...`` subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from datetime import date
from pathlib import Path

import torch

from kvserve.bench.latency import DEFAULT_TEXT, KVServeEngine, TransformersEngine, measure
from kvserve.bench.machine import describe_machine
from kvserve.models.loader import default_model_path
from kvserve.tokenizer import Tokenizer


def add_bench_parser(sub: argparse._SubParsersAction, add_model_args: Callable) -> None:
    bench = sub.add_parser("bench", help="benchmarks against a peer engine")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    lat = bench_sub.add_parser("latency", help="load, prefill and batch-1 decode: kvserve vs transformers")
    add_model_args(lat)
    lat.add_argument("--prefill-lengths", default="512,2048", help="comma-separated prompt lengths")
    lat.add_argument("--decode-tokens", type=int, default=128)
    lat.add_argument("--repeats", type=int, default=3)
    lat.add_argument("--text", default=str(DEFAULT_TEXT), help="text file the prompts are cut from")
    lat.add_argument("--no-peer", action="store_true", help="measure kvserve only")
    lat.add_argument(
        "--output", default=None, help="writes OUTPUT.json and OUTPUT.md (default: benchmarks/latency-DTYPE)"
    )
    lat.set_defaults(func=cmd_bench_latency)


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from kvserve.cli import DTYPES

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    lengths = [int(x) for x in args.prefill_lengths.split(",")]
    text_path = Path(args.text)
    if not text_path.is_file():
        raise ValueError(f"--text {text_path} does not exist")
    model_path = Path(args.model) if args.model else default_model_path()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    kv = KVServeEngine(str(model_path), dtype)  # also provides the tokenizer for the prompt
    prompt_ids = _prompt_ids(kv.loaded.tokenizer, text_path, max(lengths))
    del kv
    log(f"bench latency: {model_path.name}, {args.dtype}, {torch.get_num_threads()} threads")
    engines = [lambda: KVServeEngine(str(model_path), dtype)]
    if not args.no_peer:
        engines.append(lambda: TransformersEngine(model_path, dtype))
    results = [measure(make, prompt_ids, lengths, args.decode_tokens, args.repeats, log) for make in engines]

    report = {
        "benchmark": "latency",
        "date": date.today().isoformat(),
        "command": "kvserve " + " ".join(sys.argv[1:]),
        "model": model_path.name,
        "dtype": args.dtype,
        "machine": describe_machine(),
        "results": [asdict(r) for r in results],
    }
    out = Path(args.output or f"benchmarks/latency-{args.dtype}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    table = _markdown_table(report)
    out.with_suffix(".md").write_text(table)
    print(table)
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
