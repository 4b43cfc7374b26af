"""Gemma 3 270M (float32) with its sliding-window KV groups on, under the techniques that run over them:
InfiniGen's sparse decode on the global layers (a selection that covers every row generates the plain
engine's tokens; a calibrated one reads fewer rows there), and the compressing policies (per-layer groups,
each window layer keeping its window). Prompt Cache and parallel prefill over window groups are checked in
``test_gemma3_real.py`` and ``tests/parallel/test_runahead_windows.py``."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import WIKITEXT2, require
from kvserve.models.gguf_linear import GGUFEmbedding
from kvserve.policies.skewing import SKEWING_DIR_ENV
from tests.real_models import shared_load

pytestmark = pytest.mark.real_model

PROMPT_TOKENS = 700  # past the 512-token window
GLOBAL_LAYERS = frozenset({5, 11, 17})


@pytest.fixture(scope="module")
def prompt(gemma3_model) -> list[int]:
    text = require(WIKITEXT2, "WikiText-2").read_text(encoding="utf-8")[:8000]
    ids = gemma3_model.tokenizer.encode(text, add_special_tokens=False)[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return ids


def _generate(loaded, ids: list[int], max_tokens: int, **options):
    """Greedy tokens of a window-groups engine with ``options``, and the engine (closed)."""
    config = EngineConfig(model="gemma3-270m", dtype="float32", max_num_batched_tokens=256,
                          kv_cache_memory="256MiB", kv_window_groups=True, **options)  # fmt: skip
    llm = LLM.from_engine(LLMEngine(config, loaded))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        (out,) = llm.generate([ids], params, use_tqdm=False)
    finally:
        llm.engine.close()
    return out.outputs[0].token_ids, llm.engine


@pytest.fixture(scope="module")
def plain_tokens(gemma3_model, prompt) -> list[int]:
    tokens, engine = _generate(gemma3_model, prompt, 16)
    assert len(engine.plan.layout.groups) > 1  # window groups really on
    return tokens


def test_infinigen_sparse_decode_on_the_global_layers(gemma3_model, prompt, plain_tokens, tmp_path, monkeypatch):
    monkeypatch.setenv(SKEWING_DIR_ENV, str(tmp_path))
    covering, engine = _generate(gemma3_model, prompt, 16, kv_policy="infinigen", infinigen_alpha=1e9)
    cache = engine.runner.cache
    assert len(engine.plan.layout.groups) > 1
    assert cache.sparse_layers == GLOBAL_LAYERS  # window layers attend their window whole
    assert covering == plain_tokens
    assert all(cache.stats.read_fraction()[i] == 1.0 for i in GLOBAL_LAYERS)
    tokens, engine = _generate(gemma3_model, prompt, 8, kv_policy="infinigen", infinigen_alpha=2.0)
    fractions = engine.runner.cache.stats.read_fraction()
    assert len(tokens) == 8
    assert all(fractions[i] < 1.0 for i in GLOBAL_LAYERS), fractions
    assert all(fractions[i] == 1.0 for i in range(len(fractions)) if i not in GLOBAL_LAYERS)


@pytest.mark.parametrize("policy", ["pyramid", "snapkv"])
def test_compressing_policies_keep_each_window(gemma3_model, prompt, policy):
    tokens, engine = _generate(gemma3_model, prompt, 8, kv_policy=policy, kv_budget=0.5)
    windows = gemma3_model.config.layer_windows
    assert len(tokens) == 8
    assert engine.plan.per_layer_groups
    assert engine.plan.group_windows(windows) == tuple(windows)  # each window layer's group frees past its window


def test_infinigen_on_the_native_k_quant_weights(prompt, tmp_path, monkeypatch):
    """The weights as the GGUF file stores them (``weights="native"``: the token embedding stays in ggml blocks):
    InfiniGen's skewing reads the model's activation dtype from that embedding, then decodes sparse."""
    monkeypatch.setenv(SKEWING_DIR_ENV, str(tmp_path))
    loaded = shared_load("gemma3-270m", dtype=torch.float32, weights="native")
    assert isinstance(loaded.model.embed_tokens, GGUFEmbedding)
    tokens, engine = _generate(loaded, prompt[:300], 8, kv_policy="infinigen", infinigen_alpha=2.0)
    assert len(tokens) == 8
    assert engine.runner.cache.rehearsal.skew.dtype == torch.float32
