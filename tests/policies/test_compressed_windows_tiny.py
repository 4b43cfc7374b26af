"""Compressing KV policies on a model with sliding-window layers (a tiny random Gemma 3: five window layers and one
global layer): the global layer keeps the policy's share, each window layer its window, and the blocks a window
layer no longer sees go back to the pool, in the prefill and while decoding; at budget 1 the greedy tokens are the
full cache's."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.kv.sizing import kv_block_bytes
from kvserve.models import load_model
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

WINDOW, BLOCK = 8, 4
SPEC = TinySpec(
    arch="gemma3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=6, tie_word_embeddings=True, seed=5,
    extra={"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh"},
)  # fmt: skip


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("gemma3-windows"), SPEC), dtype=torch.float32)


def _engine(loaded, **options) -> LLMEngine:
    cfg = loaded.config
    memory = 2048 * kv_block_bytes(1, cfg.num_kv_heads, cfg.head_dim, 4, BLOCK)
    config = EngineConfig(
        dtype="float32", block_size=BLOCK, kv_cache_memory=memory, swap_space=0, max_num_batched_tokens=32, **options
    )
    return LLMEngine(config, loaded)


def _prompt(n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.mark.parametrize("policy", ["pyramid", "snapkv", "h2o"])
def test_window_layers_keep_their_window_and_free_the_rest(loaded, policy):
    """A 100-token prompt in 32-token chunks, then 24 decode steps at budget 0.5: after every step a window layer
    holds at most its window and a block of slack, the global layer at most the policy's capacity and a block, each
    layer's blocks are just those slots', and every block is back once the request finishes."""
    engine = _engine(loaded, kv_policy=policy, kv_budget=0.5)
    windows = loaded.config.layer_windows
    assert sum(w is not None for w in windows) == 5 and windows.count(None) == 1
    engine.add_request(_prompt(100), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    layers, kv_policy = len(windows), engine.kv_policy
    seen_window_full = False
    while engine.has_unfinished_requests():
        engine.step()
        ((_, seq),) = engine._seqs.values() or ((None, None),)
        if seq is None or seq.finished:
            continue
        for layer, (window, held) in enumerate(zip(windows, seq.group_slots, strict=True)):
            bound = WINDOW if window is not None else kv_policy.capacity(layer, layers, seq.num_computed_tokens)
            assert held <= bound + BLOCK, (layer, held)
            assert len(engine.kv.block_table(seq.seq_id, layer)) == math.ceil(held / BLOCK)
            seen_window_full |= window is not None and held >= WINDOW
        global_layer = windows.index(None)
        assert (
            max(h for w, h in zip(windows, seq.group_slots, strict=True) if w is not None)
            < seq.group_slots[global_layer]
        )
    assert seen_window_full
    assert engine.kv_usage().used_blocks == 0


def test_budget_one_keeps_the_full_cache_tokens(loaded):
    """At budget 1 a compressing policy keeps every token of the global layer and the window of the others: the
    full cache's greedy tokens (whose window layers free blocks in their window groups)."""
    prompts = [_prompt(n) for n in (70, 23)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for options in ({"kv_policy": "full"}, {"kv_policy": "pyramid", "kv_budget": 1.0}):
        engine = _engine(loaded, **options)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        tokens[options["kv_policy"]] = [list(done[i].outputs[0].token_ids) for i in ids]
    assert tokens["pyramid"] == tokens["full"]
