"""Experiment: keys centred by a calibrated per-(layer, KV head) channel mean before rotation and int4."""

import sys

from kvserve.attention.paged import PagedKVCache
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import TEXTS
from kvserve.eval.loglikelihood import EngineScorer
from kvserve.eval.perplexity import evaluate_perplexity
from kvserve.models.catalog import resolve_model_path
from kvserve.models.loader import load_model
from kvserve.sampling.sampling_params import SamplingParams

model = (sys.argv[1] if len(sys.argv) > 1 else "") or None
ntok = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
loaded = load_model(resolve_model_path(model), dtype=EngineConfig(model=model).torch_dtype)
text = TEXTS["wikitext-2"].read_text(encoding="utf-8")
tokens = loaded.tokenizer.encode(text, add_special_tokens=False)
calib, tokens = tokens[-2048:], tokens[:ntok]  # calibrate on the text's end, score its start
text = loaded.tokenizer.decode(tokens)
orig_forward = PagedKVCache.forward
sums = {}


def recording(self, layer, q, k, v, metadata):
    s = sums.setdefault(layer, [0, 0])
    s[0] = s[0] + k.float().sum(0)
    s[1] += k.shape[0]
    return orig_forward(self, layer, q, k, v, metadata)


PagedKVCache.forward = recording
engine = LLMEngine(
    EngineConfig(model=model, max_num_batched_tokens=2048, kv_cache_memory="256MiB", swap_space=0), loaded
)
engine.add_request(calib, SamplingParams(max_tokens=1))
while engine.has_unfinished_requests():
    engine.step()
engine.close()
mu = {l: s[0] / s[1] for l, s in sums.items()}  # (Hkv, D)
for l in (0, len(mu) // 2, len(mu) - 1):
    print("layer", l, "mean norm / typical key norm", mu[l].norm(dim=-1).tolist())


def centred(self, layer, q, k, v, metadata):
    return orig_forward(self, layer, q, k - mu[layer].to(k.dtype), v, metadata)


PagedKVCache.forward = centred
for dtype in sys.argv[3].split(","):
    engine = LLMEngine(
        EngineConfig(
            model=model, kv_cache_dtype=dtype, max_num_batched_tokens=256, kv_cache_memory="256MiB", swap_space=0
        ),
        loaded,
    )
    r = evaluate_perplexity(EngineScorer(engine), tokens, text, 1024, 512)
    print("centred", dtype, r.perplexity, flush=True)
    engine.close()
