"""Experiment: which of keys and values int4 hurts: int8 storage with an int4 round trip on K only or V only."""

import itertools
import sys

from kvserve.attention.kv_quant import KVQuant
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import TEXTS
from kvserve.eval.loglikelihood import EngineScorer
from kvserve.eval.perplexity import evaluate_perplexity
from kvserve.models.catalog import resolve_model_path
from kvserve.models.loader import load_model

model = (sys.argv[1] if len(sys.argv) > 1 else "") or None
ntok = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
loaded = load_model(resolve_model_path(model), dtype=EngineConfig(model=model).torch_dtype)
text = TEXTS["wikitext-2"].read_text(encoding="utf-8")
tokens = loaded.tokenizer.encode(text, add_special_tokens=False)[:ntok]
text = loaded.tokenizer.decode(tokens)
orig = KVQuant.quantize


def variant(which, group=None):
    toggle = itertools.cycle(["k", "v"])
    four = KVQuant("int4", loaded.config.head_dim)

    def quantize(self, x):
        part = next(toggle)
        if part in which:
            if group:
                g = x.float().unflatten(-1, (-1, group))
                lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
                s = (hi - lo).clamp(min=1e-6) / 15
                x = (((g - lo) / s).round().clamp(0, 15) * s + lo).flatten(-2)
            else:
                x = four.dequantize(orig(four, x))
        return orig(self, x)

    return quantize


for label, which, group in [("K4V8", "k", None), ("K8V4", "v", None), ("K4V4-g32", "kv", 32), ("K4V4-g16", "kv", 16)]:
    KVQuant.quantize = variant(which, group)
    engine = LLMEngine(
        EngineConfig(
            model=model, kv_cache_dtype="int8", max_num_batched_tokens=256, kv_cache_memory="256MiB", swap_space=0
        ),
        loaded,
    )
    r = evaluate_perplexity(EngineScorer(engine), tokens, text, 1024, 512)
    print(label, r.perplexity, flush=True)
    engine.close()
