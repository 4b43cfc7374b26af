"""Experiment: keys quantized per channel over groups of G tokens (KIVI), with or without rotation/centering; values
int4 per token (rotated). Emulated through an int8 cache whose key rows are written already KIVI-rounded."""

import itertools
import sys

import torch

from kvserve.attention.kv_quant import KVQuant
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import TEXTS
from kvserve.eval.loglikelihood import EngineScorer
from kvserve.eval.perplexity import evaluate_perplexity
from kvserve.models.catalog import resolve_model_path
from kvserve.models.loader import load_model

model = (sys.argv[1] if len(sys.argv) > 1 else "") or None
ntok = int(sys.argv[2])
loaded = load_model(resolve_model_path(model), dtype=EngineConfig(model=model).torch_dtype)
text = TEXTS["wikitext-2"].read_text(encoding="utf-8")
tokens = loaded.tokenizer.encode(text, add_special_tokens=False)[:ntok]
text = loaded.tokenizer.decode(tokens)
orig = KVQuant.quantize
four = KVQuant("int4", loaded.config.head_dim)


def variant(G, bits):
    toggle = itertools.cycle(["k", "v"])
    levels = 2**bits - 1

    def quantize(self, x):
        part = next(toggle)
        if part == "k":
            n = x.shape[0]
            pad = (-n) % G
            xf = x.float()
            if pad:
                xf = torch.cat((xf, xf[-1:].expand(pad, *xf.shape[1:])))
            g = xf.unflatten(0, (-1, G))  # (n/G, G, Hkv, D)
            lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
            s = (hi - lo).clamp(min=1e-6) / levels
            x = ((((g - lo) / s).round().clamp(0, levels)) * s + lo).flatten(0, 1)[:n]
        else:
            x = four.dequantize(orig(four, x))
        return orig(self, x)

    return quantize


for G, bits in [(16, 4), (32, 4), (16, 3)]:
    KVQuant.quantize = variant(G, bits)
    engine = LLMEngine(
        EngineConfig(
            model=model,
            kv_cache_dtype="int8",
            max_num_batched_tokens=256,
            kv_cache_memory="256MiB",
            swap_space=0,
            enable_prefix_caching=False,
        ),
        loaded,
    )
    r = evaluate_perplexity(EngineScorer(engine), tokens, text, 1024, 512)
    print(f"KIVI keys per-channel G={G} {bits}-bit (rotated), V int4 per token:", r.perplexity, flush=True)
    engine.close()
