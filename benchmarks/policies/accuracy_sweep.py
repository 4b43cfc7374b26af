"""Accuracy of the KV policies at several budgets: WikiText-2 perplexity and two multiple-choice tasks.

Every configuration goes through the same eval code as `kvserve eval` (``EngineScorer``): the context
of each scored pair is computed and compressed in its own steps, then the continuation is scored
against the compressed cache (perplexity: 2,048-token windows, stride 512, so 1,536 tokens of
compressed context before the 512 scored ones). The model is loaded once; one engine per point.

    python benchmarks/policies/accuracy_sweep.py --threads 2 --limit-tokens 16384 --mc-limit 500

writes benchmarks/policies/accuracy.json and accuracy.png (one panel per metric, one line per policy).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import WIKITEXT2
from kvserve.eval.loglikelihood import EngineScorer
from kvserve.eval.multiple_choice import evaluate_multiple_choice, load_questions
from kvserve.eval.perplexity import evaluate_perplexity
from kvserve.models import load_model
from kvserve.models.dtype import DTYPE_NAMES, DTYPES, resolve_dtype_name

HERE = Path(__file__).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model name or path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--policies", default="pyramid,local,h2o")
    parser.add_argument("--budgets", default="0.25,0.5,0.75")
    parser.add_argument("--limit-tokens", type=int, default=16384, help="WikiText-2 tokens scored")
    parser.add_argument("--tasks", default="arc_easy,piqa")
    parser.add_argument("--mc-limit", type=int, default=500, help="questions per multiple-choice task")
    parser.add_argument(
        "--mc-points",
        default=None,
        help="POLICY:BUDGET,... the multiple-choice tasks run at besides full (default: every point)",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a log of this script's earlier rows (its stderr): points found there are not rerun",
    )
    parser.add_argument("--output", type=Path, default=HERE / "accuracy.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype_name(args.dtype, "cpu")
    loaded = load_model(args.model, dtype=DTYPES[dtype])
    tokens = loaded.tokenizer.encode(WIKITEXT2.read_text(encoding="utf-8"), add_special_tokens=False)
    tokens = tokens[: args.limit_tokens]
    text = loaded.tokenizer.decode(tokens)
    tasks = {task: load_questions(task, args.mc_limit) for task in args.tasks.split(",")}
    points = [("full", 1.0)] + [
        (policy, float(b)) for policy in args.policies.split(",") for b in args.budgets.split(",")
    ]
    mc_points = None if args.mc_points is None else {_point(p) for p in args.mc_points.split(",")}
    done = _earlier_rows(args.resume) if args.resume else {}
    results = []
    for policy, budget in points:
        wants_mc = mc_points is None or policy == "full" or (policy, budget) in mc_points
        earlier = done.get((policy, budget))
        if earlier is not None and (not wants_mc or all(task in earlier for task in tasks)):
            results.append(earlier)
            continue
        config = EngineConfig(
            dtype=dtype, kv_policy=policy, kv_budget=None if policy == "full" else budget,
            kv_cache_memory="2GiB", max_num_seqs=64, enable_prefix_caching=False, model=str(loaded.path),
        )  # fmt: skip
        engine = LLMEngine(config, loaded)
        scorer = EngineScorer(engine, progress=False)
        start = time.perf_counter()
        ppl = evaluate_perplexity(scorer, tokens, text, 2048, 512)
        row = {"policy": policy, "budget": budget, "perplexity": ppl.perplexity}
        for task, questions in tasks.items() if wants_mc else ():
            mc = evaluate_multiple_choice(scorer, loaded.tokenizer, task, questions)
            row[task] = mc["acc"]
            row[f"{task}_norm"] = mc["acc_norm"]
        row["seconds"] = time.perf_counter() - start
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    report = {
        "command": " ".join(sys.argv),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "model": loaded.path.name,
        "dtype": DTYPE_NAMES[loaded.dtype],
        "ppl": {"data": "wikitext-2 test", "tokens": len(tokens), "context": 2048, "stride": 512},
        "mc": {task: len(q) for task, q in tasks.items()},
        "results": results,
    }
    args.output.write_text(json.dumps(report, indent=2))
    plot(report, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}", file=sys.stderr)
    return 0


def _point(text: str) -> tuple[str, float]:
    policy, budget = text.split(":")
    return policy, float(budget)


def _earlier_rows(log: Path) -> dict[tuple[str, float], dict]:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return {(r["policy"], r["budget"]): r for r in rows}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["perplexity", *report["mc"]]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4))
    full = next(r for r in report["results"] if r["policy"] == "full")
    policies = sorted({r["policy"] for r in report["results"]} - {"full"})
    for ax, metric in zip(axes, metrics, strict=True):
        for policy in policies:
            rows = sorted(
                (r for r in report["results"] if r["policy"] == policy and metric in r), key=lambda r: r["budget"]
            )
            rows.append(full)  # every policy is the full cache at budget 1
            ax.plot([r["budget"] * 100 for r in rows], [r[metric] for r in rows], marker="o", label=policy)
        ax.set_xlabel("KV budget (% of the full cache)")
        ax.set_ylabel(metric if metric == "perplexity" else f"{metric} accuracy")
        ax.set_title(metric if metric == "perplexity" else f"{metric} (n={report['mc'][metric]})")
        if metric == "perplexity":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"KV policies: {report['model']}, {report['dtype']}, WikiText-2 {report['ppl']['tokens']:,} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
