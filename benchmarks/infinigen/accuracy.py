"""InfiniGen's accuracy: WikiText-2 perplexity and multiple-choice accuracy against the full cache and H2O.

Three sweeps, each point one engine with its KV offloaded to the host tier (``kv_offload="host"``):

- alpha "auto" (each layer's alpha calibrated on the model, the default) and 1..9 at partial ratio 0.3, and
  partial ratio 0.1..0.9 at alpha 4 (the paper's Figure 17 shape);
- a KV pool limited to 80% of each sequence's KV with counter / LRU / FIFO eviction, alpha 4 (Table 2's shape);
- baselines: the full cache, H2O at several budgets (the share of the KV it keeps, i.e. reads per step),
  INT4 KV.

Every configuration goes through the eval tools' scorer (``EngineScorer``): a window's context runs in
steps of its own, then its scored continuation is computed as one chunk in which every row attends
only to the cached rows its own rehearsal selects (plus itself), as decoding it token by token would.
The fetch fraction is the share of earlier rows the rehearsal selected, averaged over rows and layers
(layer 0 always reads everything): the bytes InfiniGen moves relative to fetching everything. H2O's is
the share of earlier rows its scored rows read (``h2o_read_fraction``): more than its budget, since a
scored chunk also reads its own earlier rows uncompressed.

With ``--agree-tokens N`` every configuration also generates N greedy tokens after a long prompt (the
``--agree-prompt`` tokens of Emma from past InfiniGen's calibration sample) and reports how many match the
full cache's, and where the first difference is.

    python benchmarks/infinigen/accuracy.py --threads 2

writes benchmarks/infinigen/accuracy.json and accuracy.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from kvserve.attention.offloaded import OffloadedKVCache
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import AUSTEN, WIKITEXT2
from kvserve.eval.loglikelihood import EngineScorer
from kvserve.eval.multiple_choice import evaluate_multiple_choice, load_questions
from kvserve.eval.perplexity import evaluate_perplexity, sliding_windows
from kvserve.models import load_model
from kvserve.models.dtype import DTYPE_NAMES, DTYPES, resolve_dtype_name
from kvserve.policies.infinigen import InfiniGen, parse_alpha
from kvserve.sampling.sampling_params import SamplingParams

HERE = Path(__file__).parent


def points(args: argparse.Namespace) -> list[dict]:
    """Every configuration of the sweep, as EngineConfig options plus a label."""
    out = [{"label": "full", "kv_policy": "full"}]
    for budget in args.h2o_budgets.split(","):
        out.append({"label": f"h2o {budget}", "kv_policy": "h2o", "kv_budget": float(budget)})
    out.append({"label": "int4", "kv_policy": "int4", "kv_offload": "host"})
    for alpha in args.alphas.split(","):
        out.append({"label": f"infinigen a={alpha}", "sweep": "alpha", "kv_policy": "infinigen", "kv_offload": "host",
                    "infinigen_alpha": parse_alpha(alpha), "infinigen_partial_ratio": 0.3})  # fmt: skip
    for ratio in args.ratios.split(","):
        if float(ratio) == 0.3 and "4" in args.alphas.split(","):
            continue  # the alpha sweep has it
        out.append({"label": f"infinigen r={ratio}", "sweep": "ratio", "kv_policy": "infinigen", "kv_offload": "host",
                    "infinigen_alpha": 4.0, "infinigen_partial_ratio": float(ratio)})  # fmt: skip
    for eviction in args.evictions.split(","):
        out.append({"label": f"pool 80% {eviction}", "sweep": "pool", "kv_policy": "infinigen", "kv_offload": "host",
                    "infinigen_alpha": 4.0, "kv_pool_limit": 0.8, "kv_pool_eviction": eviction,
                    "ppl_only": True})  # fmt: skip
    return out


def h2o_read_fraction(engine: LLMEngine, num_tokens: int) -> float:
    """The share of earlier tokens an H2O-scored row reads, averaged over the scored rows.

    A window's context is compressed to the policy's capacity before its continuation is scored as one
    chunk, whose rows also see the chunk's rows before them: row j of a window with context c reads
    kept(c) + j of its c + j predecessors (the first window's 1-token context is never compressed).
    """
    policy, layers = engine.kv_policy, engine.loaded.config.num_layers
    read = total = 0
    for window in sliding_windows(num_tokens, 2048, 512):
        context = window.scored_from - window.begin
        kept = policy.capacity(0, layers, context)
        rows = window.end - window.scored_from
        read += rows * kept + rows * (rows - 1) // 2
        total += rows * context + rows * (rows - 1) // 2
    return read / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model name or path (default: kvserve's default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--limit-tokens", type=int, default=8192, help="WikiText-2 tokens scored")
    parser.add_argument("--pool-limit-tokens", type=int, default=4096, help="WikiText-2 tokens for the pool sweep")
    parser.add_argument("--tasks", default="arc_easy")
    parser.add_argument("--mc-limit", type=int, default=500, help="questions per multiple-choice task")
    parser.add_argument("--alphas", default="auto,1,2,3,4,5,6,7,8,9", help="comma-separated: auto or numbers")
    parser.add_argument("--ratios", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--h2o-budgets", default="0.1,0.2,0.3")
    parser.add_argument("--evictions", default="counter,lru,fifo")
    parser.add_argument("--only", default=None, help="comma-separated labels to run (default: all)")
    parser.add_argument("--mc-sweeps", default="baseline,alpha", help="sweeps that also run multiple choice")
    parser.add_argument("--agree-tokens", type=int, default=0, help="greedy tokens compared with the full cache's")
    parser.add_argument("--agree-prompt", type=int, default=2000, help="prompt tokens before them")
    parser.add_argument("--output", type=Path, default=HERE / "accuracy.json")
    parser.add_argument("--combine", type=Path, nargs="+", default=None,
                        help="only merge these reports (parts of the sweep) into --output and plot")  # fmt: skip
    args = parser.parse_args()
    if args.combine:
        return combine(args.combine, args.output)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype_name(args.dtype, "cpu")
    loaded = load_model(args.model, dtype=DTYPES[dtype])
    all_tokens = loaded.tokenizer.encode(WIKITEXT2.read_text(encoding="utf-8"), add_special_tokens=False)
    tasks = {task: load_questions(task, args.mc_limit) for task in args.tasks.split(",")}
    chosen = points(args)
    if args.only:
        chosen = [p for p in chosen if p["label"] in args.only.split(",")]
    results, reference = [], None  # reference: the first configuration's greedy tokens (the full cache's)
    for point in chosen:
        options = {k: v for k, v in point.items() if k not in ("label", "sweep", "ppl_only")}
        engine = LLMEngine(EngineConfig(dtype=dtype, kv_cache_memory="2GiB", enable_prefix_caching=False, **options),
                           loaded)  # fmt: skip
        scorer = EngineScorer(engine, progress=False)
        start = time.perf_counter()
        limit = args.pool_limit_tokens if point.get("ppl_only") else args.limit_tokens
        tokens = all_tokens[:limit]
        ppl = evaluate_perplexity(scorer, tokens, loaded.tokenizer.decode(tokens), 2048, 512)
        row = {"label": point["label"], "sweep": point.get("sweep", "baseline"), **options,
               "ppl_tokens": limit, "perplexity": ppl.perplexity}  # fmt: skip
        cache = engine.runner.cache
        if isinstance(cache, OffloadedKVCache):
            fractions = cache.stats.fetch_fraction()
            row["fetch_fraction"] = sum(fractions) / len(fractions)
            row["fetch_fraction_per_layer"] = fractions
            if isinstance(cache.policy, InfiniGen):
                row["alpha_per_layer"] = cache.policy.alpha if isinstance(cache.policy.alpha, tuple) else None
        elif options["kv_policy"] == "h2o":
            row["fetch_fraction"] = h2o_read_fraction(engine, len(tokens))
        else:
            row["fetch_fraction"] = 1.0
        if not point.get("ppl_only") and point.get("sweep", "baseline") in args.mc_sweeps.split(","):
            for task, questions in tasks.items():
                mc = evaluate_multiple_choice(scorer, loaded.tokenizer, task, questions)
                row[task] = mc["acc"]
                row[f"{task}_norm"] = mc["acc_norm"]
        if args.agree_tokens:
            row.update(agreement(engine, loaded.tokenizer, args, reference))
            reference = reference or row.pop("_tokens")
            row.pop("_tokens", None)
        row["seconds"] = time.perf_counter() - start
        engine.close()
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_per_layer")}), file=sys.stderr,
              flush=True)  # fmt: skip
    report = {
        "command": " ".join(sys.argv),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "model": loaded.path.name,
        "dtype": DTYPE_NAMES[loaded.dtype],
        "ppl": {
            "data": "wikitext-2 test",
            "tokens": args.limit_tokens,
            "pool_tokens": args.pool_limit_tokens,
            "context": 2048,
            "stride": 512,
        },  # fmt: skip
        "mc": {task: len(q) for task, q in tasks.items()},
        "results": results,
    }
    args.output.write_text(json.dumps(report, indent=2))
    plot(report, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}", file=sys.stderr)
    return 0


def agreement(engine: LLMEngine, tokenizer, args: argparse.Namespace, reference: list[int] | None) -> dict:  # noqa: ANN001
    """Greedy tokens after a long prompt of Emma, against ``reference`` (None: these become the reference)."""
    text = AUSTEN.read_text(encoding="utf-8")[60_000:]  # past the calibration sample (Emma's first 2,048 tokens)
    prompt = tokenizer.encode(text[: args.agree_prompt * 8], add_special_tokens=False)[: args.agree_prompt]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=args.agree_tokens, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done.extend(o for o in engine.step() if o.finished)
    tokens = list(done[0].outputs[0].token_ids)
    if reference is None:
        return {"_tokens": tokens, "greedy_match": 1.0, "greedy_first_difference": None}
    same = [a == b for a, b in zip(tokens, reference, strict=True)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return {"greedy_match": sum(same) / len(same), "greedy_first_difference": first}


def combine(parts: list[Path], output: Path) -> int:
    """One report from several runs of parts of the sweep (same settings), in the order given."""
    reports = [json.loads(p.read_text()) for p in parts]
    merged = {**reports[0], "command": [r["command"] for r in reports],
              "results": [row for r in reports for row in r["results"]]}  # fmt: skip
    output.write_text(json.dumps(merged, indent=2))
    plot(merged, output.with_suffix(".png"))
    print(f"wrote {output} and {output.with_suffix('.png')}", file=sys.stderr)
    return 0


def plot(report: dict, path: Path) -> None:
    """Perplexity and accuracy against alpha and against the partial ratio; and against the fetch fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    full = next((r for r in rows if r["label"] == "full"), None)
    metrics = ["perplexity", *report["mc"]]
    fig, axes = plt.subplots(len(metrics), 3, figsize=(15, 3.8 * len(metrics)), squeeze=False)
    for m, metric in enumerate(metrics):
        for col, (sweep, key, xlabel) in enumerate(
            (("alpha", "infinigen_alpha", "alpha"), ("ratio", "infinigen_partial_ratio", "partial ratio"))
        ):
            ax = axes[m][col]
            points = sorted((r[key], r[metric]) for r in rows if metric in r and not isinstance(r.get(key), str) and (
                r.get("sweep") == sweep or (sweep == "ratio" and r.get("sweep") == "alpha" and r[key] == 0.3
                                            and r["infinigen_alpha"] == 4.0)))  # fmt: skip
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label="infinigen")
            if full is not None and metric in full:
                ax.axhline(full[metric], color="gray", linestyle="--", label="full cache")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(metric)
            if metric == "perplexity":
                ax.set_yscale("log")
            ax.legend(fontsize=8)
        ax = axes[m][2]
        for name, select in (("infinigen", lambda r: r["kv_policy"] == "infinigen" and r.get("sweep") != "pool"
                              and r.get("infinigen_alpha") != "auto"),
                             ("infinigen alpha auto", lambda r: r.get("infinigen_alpha") == "auto"),
                             ("h2o", lambda r: r["kv_policy"] == "h2o")):  # fmt: skip
            points = sorted((r["fetch_fraction"], r[metric]) for r in rows if select(r) and metric in r)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", linestyle="none", label=name)
        if full is not None and metric in full:
            ax.axhline(full[metric], color="gray", linestyle="--", label="full cache")
        ax.set_xlabel("KV fetched per step (share of the full cache)")
        ax.set_ylabel(metric)
        if metric == "perplexity":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"InfiniGen accuracy: {report['model']}, {report['dtype']}, WikiText-2 {report['ppl']['tokens']:,} tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
