"""Which 4-bit (and 8-bit) KV rows keep their accuracy: WikiText-2 perplexity with and without the Hadamard rotation.

One engine per (KV dtype, rotation) on one model; the rotation is switched off on the cache's ``KVQuant`` before
anything is scored. Chunked prefill of ``--chunk`` tokens; every query reads keys as the cache holds them.

    python benchmarks/kv_quant/rotation.py --model gemma3-270m --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import time

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import TEXTS
from kvserve.eval.loglikelihood import EngineScorer
from kvserve.eval.perplexity import evaluate_perplexity
from kvserve.models.catalog import resolve_model_path
from kvserve.models.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    parser.add_argument("--out", default=None)
    parser.add_argument("--runs", default="auto,int8,int8-norot,int4,int4-norot", help="KV dtypes; -norot: no rotation")
    args = parser.parse_args()
    probe = EngineConfig(model=args.model)
    loaded = load_model(resolve_model_path(args.model), dtype=probe.torch_dtype)
    text = TEXTS["wikitext-2"].read_text(encoding="utf-8")
    tokens = loaded.tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
    text = loaded.tokenizer.decode(tokens)
    rows = []
    runs = [(r.removesuffix("-norot"), None if r == "auto" else not r.endswith("-norot")) for r in args.runs.split(",")]
    for dtype, rotate in runs:
        config = EngineConfig(
            model=args.model, kv_cache_dtype=dtype, max_num_batched_tokens=args.chunk, kv_cache_memory="256MiB",
            swap_space=0,
        )  # fmt: skip
        engine = LLMEngine(config, loaded)
        quant = engine.runner.cache.kv_quant
        if quant is not None:
            quant.rotate = rotate
        start = time.perf_counter()
        result = evaluate_perplexity(EngineScorer(engine), tokens, text, args.context, args.stride)
        rows.append({"kv_cache_dtype": dtype, "rotate": rotate, "perplexity": result.perplexity,
                     "seconds": time.perf_counter() - start})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        engine.close()
    base = rows[0]["perplexity"]
    for row in rows:
        row["vs_model_dtype"] = row["perplexity"] / base - 1
        print(f"{row['kv_cache_dtype']:5} rotate={row['rotate']!s:5} ppl {row['perplexity']:.4f} "
              f"({row['vs_model_dtype']:+.3%})")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": loaded.path.name, "tokens": args.tokens, "context": args.context,
                       "stride": args.stride, "chunk": args.chunk, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
