"""bfloat16 on the real default model (dequantised weights): close to float32, and the same greedy answer."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.attention import ContiguousKVCache
from kvserve.entrypoints.generation import Generator
from tests.real_models import shared_load

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def bf16_model():
    return shared_load(dtype=torch.bfloat16, weights="dequant")  # native int4 has its own tests


def test_bfloat16_weights_and_cache_are_bfloat16(bf16_model):
    assert bf16_model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16_model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16


def test_bfloat16_logits_track_float32(default_model, bf16_model):
    ids = default_model.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    logits = {}
    for loaded in (default_model, bf16_model):
        cfg = loaded.config
        cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, len(ids), loaded.dtype)
        logits[loaded.dtype] = Generator(loaded).forward_last(cache, ids, 0)
    f32, bf16 = logits[torch.float32], logits[torch.bfloat16]
    assert bf16.dtype == torch.float32  # logits are always float32 for sampling
    top_f32 = set(f32.topk(5).indices.tolist())
    top_bf16 = set(bf16.topk(5).indices.tolist())
    assert len(top_f32 & top_bf16) >= 4
    probs_f32, probs_bf16 = f32.softmax(-1), bf16.softmax(-1)
    assert (probs_f32 - probs_bf16).abs().sum().item() < 0.1  # twice the total variation distance


def test_bfloat16_chat_answer(bf16_model):
    tok = bf16_model.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = Generator(bf16_model).generate(prompt, SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
