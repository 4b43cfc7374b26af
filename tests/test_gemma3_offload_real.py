"""Gemma 3 270M (float32) with its KV offloaded to the host tier: the 3 global layers' KV in the tier and the 15
window layers' on the device, generating the paged engine's greedy tokens after a prompt longer than the window;
InfiniGen's calibrated default selects in every layer it fetches (window layers too where the tier keeps them)."""

from __future__ import annotations

import itertools

import pytest

from kvserve import LLM, SamplingParams
from kvserve.attention.split_offload import SplitOffloadKVCache
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import WIKITEXT2, require
from kvserve.policies.skewing import SKEWING_DIR_ENV

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
    assert isinstance(cache, SplitOffloadKVCache)
    assert tokens["host"] == tokens["none"]
    global_layers = [i for i, w in enumerate(gemma3_model.config.layer_windows) if w is None]
    assert cache.offloaded.num_layers == len(global_layers) == 3
    assert cache.stats.fetch_fraction() == [1.0] * 3  # a global layer reads every row


def test_infinigen_selects_in_every_layer_it_fetches(gemma3_model, tmp_path, monkeypatch):
    """The calibrated default on Gemma 3. The tier keeping every layer (window groups off): every layer, layer 0
    and the window layers included, reads fewer rows than the full offload does; a window layer's alpha is
    calibrated for its own query at the window mass. Split (window groups on): the tier's 3 global layers
    speculate with the model's alphas of those layers, and read fewer rows than the split full offload."""
    monkeypatch.setenv(SKEWING_DIR_ENV, str(tmp_path))
    text = require(WIKITEXT2, "WikiText-2").read_text(encoding="utf-8")[:8000]
    ids = gemma3_model.tokenizer.encode(text, add_special_tokens=False)[:PROMPT_TOKENS]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    global_layers = [i for i, w in enumerate(gemma3_model.config.layer_windows) if w is None]
    caches = {}
    for groups, policy in itertools.product((False, True), ("full", "infinigen")):
        config = EngineConfig(model="gemma3-270m", dtype="float32", max_num_batched_tokens=256,
                              kv_cache_memory="256MiB", kv_offload="host", kv_policy=policy,
                              kv_window_groups=groups)  # fmt: skip
        llm = LLM.from_engine(LLMEngine(config, gemma3_model))
        (out,) = llm.generate([ids], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 8
        caches[groups, policy] = llm.engine.runner.cache
        llm.engine.close()
    whole = caches[False, "infinigen"]
    assert whole.rehearsal.speculated_layers == set(range(gemma3_model.config.num_layers))
    assert all(a > 0 for a in whole.policy.alpha)  # every layer calibrated, layer 0 included
    split = caches[True, "infinigen"].offloaded
    assert split.rehearsal.speculated_layers == {0, 1, 2}
    assert split.policy.alpha == tuple(whole.policy.alpha[layer] for layer in global_layers)
    for groups in (False, True):
        fractions = [caches[groups, p].stats.fetch_fraction() for p in ("infinigen", "full")]
        assert all(s < f for s, f in zip(*fractions, strict=True)), (groups, fractions)
