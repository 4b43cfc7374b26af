"""Exact parity with Hugging Face transformers on the real default model (SmolLM2-135M-Instruct, float32)."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.attention import ContiguousKVCache
from kvserve.entrypoints.generation import Generator

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "A KV cache stores the keys and values of past tokens so that",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
]

MIXED_TEXT = (
    "Héllo wörld! 日本語のテキスト, русский текст, العربية, emoji 🙂🚀👩‍💻 and flags 🇫🇷.\n"
    'code: def f(x):\n\treturn x**2 + 12345  # ok\n    if (a && b) { return "\\u00e9"; }\n'
    "<|im_start|>user\nHi there<|im_end|>\n"
)


def _new_cache(model, length: int) -> ContiguousKVCache:
    cfg = model.config
    return ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, length, model.dtype)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_position_logits_match_transformers(default_model, hf_default_model, prompt):
    ids = default_model.tokenizer.encode(prompt)
    with torch.no_grad():
        expected = hf_default_model(torch.tensor([ids])).logits[0, -1].float()
    ours = Generator(default_model).forward_last(_new_cache(default_model, len(ids)), ids, 0)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= 1e-3


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_64_tokens_match_transformers(default_model, hf_default_model, prompt):
    ids = default_model.tokenizer.encode(prompt)
    ours = Generator(default_model).generate(ids, SamplingParams(max_tokens=64, temperature=0))
    with torch.no_grad():
        theirs = hf_default_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64)
    theirs_ids = theirs[0, len(ids) :].tolist()
    assert ours.token_ids == theirs_ids
    assert len(ours.token_ids) >= 8  # a real continuation, not an immediate EOS on every prompt


def test_greedy_runs_full_64_tokens_without_eos(default_model, hf_default_model):
    ids = default_model.tokenizer.encode(PROMPTS[2])
    ours = Generator(default_model).generate(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    with torch.no_grad():
        theirs = hf_default_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, min_new_tokens=64)
    assert len(ours.token_ids) == 64
    assert ours.token_ids == theirs[0, len(ids) :].tolist()


def test_tokenizer_matches_transformers_on_mixed_text(default_model, hf_default_tokenizer):
    ours = default_model.tokenizer.encode(MIXED_TEXT)
    theirs = hf_default_tokenizer(MIXED_TEXT)["input_ids"]
    assert ours == theirs
    assert default_model.tokenizer.decode(ours, skip_special_tokens=False) == MIXED_TEXT
    # Special tokens stay whole.
    assert default_model.tokenizer.encode("<|im_start|>") == [
        hf_default_tokenizer.convert_tokens_to_ids("<|im_start|>")
    ]


def test_chat_template_matches_transformers(default_model, hf_default_tokenizer):
    messages = [{"role": "user", "content": "Name three colours."}]
    ours = default_model.tokenizer.apply_chat_template(messages)
    theirs = hf_default_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
