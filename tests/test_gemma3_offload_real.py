"""Gemma 3 270M (float32) with its KV offloaded to the host tier: the full offload's window layers read only
their window, and it generates the paged engine's greedy tokens after a prompt longer than the window."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.attention.offloaded import OffloadedKVCache
from kvserve.config import EngineConfig
from kvserve.engine import LLMEngine
from kvserve.eval.data import WIKITEXT2, require

pytestmark = pytest.mark.real_model

PROMPT_TOKENS = 700  # past the 512-token window


def test_full_offload_generates_the_device_engines_tokens(gemma3_model):
    text = require(WIKITEXT2, "WikiText-2").read_text(encoding="utf-8")[:8000]
    ids = gemma3_model.tokenizer.encode(text, add_special_tokens=False)[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for offload in ("none", "host"):
        config = EngineConfig(model="gemma3-270m", dtype="float32", max_num_batched_tokens=256,
                              kv_cache_memory="256MiB", kv_offload=offload)  # fmt: skip
        llm = LLM.from_engine(LLMEngine(config, gemma3_model))
        tokens[offload] = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
        cache = llm.engine.runner.cache
        llm.engine.close()
    assert isinstance(cache, OffloadedKVCache)
    assert tokens["host"] == tokens["none"]
    fractions = cache.stats.fetch_fraction()
    assert [f == 1.0 for f in fractions] == [w is None for w in gemma3_model.config.layer_windows]
