"""The bfloat16 prefill kernel (``csrc/flash_prefill.cpp``) against float32 attention over the same bfloat16
inputs: odd lengths, key-block and tile boundaries, cached context, sliding windows, GQA ratios and head sizes;
``attend_prefill`` taking it for bfloat16 and keeping SDPA otherwise; and on the real default model, a
2,000-token bfloat16 prefill through the engine against the same prefill with torch's kernel. Its voting form
(``flash_prefill_votes``: a compressing cache's chunk) against ``scoring.head_column_sums`` and the policies'
choices from it."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import blend, compressed_prefill
from kvserve.attention import flash_prefill as flash_module
from kvserve.attention import paged as paged_module
from kvserve.attention.flash_prefill import flash_prefill, flash_prefill_available, flash_prefill_votes
from kvserve.attention.paged import PagedKVCache, attend_prefill
from kvserve.policies.pyramid import PyramidInfer
from kvserve.policies.scoring import head_column_sums
from kvserve.policies.snapkv import SnapKV

needs_kernel = pytest.mark.skipif(
    not flash_prefill_available(), reason="the kernel is built only on CPUs with AVX512-BF16 and without AMX"
)

# bfloat16 inputs, float32 reference: the kernel rounds the probabilities to bfloat16 before the product with
# V (as torch's kernel does) and its output to bfloat16; SDPA in bfloat16 is as far from the reference.
TOLERANCE = 1.6e-2


def reference(q, k, v, ctx_len, window, key_ends=None, key_starts=None):
    """Attention in float32 with an explicit mask: query t over keys before ``key_ends[t]`` (causal by default:
    ctx_len + t + 1), the last ``window`` of them when given, from ``key_starts[t]`` on when given."""
    tokens, heads, dim = q.shape
    group = heads // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf, vf = (x.float().repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))
    logits = qf @ kf.transpose(1, 2) / math.sqrt(dim)
    ends = (torch.arange(tokens) + ctx_len + 1 if key_ends is None else key_ends)[:, None]
    key = torch.arange(k.shape[0])[None, :]
    visible = key < ends
    if window:
        visible &= key >= ends - window
    if key_starts is not None:
        visible &= key >= key_starts[:, None]
    return (logits.masked_fill(~visible, float("-inf")).softmax(-1) @ vf).transpose(0, 1)


def _inputs(tokens, ctx_len, heads, kv_heads, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen).bfloat16()
    k = torch.randn(ctx_len + tokens, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(ctx_len + tokens, kv_heads, dim, generator=gen).bfloat16()
    return q, k, v


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (8, 8, 128), (4, 1, 256), (2, 2, 64), (16, 2, 64)],
    ids=["smollm2-g3", "mha-d128", "gemma3-d256", "mha-2", "g8"],
)
@pytest.mark.parametrize(
    ("tokens", "ctx_len", "window"),
    # One query; a tile boundary (32 rows); either side of a 64-key block; cached context mid-block; windows
    # shorter than a block and longer than one, with and without cached context.
    [
        (1, 0, None),
        (2, 0, None),
        (11, 0, None),
        (63, 0, None),
        (64, 1, None),
        (65, 0, None),
        (130, 45, None),
        (200, 128, None),
        (333, 0, 50),
        (100, 300, 128),
        (97, 31, 70),
    ],
)
def test_kernel_matches_float32_attention(heads, kv_heads, dim, tokens, ctx_len, window):
    q, k, v = _inputs(tokens, ctx_len, heads, kv_heads, dim)
    got = flash_prefill(q, k, v, ctx_len, window)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert (got.float() - reference(q, k, v, ctx_len, window)).abs().max().item() <= TOLERANCE


@needs_kernel
@pytest.mark.parametrize("window", [None, 40])
def test_kernel_with_key_ends_matches_a_prefix_mask(window):
    """Each query over the first key_ends[t] keys (Prompt Cache's recompute): any order, repeats, one key."""
    q, k, v = _inputs(90, 210, 9, 3, 64)
    k, v = k[:150], v[:150]
    ends = torch.randint(1, 151, (90,), generator=torch.Generator().manual_seed(3))
    ends[:3] = torch.tensor([1, 150, 150])
    got = flash_prefill(q, k, v, 0, window, key_ends=ends)
    assert (got.float() - reference(q, k, v, 0, window, key_ends=ends)).abs().max().item() <= TOLERANCE
    with pytest.raises(RuntimeError, match=r"key_ends must lie in \[0, 150\]"):
        flash_prefill(q, k, v, 0, key_ends=ends + 1)


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 1, 256)], ids=["smollm2-g3", "gemma3-d256"])
def test_kernel_with_key_starts_and_ends_matches_a_run_mask(heads, kv_heads, dim):
    """Each query over keys [key_starts[t], key_ends[t]) (Prompt Cache's recompute in a sliding-window layer): any
    order, runs of one key, runs that start mid-block and span several blocks."""
    q, k, v = _inputs(90, 210, heads, kv_heads, dim)
    k, v = k[:150], v[:150]
    gen = torch.Generator().manual_seed(4)
    ends = torch.randint(1, 151, (90,), generator=gen)
    starts = (ends - torch.randint(1, 60, (90,), generator=gen)).clamp(min=0)
    ends[:3], starts[:3] = torch.tensor([1, 150, 37]), torch.tensor([0, 149, 3])
    got = flash_prefill(q, k, v, 0, key_ends=ends, key_starts=starts)
    want = reference(q, k, v, 0, None, key_ends=ends, key_starts=starts)
    assert (got.float() - want).abs().max().item() <= TOLERANCE
    with pytest.raises(RuntimeError, match="each query must see a key"):
        flash_prefill(q, k, v, 0, key_ends=ends, key_starts=ends)
    with pytest.raises(RuntimeError, match="key_starts need key_ends"):
        flash_prefill(q, k, v, 60, key_starts=starts)


@needs_kernel
def test_kernel_reads_strided_inputs():
    """q, k, v as the model hands them over: views into a fused (T, ...) projection, rows not contiguous."""
    q, k, v = _inputs(70, 0, 9, 3, 64)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qv, kv, vv = fused[:, :576].view(70, 9, 64), fused[:, 576:768].view(70, 3, 64), fused[:, 768:].view(70, 3, 64)
    assert not qv.is_contiguous()
    assert torch.equal(flash_prefill(qv, kv, vv, 0), flash_prefill(q, k, v, 0))


@needs_kernel
def test_kernel_refuses_what_it_cannot_take():
    q, k, v = _inputs(4, 0, 4, 2, 32)
    with pytest.raises(RuntimeError, match="head dim 32 is not a multiple of 64"):
        torch.ops.kvserve.flash_prefill(q, k, v, 0, 0, 0.125)
    q, k, v = _inputs(4, 2, 4, 2, 64)
    with pytest.raises(RuntimeError, match="6 keys for 0 cached \\+ 4 new tokens"):
        torch.ops.kvserve.flash_prefill(q, k, v, 0, 0, 0.125)


@needs_kernel
@pytest.mark.parametrize(
    ("tokens", "ctx_len", "heads", "kv_heads", "dim", "first", "softcap"),
    [
        (100, 0, 9, 3, 64, 60, 0.0),  # a first chunk: the last 40 vote
        (257, 130, 9, 3, 64, 0, 0.0),  # cached candidates, every row votes, tile and key-block edges
        (300, 77, 4, 1, 256, 299, 0.0),  # one voting row, Gemma 3's head size
        (200, 50, 8, 8, 128, 10, 30.0),  # soft-capped logits, no grouping
        (65, 0, 2, 2, 64, 65, 0.0),  # no voting row: zero sums
    ],
)
def test_votes_kernel_matches_head_column_sums(tokens, ctx_len, heads, kv_heads, dim, first, softcap):
    """The kernel's output is ``flash_prefill``'s to the bit, and its sums are the float32 reference's (bfloat16
    products are exact in float32: only the order of additions differs)."""
    q, k, v = _inputs(tokens, ctx_len, heads, kv_heads, dim)
    weights = torch.linspace(1.0, 1.2, tokens - first)
    out, sums = flash_prefill_votes(q, k, v, ctx_len, first, weights, softcap)
    assert torch.equal(out, torch.ops.kvserve.flash_prefill(q, k, v, ctx_len, 0, dim**-0.5, None, None, softcap))
    want = head_column_sums(q, k, ctx_len, first, weights, softcap)
    assert sums.shape == want.shape == (ctx_len + tokens, kv_heads)
    assert (sums - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1e-30)


@needs_kernel
@pytest.mark.parametrize("policy", [PyramidInfer(budget=0.5), SnapKV(budget=0.5)], ids=["pyramid", "snapkv"])
def test_votes_kernel_keeps_what_the_float32_scores_keep(policy, monkeypatch):
    """A bfloat16 chunk of 600 rows over 500 cached candidates: the tokens each policy keeps from the kernel's sums
    are the ones it keeps from the float32 voting pass (``attend_voting`` with the kernel off)."""
    q, k, v = _inputs(600, 500, 9, 3, 64, seed=3)
    num_tokens, keep = 1100, 550
    votes = policy.votes(600, num_tokens)
    got = compressed_prefill.attend_voting(q, k, v, 500, *votes)
    monkeypatch.setattr(compressed_prefill, "use_flash_prefill", lambda q, k: False)
    want = compressed_prefill.attend_voting(q, k, v, 500, *votes)
    assert (got[0].float() - want[0].float()).abs().max().item() <= 2 * TOLERANCE
    kept = [policy.select(policy.scores_from(sums, 500, None), 1100, keep, num_tokens) for sums in (got[1], want[1])]
    assert torch.equal(kept[0], kept[1])


def test_attend_prefill_takes_the_kernel_for_bfloat16_only(monkeypatch):
    """Where the kernel is built it serves bfloat16 and nothing else; where it is not, SDPA serves everything."""
    calls = []
    kernel = flash_module.flash_prefill
    monkeypatch.setattr(paged_module, "flash_prefill", lambda *a, **kw: calls.append(a[0].dtype) or kernel(*a, **kw))
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (x.to(dtype) for x in _inputs(40, 24, 9, 3, 64))
        out = attend_prefill(q, k, v, 24)
        assert (out.float() - reference(q, k, v, 24, None)).abs().max().item() <= TOLERANCE
    assert calls == ([torch.bfloat16] if flash_prefill_available() else [])


@needs_kernel
def test_blend_attention_takes_the_kernel_by_position(monkeypatch):
    """Selective recompute's attention in bfloat16: keys out of position order (modules out of schema order)
    and gaps; the kernel's answer against the masked SDPA the other dtypes take."""
    cache = PagedKVCache(1, 12, 16, 3, 64, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    positions = torch.cat([torch.arange(60, 130), torch.arange(0, 50), torch.arange(140, 170)])  # C = 150
    slots = torch.randperm(190, generator=gen)[:150]
    chosen = torch.tensor([0, 5, 69, 70, 99, 120, 149])
    metadata = blend._metadata(0, positions, slots, chosen, write=False)
    q = torch.randn(len(chosen), 9, 64, generator=gen).bfloat16()
    k = v = torch.zeros(len(chosen), 3, 64, dtype=torch.bfloat16)  # not written: write=False
    attention = blend.BlendAttention(cache)
    got = attention.forward(0, q, k, v, metadata)
    monkeypatch.setattr(blend, "use_flash_prefill", lambda q, k: False)
    want = attention.forward(0, q, k, v, metadata)
    assert (got.float() - want.float()).abs().max().item() <= 2 * TOLERANCE


@pytest.mark.real_model
@needs_kernel
def test_real_model_bfloat16_prefill_matches_torch_kernel(monkeypatch, shared_real_loads):
    """A 2,000-token prompt through the paged engine in bfloat16: the kernel's prompt log-probabilities against
    the same run with torch's flash attention, and the same greedy continuation."""
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", swap_space=0)
    ids = llm.engine.tokenizer.encode(" ".join(f"item {i} costs {i * 7 % 97} coins;" for i in range(400)))[:2000]
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1)

    def run():
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        logprobs = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
        return torch.tensor(logprobs), out.outputs[0].token_ids

    kernel_lp, kernel_tokens = run()
    monkeypatch.setattr(paged_module, "use_flash_prefill", lambda q, k: False)
    torch_lp, torch_tokens = run()
    assert len(kernel_lp) == len(ids) - 1
    # bfloat16 rounding differs between the two kernels; the model's predictions must not.
    assert (kernel_lp - torch_lp).abs().mean().item() < 0.03
    assert abs(kernel_lp.mean().item() - torch_lp.mean().item()) < 0.005
    assert kernel_tokens == torch_tokens


@pytest.mark.real_model
@needs_kernel
def test_real_model_pyramid_prefill_on_the_votes_kernel_matches_the_float32_votes(monkeypatch, shared_real_loads):
    """A 2,000-token prompt under PyramidInfer at 50% in bfloat16 (two chunks, each compacting): the votes kernel's
    prompt log-probabilities and greedy tokens against the float32 voting rows'."""
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", swap_space=0, kv_policy="pyramid", kv_budget=0.5)
    ids = llm.engine.tokenizer.encode(" ".join(f"item {i} costs {i * 7 % 97} coins;" for i in range(400)))[:2000]
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1)

    def run():
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        logprobs = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
        return torch.tensor(logprobs), out.outputs[0].token_ids

    kernel_lp, kernel_tokens = run()
    monkeypatch.setattr(compressed_prefill, "use_flash_prefill", lambda q, k: False)
    torch_lp, torch_tokens = run()
    assert (kernel_lp - torch_lp).abs().mean().item() < 0.03
    assert abs(kernel_lp.mean().item() - torch_lp.mean().item()) < 0.005
    assert kernel_tokens == torch_tokens


@needs_kernel
def test_recompute_window_attention_on_the_kernel_equals_the_masked_chunks(monkeypatch):
    """Selective recompute in a sliding-window layer (``blend._attend_window``): the kernel over runs of the keys in
    position order gives what the masked torch chunks give, for imported tokens whose slots are not in position
    order and whose positions have gaps."""
    from kvserve.attention import blend

    gen = torch.Generator().manual_seed(5)
    num_keys, window = 300, 40
    positions = torch.randperm(700, generator=gen)[:num_keys]  # gaps, any slot order
    slots = torch.randperm(num_keys, generator=gen)
    chosen = torch.randperm(num_keys, generator=gen)[:150]
    md = blend._metadata(0, positions, slots, chosen, write=False, windows=(window,))
    q = torch.randn(150, 9, 64, generator=gen).bfloat16()
    k_cache = torch.randn(num_keys, 3, 64, generator=gen).bfloat16()
    v_cache = torch.randn(num_keys, 3, 64, generator=gen).bfloat16()
    got = blend._attend_window(q, k_cache, v_cache, md, window)
    monkeypatch.setattr(blend, "use_flash_prefill", lambda q, k: False)
    want = blend._attend_window(q, k_cache, v_cache, md, window)
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE
