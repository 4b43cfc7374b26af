"""L-Eval QuALITY with Prompt Cache against the plain prompts, in one run (same model, same engine options).

Each document (truncated to the context as the baseline truncates it) becomes a Prompt Cache module
encoded alone, so it no longer attends to the chat template and instruction before it; each question
is a PML prompt importing it. Everything else (positions, greedy decoding, scoring) is the baseline's.
Writes accuracy.json and accuracy.md next to this script.

    .venv/bin/python benchmarks/prompt_cache/accuracy.py --threads 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvserve.bench.machine import describe_machine
from kvserve.config import EngineConfig
from kvserve.engine import LLMEngine
from kvserve.eval.longqa import evaluate_longqa
from kvserve.models.dtype import DTYPE_NAMES
from kvserve.models.loader import load_model

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--limit", type=int, default=None, help="first N documents (default: all 15)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(dtype=dtype)
    runs = {}
    for prompt_cache in (False, True):
        engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory="2GiB", swap_space=0), loaded)
        runs[prompt_cache] = evaluate_longqa(engine, "quality", limit=args.limit, prompt_cache=prompt_cache)
    base, cached = runs[False]["questions"], runs[True]["questions"]
    same = sum(b["letter"] == c["letter"] for b, c in zip(base, cached, strict=True))
    gained = sum(c["score"] > b["score"] for b, c in zip(base, cached, strict=True))
    lost = sum(c["score"] < b["score"] for b, c in zip(base, cached, strict=True))
    summary = {
        "model": loaded.path.name, "dtype": DTYPE_NAMES[dtype], "threads": args.threads,
        "machine": describe_machine(), "questions": len(base), "documents": runs[False]["num_documents"],
        "context": runs[False]["context"],
        "baseline": {k: runs[False][k] for k in ("score", "score_stderr", "seconds", "cached_prompt_tokens")},
        "prompt_cache": {k: runs[True][k] for k in ("score", "score_stderr", "seconds", "cached_prompt_tokens")},
        "difference_points": 100 * (runs[True]["score"] - runs[False]["score"]),
        "same_answer_letter": same, "right_only_with_prompt_cache": gained, "right_only_without": lost,
    }  # fmt: skip
    (HERE / "accuracy.json").write_text(json.dumps({**summary, "runs": runs}, indent=2) + "\n")
    b, c = summary["baseline"], summary["prompt_cache"]
    m = summary["machine"]
    table = "\n".join([
        f"# L-Eval QuALITY: Prompt Cache vs plain prompts, {summary['model']}, {summary['dtype']}",
        "",
        f"`python benchmarks/prompt_cache/accuracy.py --threads {args.threads}` on {m['cpu']}, {m['nproc']} CPUs, "
        f"torch {m['torch']}, {args.threads} threads. {summary['questions']} questions over {summary['documents']} "
        f"documents, prompts of at most {summary['context']} tokens, greedy, option letter scored.",
        "",
        "| prompts | option accuracy | stderr | prompt tokens from a cache | time (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| plain (prefix caching on) | {b['score']:.4f} | {b['score_stderr']:.4f} | {b['cached_prompt_tokens']:,} | "
        f"{b['seconds']:.0f} |",
        f"| Prompt Cache (document = module) | {c['score']:.4f} | {c['score_stderr']:.4f} | "
        f"{c['cached_prompt_tokens']:,} | {c['seconds']:.0f} |",
        "",
        f"Difference: {summary['difference_points']:+.1f} points. Same answer letter on {same} of {len(base)} "
        f"questions; right only with Prompt Cache: {gained}, right only without: {lost}.",
    ]) + "\n"  # fmt: skip
    (HERE / "accuracy.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
