"""Checks every model family passes on its tiny random checkpoint, from its Hugging Face folder and its GGUF file:
float32 logits at every position against transformers, and greedy tokens through the paged engine (chunked
prefill, prefix hits, preemption) against transformers' own greedy continuation.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import AttentionMetadata, ContiguousKVCache
from kvserve.models.loader import LoadedModel
from tests.tiny_models import assert_greedy_equal_up_to_ties, hf_logits

ATOL = 1e-4
GREEDY_TOKENS = 32


def random_ids(n: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def all_position_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """kvserve's float32 logits (N, vocab) of one sequence in one step through a contiguous cache."""
    cfg = loaded.config
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, len(ids), torch.float32)
    meta = AttentionMetadata((0,), (len(ids),), (0,), layer_windows=cfg.layer_windows, softcap=cfg.attention_softcap)
    return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache, meta))


def assert_logits_match(loaded: LoadedModel, hf: object, ids: list[int], atol: float = ATOL) -> None:
    ours, ref = all_position_logits(loaded, ids), hf_logits(hf, ids)
    assert ref.std() > 1.0, "reference logits are degenerate; the comparison would be vacuous"
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"max |logit diff| {diff:.2e} over {len(ids)} positions"


@torch.no_grad()
def hf_greedy(hf: object, prompt: list[int], max_tokens: int = GREEDY_TOKENS) -> list[int]:
    """transformers' greedy continuation, each token from a full recompute (no cache to get wrong)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt) :]


def engine_prompts(vocab_size: int, prefix_len: int = 24) -> list[list[int]]:
    """Four prompts sharing a ``prefix_len``-token prefix (prefix-cache hits), of different lengths."""
    prefix = random_ids(prefix_len, vocab_size, seed=7)
    return [prefix + random_ids(n, vocab_size, seed=10 + n) for n in (3, 9, 17, 1)]


def assert_engine_greedy_matches(
    source: str | Path, hf: object, kv_tokens: int = 96, preempt: bool = True, **options: object
) -> LLM:
    """Greedy tokens of four prompts with a shared prefix through the paged engine equal transformers' (up to
    float32 ties). The first prompt runs alone, so the others hit its prefix; then the other three run together
    in a KV memory of about ``kv_tokens`` tokens of every layer, chunked 16 tokens a step, so they preempt.
    (Window KV groups make a sliding-window model's sequences small enough not to: pass ``kv_window_groups=False``
    to check preemption there.)"""
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # float32 K and V
    llm = LLM(
        str(source), dtype="float32", block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True,
        kv_cache_memory=kv_tokens * per_token, swap_space=8 * kv_tokens * per_token, **options,
    )  # fmt: skip
    prompts = engine_prompts(cfg.vocab_size)
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert llm.engine.kv_usage().prefix_hit_tokens >= 20, "the later prompts should hit the first one's prefix"
    if preempt:
        assert llm.engine.scheduler.num_preemptions > 0, "the KV memory should be small enough to preempt"
    for out, prompt in zip(first + rest, prompts, strict=True):
        assert len(out.outputs[0].token_ids) == GREEDY_TOKENS, out.outputs[0].finish_reason
        assert_greedy_equal_up_to_ties(out.outputs[0], hf_greedy(hf, prompt))
    return llm
