"""Restart with a persisted Prompt Cache module: a fresh process's first PML request against a warm server's.

Process A, over an empty ``prompt_cache_dir``, registers a schema whose module is a ~4k-token L-Eval document
(encoding it: the cold start every restart paid before the folder existed), answers a warm-up question, then
questions R1..R3 (warm TTFTs), and closes (its module file written). Process B, fresh, over the same folder,
registers the schema (the module loaded from its file, no encoding) and answers R1 as its first request. Each
process loads the model itself (not timed); TTFT is a request's arrival to its first sampled token, one at a time.

    .venv/bin/python benchmarks/prompt_cache/restart.py [--tokens 4096] [--dtype auto] [--threads 2]

writes restart.json and restart.md next to this file (``--output`` for elsewhere).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARM = 3  # questions A answers after its warm-up


def phase(args: argparse.Namespace) -> dict:
    """One process: register the schema (timed) and answer the questions (TTFT each)."""
    import torch

    from kvserve.bench.prompt_cache import leval_text_and_questions, schema_and_prompts, time_to_first_token
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine

    torch.set_num_threads(args.threads)
    config = EngineConfig(dtype=args.dtype, kv_cache_memory="1GiB", swap_space=0, prompt_cache_dir=args.dir)
    engine = LLMEngine(config)
    text, questions = leval_text_and_questions(1 + WARM)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
    schema, prompts = schema_and_prompts("restart", engine.tokenizer.decode(ids), questions, "prefix")
    start = time.perf_counter()
    engine.register_schema(schema)
    engine.encode_modules()
    register_s = time.perf_counter() - start
    order = prompts if args.phase == "A" else prompts[1:2]  # A: a warm-up, then R1..R3; B: R1 first
    ttfts = [time_to_first_token(engine, p)[0] for p in order]
    ttft = ttfts[1] if args.phase == "A" else ttfts[0]  # R1 either way
    warm = statistics.median(ttfts[1:]) if args.phase == "A" else None
    start = time.perf_counter()
    engine.close()  # A: waits for its module file
    store = engine.prompt_cache.store
    info = engine.prompt_cache.info("restart").to_dict()
    return {
        "phase": args.phase, "register_s": register_s, "ttft_s": ttft, "median_warm_ttft_s": warm, "ttfts_s": ttfts,
        "close_s": time.perf_counter() - start,
        "encoded_tokens": store.stats.encoded_tokens, "loads": store.files.stats.loads,
        "writes": store.files.stats.writes, "module_tokens": info["modules"]["doc"]["tokens"],
        "dtype": str(engine.loaded.dtype).removeprefix("torch."), "model": engine.loaded.path.name,
    }  # fmt: skip


def run_phase(name: str, folder: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--phase", name, "--dir", folder, "--tokens", str(args.tokens),
               "--dtype", args.dtype, "--threads", str(args.threads)]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="module (document) tokens")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=HERE / "restart")
    parser.add_argument("--phase", choices=("A", "B"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvserve-restart-") as folder:
        a = run_phase("A", folder, args)
        b = run_phase("B", folder, args)
        file_bytes = sum(p.stat().st_size for p in Path(folder).iterdir())
    from kvserve.platform.machine import describe_machine

    report = {"command": " ".join(["python", "benchmarks/prompt_cache/restart.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "machine": describe_machine(), "threads": args.threads,
              "A": a, "B": b, "file_bytes": file_bytes, "ratio_b_to_warm": b["ttft_s"] / a["ttft_s"]}  # fmt: skip
    args.output.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.output.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(r: dict) -> str:
    a, b, m = r["A"], r["B"], r["machine"]
    return "\n".join([
        f"# Prompt Cache restart: {a['module_tokens']:,}-token module, {a['model']}, {a['dtype']}",
        "",
        f"`{r['command']}` on {r['date']}: {m['cpu']}, {m['nproc']} CPUs, {r['threads']} threads. "
        f"Module file: {r['file_bytes'] / 2**20:.1f} MiB.",
        "",
        "| process | schema registration (s) | tokens encoded | modules loaded | TTFT of R1 (ms) |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| A: empty folder, cold encode; R1 after a warm-up question | {a['register_s']:.2f} | "
        f"{a['encoded_tokens']:,} | {a['loads']} | {a['ttft_s'] * 1e3:.1f} |",
        f"| B: fresh process, same folder; its first request, R1 | {b['register_s']:.2f} | {b['encoded_tokens']:,} | "
        f"{b['loads']} | {b['ttft_s'] * 1e3:.1f} |",
        "",
        f"B's first TTFT / A's warm TTFT of the same request: {r['ratio_b_to_warm']:.2f}x (A's median over R1..R3: "
        f"{a['median_warm_ttft_s'] * 1e3:.0f} ms). Before the folder, a restarted server's "
        f"first request waited for the encode: {a['register_s']:.2f} s + {a['ttft_s'] * 1e3:.0f} ms "
        f"(now {b['register_s']:.2f} s to load at registration).",
        "",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
