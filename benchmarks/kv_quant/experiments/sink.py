"""Experiment: int4 with each sequence's first S tokens kept in full precision (attention sinks)."""

import sys

import torch

from kvserve.attention.paged import PagedKVCache, attend_prefill
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
SINK = 4
side = {}


def forward(self, layer, q, k, v, metadata):
    group, row = metadata.group_of(layer), self.layer_rows[layer]
    k_rows, v_rows = self._rows(k), self._rows(v)
    self._write(row, metadata.slot_mappings[group], k_rows, v_rows)
    quant = self.kv_quant
    q, kr, vr = quant.rotated(q).to(q.dtype), quant.rotated(k).to(q.dtype), quant.rotated(v).to(q.dtype)
    kd, vd = quant.dequantize(k_rows, q.dtype), quant.dequantize(v_rows, q.dtype)
    plan = self._plan_of(metadata)
    assert not plan.decodes
    out = torch.empty_like(q)
    k_cache, v_cache = self.k[row], self.v[row]
    for p, table in zip(plan.prefills, plan.prefill_tables[group], strict=True):
        rows = slice(p.start, p.start + p.query_len)
        if p.context_len == 0:
            side[(row, int(table[0]))] = (kr[rows][:SINK].clone(), vr[rows][:SINK].clone())
            keys, values = kd[rows].clone(), vd[rows].clone()
        else:
            seq_len = p.context_len + p.query_len
            keys = quant.dequantize(k_cache.index_select(0, table).flatten(0, 1)[:seq_len], q.dtype)
            values = quant.dequantize(v_cache.index_select(0, table).flatten(0, 1)[:seq_len], q.dtype)
        sk, sv = side[(row, int(table[0]))]
        keys[:SINK], values[:SINK] = sk, sv
        out[rows] = attend_prefill(q[rows], keys, values, p.context_len)
    return quant.rotated(out).to(q.dtype)


PagedKVCache.forward = forward
for s in [int(c) for c in sys.argv[3].split(",")]:
    SINK = s
    engine = LLMEngine(
        EngineConfig(
            model=model,
            kv_cache_dtype="int4",
            max_num_batched_tokens=256,
            kv_cache_memory="256MiB",
            swap_space=0,
            enable_prefix_caching=False,
        ),
        loaded,
    )
    r = evaluate_perplexity(EngineScorer(engine), tokens, text, 1024, 512)
    print("int4 sink", s, r.perplexity, flush=True)
    engine.close()
