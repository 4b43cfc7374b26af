"""Experiment: int4 with each prefill chunk's own keys/values unquantized (a KIVI-like recent window of <= chunk)."""

import sys

from kvserve.attention.paged import PagedKVCache
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


def forward(self, layer, q, k, v, metadata):
    group, row = metadata.group_of(layer), self.layer_rows[layer]
    k_rows, v_rows = self._rows(k), self._rows(v)
    self._write(row, metadata.slot_mappings[group], k_rows, v_rows)
    quant = self.kv_quant
    out = self._attend(
        layer, quant.rotated(q).to(q.dtype), quant.rotated(k).to(q.dtype), quant.rotated(v).to(q.dtype), metadata
    )
    return quant.rotated(out).to(q.dtype)


PagedKVCache.forward = forward
for chunk in [int(c) for c in sys.argv[3].split(",")]:
    engine = LLMEngine(
        EngineConfig(
            model=model, kv_cache_dtype="int4", max_num_batched_tokens=chunk, kv_cache_memory="256MiB", swap_space=0
        ),
        loaded,
    )
    r = evaluate_perplexity(EngineScorer(engine), tokens, text, 1024, 512)
    print("int4 chunk-own full precision, chunk", chunk, r.perplexity, flush=True)
    engine.close()
