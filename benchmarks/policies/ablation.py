"""Where PyramidInfer's perplexity cost comes from: its parts switched one at a time, at one budget.

    python benchmarks/policies/ablation.py --threads 2 --budget 0.5 --limit-tokens 6144

WikiText-2 perplexity (2,048-token windows, stride 512: 1,536 tokens of compressed context before the
512 scored ones) for: the full cache; PyramidInfer as configured by default; without dropping rows
from the hidden states; with a 20% / 10% recent window; with one retention for every layer (no
pyramid); and the local-window and H2O baselines at the same budget. Writes ablation.json beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import WIKITEXT2
from kvserve.eval.loglikelihood import EngineScorer
from kvserve.eval.perplexity import evaluate_perplexity
from kvserve.models import load_model
from kvserve.models.dtype import DTYPE_NAMES, DTYPES, resolve_dtype_name
from kvserve.policies import KVPolicy, PyramidInfer, make_policy


def variants(budget: float, num_layers: int) -> dict[str, KVPolicy]:
    return {
        "full cache": make_policy("full"),
        "pyramid (default)": PyramidInfer(budget),
        "pyramid, rows kept": PyramidInfer(budget, drops_rows=False),
        "pyramid, recent 20%": PyramidInfer(budget, recent_ratio=0.2),
        "pyramid, recent 10%": PyramidInfer(budget, recent_ratio=0.1),
        "pyramid, one budget for all layers": PyramidInfer(budget, layer_retention=(budget,) * num_layers),
        "local": make_policy("local", budget),
        "h2o": make_policy("h2o", budget),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--limit-tokens", type=int, default=6144)
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "ablation.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype_name(args.dtype, "cpu")
    loaded = load_model(dtype=DTYPES[dtype])
    tokens = loaded.tokenizer.encode(WIKITEXT2.read_text(encoding="utf-8"), add_special_tokens=False)
    tokens = tokens[: args.limit_tokens]
    text = loaded.tokenizer.decode(tokens)
    rows = []
    for name, policy in variants(args.budget, loaded.config.num_layers).items():
        config = EngineConfig(dtype=dtype, kv_policy="pyramid", kv_cache_memory="1GiB", swap_space=0)
        engine = LLMEngine(config, loaded)
        engine.kv_policy = policy  # every request runs this variant (the engine's policy is the default)
        ppl = evaluate_perplexity(EngineScorer(engine, progress=False), tokens, text, 2048, 512).perplexity
        rows.append({"variant": name, "perplexity": ppl})
        print(f"{name:40s} {ppl:8.3f}", file=sys.stderr, flush=True)
    report = {
        "command": " ".join(sys.argv),
        "model": loaded.path.name,
        "dtype": DTYPE_NAMES[loaded.dtype],
        "threads": torch.get_num_threads(),
        "budget": args.budget,
        "tokens": len(tokens),
        "results": rows,
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
