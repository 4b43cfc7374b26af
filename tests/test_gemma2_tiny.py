"""Gemma 2 on a tiny random checkpoint, from its Hugging Face folder and as llama.cpp's ``gemma2`` GGUF: logits at
every position and greedy tokens through the engine against transformers, with both soft caps binding (attention
logits capped at 5, final logits at 3); the caps really applied; the decode and prefill kernels' soft cap against
their torch references; and KV techniques (compression at budget 1, offload, the batch-invariant mode) over it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import AttentionMetadata, ContiguousKVCache
from kvserve.attention.decode import paged_decode, paged_decode_lse, paged_decode_reference
from kvserve.attention.flash_prefill import flash_prefill, flash_prefill_available
from kvserve.attention.softcap import capped_attention
from kvserve.models import load_model
from tests.family_checks import (
    assert_engine_greedy_matches,
    assert_logits_match,
    engine_prompts,
    random_ids,
)
from tests.gguf_convert import write_gguf_from_hf
from tests.tiny_models import (  # noqa: F401 - torch_single_thread, skewing_in_tmp: autouse fixtures
    VOCAB_SIZE,
    TinySpec,
    build_hf_model,
    hf_logits,
    load_hf_model,
    skewing_in_tmp,
    torch_single_thread,
    write_tokenizer,
)

WINDOW, ATTN_CAP, FINAL_CAP = 8, 5.0, 3.0
# query_pre_attn_scalar = head_dim, as Gemma 2 2B and 9B (what llama.cpp assumes below 27B).
SPEC = TinySpec(
    arch="gemma2", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=4, tie_word_embeddings=True,
    extra={"sliding_window": WINDOW, "attn_logit_softcapping": ATTN_CAP, "final_logit_softcapping": FINAL_CAP,
           "query_pre_attn_scalar": 16},
)  # fmt: skip
Q_GAIN = 4.0  # q_proj scaled up: about one attention logit in ten passes the cap (tanh bends the rest)


def write_gemma2(folder: Path, spec: TinySpec = SPEC) -> Path:
    model = build_hf_model(spec)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(Q_GAIN)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_gemma2(tmp_path_factory.mktemp("gemma2"))


@pytest.fixture(scope="module")
def gguf(folder, tmp_path_factory) -> Path:
    return write_gguf_from_hf(folder, tmp_path_factory.mktemp("gemma2-gguf") / "tiny-gemma2.gguf")


@pytest.fixture(scope="module")
def hf(folder):
    return load_hf_model(folder)


@pytest.fixture(scope="module", params=["hf", "gguf"])
def source(request, folder, gguf) -> Path:
    return folder if request.param == "hf" else gguf


@pytest.fixture(scope="module")
def loaded(source):
    return load_model(source, dtype=torch.float32)


def test_config_reads_windows_caps_and_scale(loaded):
    cfg = loaded.config
    assert cfg.architecture == "gemma2"
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None)  # even layers slide, as transformers and llama.cpp
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    assert cfg.query_pre_attn_scalar == 16 and cfg.tie_word_embeddings


def test_all_position_logits_match_transformers(loaded, hf):
    """Every position of a 40-token prompt (five windows long) within 1e-4 of transformers."""
    assert_logits_match(loaded, hf, random_ids(40, VOCAB_SIZE, seed=1))


def test_each_soft_cap_is_applied(folder, hf):
    """Without the attention cap, or without the final one, the logits are far from transformers': the caps bind."""
    loaded = load_model(folder, dtype=torch.float32)
    ids = random_ids(40, VOCAB_SIZE, seed=1)
    ref = hf_logits(hf, ids)
    cfg, model = loaded.config, loaded.model

    def logits(softcap: float) -> torch.Tensor:
        cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, len(ids), torch.float32)
        meta = AttentionMetadata((0,), (len(ids),), (0,), layer_windows=cfg.layer_windows, softcap=softcap)
        with torch.inference_mode():
            return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, meta))

    assert (logits(ATTN_CAP) - ref).abs().max() <= 1e-4
    assert (logits(0.0) - ref).abs().max() > 0.1  # the attention cap
    model.final_softcap = 0.0
    assert (logits(ATTN_CAP) - ref).abs().max() > 1.0  # the final cap
    model.final_softcap = FINAL_CAP


def test_query_pre_attn_scalar_other_than_head_dim(tmp_path):
    """A Hugging Face config whose query_pre_attn_scalar differs from head_dim (Gemma 2 27B's 144 against 128)."""
    spec = TinySpec(**{**SPEC.__dict__, "extra": {**SPEC.extra, "query_pre_attn_scalar": 24}})
    folder = write_gemma2(tmp_path, spec)
    loaded = load_model(folder, dtype=torch.float32)
    assert loaded.config.query_pre_attn_scalar == 24
    assert_logits_match(loaded, load_hf_model(folder), random_ids(24, VOCAB_SIZE, seed=2))


@pytest.mark.parametrize(
    "options",
    [{"kv_window_groups": False}, {"kv_window_groups": True, "preempt": False}],
    ids=["no-window-groups-preempt", "window-groups"],
)
def test_engine_greedy_matches_transformers(source, hf, options):
    """Chunked prefill, prefix hits, preemption (by swapping) and 32 greedy tokens per prompt."""
    llm = assert_engine_greedy_matches(source, hf, **options)
    llm.engine.close()


def _greedy(source: Path, **options: object) -> list[list[int]]:
    llm = LLM(
        str(source), dtype="float32", block_size=4, max_num_batched_tokens=16, kv_cache_memory="1MiB", swap_space=0,
        **options,
    )  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate(engine_prompts(VOCAB_SIZE), params, use_tqdm=False)
    llm.engine.close()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    "options",
    [
        {"kv_policy": "h2o", "kv_budget": 1.0},
        {"kv_policy": "snapkv", "kv_budget": 1.0},
        {"kv_offload": "host", "kv_policy": "full"},
    ],
    ids=["h2o", "snapkv", "offload-full"],
)
def test_kv_techniques_run_gemma2(folder, full_tokens, options):
    """A compressing policy at budget 1 (per-layer KV groups, scores from the capped attention) and the offloaded
    cache give the full cache's greedy tokens."""
    assert _greedy(folder, **options) == full_tokens


@pytest.fixture(scope="module")
def full_tokens(folder) -> list[list[int]]:
    return _greedy(folder)


def test_batch_invariant_mode_applies_the_cap(folder, hf):
    """The batch-invariant mode attends row by row (``row_invariant.py``): the same greedy tokens as transformers."""
    llm = LLM(
        str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16, batch_invariant=True,
        kv_cache_memory="1MiB", swap_space=0,
    )  # fmt: skip
    prompts = engine_prompts(VOCAB_SIZE)[:2]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    llm.engine.close()
    for out, prompt in zip(outs, prompts, strict=True):
        ids = list(prompt)
        for _ in range(8):
            ids.append(int(hf_logits(hf, ids)[-1].argmax()))
        assert list(out.outputs[0].token_ids) == ids[len(prompt) :]


def _first_logprobs(llm: LLM, prompt: object) -> dict[int, float]:
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False)
    return out.outputs[0].logprobs[0]


@pytest.mark.parametrize(
    ("modules", "recompute"),
    [(("one",), 0.0), (("one", "two"), 1.0)],
    ids=["positioned", "recompute-all"],
)
def test_prompt_cache_prompt_is_the_plain_prompt(folder, modules, recompute):
    """A Prompt Cache prompt whose slots are not its positions (window layers attend by position,
    ``paged_plan.attend_positioned``), and two modules with every imported token recomputed (``blend.py``), give the
    plain prompt's next-token distribution: both carry the cap."""
    llm = LLM(
        str(folder), dtype="float32", block_size=4, kv_window_groups=False, prompt_cache_recompute=recompute,
        kv_cache_memory="1MiB", swap_space=0,
    )  # fmt: skip
    text = {"one": " ".join(f"w{i}" for i in range(30)), "two": " ".join(f"v{i}" for i in range(20))}
    body = "".join(f'<module name="{m}"> {text[m]}</module>' for m in modules)
    llm.engine.register_schema(f'<schema name="s">a b c d{body}</schema>')
    prompt = '<prompt schema="s">' + "".join(f"<{m}/>" for m in modules) + " and so</prompt>"
    prepared = llm.engine.prompt_cache.prepare(prompt)
    llm.engine.prompt_cache.release(prepared.modules)
    order = sorted(range(len(prepared.positions)), key=lambda i: prepared.positions[i])
    assert [prepared.positions[i] for i in order] == list(range(len(order)))
    assert order != list(range(len(order)))  # slots are not positions
    plain = _first_logprobs(llm, [prepared.token_ids[i] for i in order])
    cached = _first_logprobs(llm, prompt)
    llm.engine.close()
    assert cached.keys() == plain.keys()
    for token, logprob in cached.items():
        assert logprob == pytest.approx(plain[token], abs=1e-4)


# ----- the kernels' soft cap against their torch references -----

DECODE_TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 16), (4, 1, 256)], ids=str)
def test_decode_kernel_soft_cap_matches_the_reference(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    block_size, ranges = 16, [(0, 1), (0, 17), (3, 35), (0, 257), (100, 613)]
    width = max(-(-end // block_size) for _, end in ranges) + 1
    num_blocks = len(ranges) * width + 3
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(ranges) * width].view(len(ranges), width).int()
    # Logits of several units, so the cap bends them: q scaled by sqrt(head_dim) against unit keys.
    q = (3 * torch.randn(len(ranges), heads, head_dim, generator=gen)).to(dtype)
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.int32)
    ends = torch.tensor([e for _, e in ranges], dtype=torch.int32)
    cap = 2.0
    got, got_weights = paged_decode(q, k, v, tables, starts, ends, want_weights=True, softcap=cap)
    want, want_weights = paged_decode_reference(q, k, v, tables, starts, ends, want_weights=True, softcap=cap)
    sdpa_path, _ = paged_decode_reference(q, k, v, tables, starts, ends, softcap=cap)
    uncapped, _ = paged_decode(q, k, v, tables, starts, ends)
    assert (got.float() - want.float()).abs().max() <= DECODE_TOLERANCE[dtype]
    assert (got.float() - sdpa_path.float()).abs().max() <= DECODE_TOLERANCE[dtype]
    assert torch.allclose(got_weights, want_weights, atol=1e-6)
    assert (got.float() - uncapped.float()).abs().max() > 10 * DECODE_TOLERANCE[dtype]
    out, lse = paged_decode_lse(q, k, v, tables, starts, ends, softcap=cap)
    assert torch.equal(out, got) and bool((lse.isfinite()).all())


@pytest.mark.skipif(not flash_prefill_available(), reason="the kernel is built only with AVX512-BF16 and without AMX")
@pytest.mark.parametrize(
    ("tokens", "ctx_len", "window"), [(11, 0, None), (130, 45, None), (333, 0, 50), (97, 31, 70)], ids=str
)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 64), (4, 1, 256)], ids=str)
def test_prefill_kernel_soft_cap_matches_float32_attention(tokens, ctx_len, window, heads, kv_heads, dim):
    """bfloat16 (the kernel's one dtype) against float32 capped attention over the same inputs."""
    gen = torch.Generator().manual_seed(0)
    q = (3 * torch.randn(tokens, heads, dim, generator=gen)).bfloat16()
    k = torch.randn(ctx_len + tokens, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(ctx_len + tokens, kv_heads, dim, generator=gen).bfloat16()
    cap = 2.0
    key = torch.arange(ctx_len + tokens)[None, :]
    at = (torch.arange(tokens) + ctx_len)[:, None]
    mask = (key <= at) & ((key > at - window) if window else True)
    qh, kh, vh = (x.float().transpose(0, 1)[None] for x in (q, k, v))
    want = capped_attention(qh, kh, vh, cap, attn_mask=mask)[0].transpose(0, 1)
    got = flash_prefill(q, k, v, ctx_len, window, softcap=cap)
    assert (got.float() - want).abs().max() <= 1.6e-2
    uncapped = flash_prefill(q, k, v, ctx_len, window)
    assert (got.float() - uncapped.float()).abs().max() > 0.1
    # Keys by position runs (Prompt Cache's recompute): the same rows through key_starts / key_ends.
    ends = (at[:, 0] + 1).contiguous()
    starts = (ends - window).clamp(min=0) if window else torch.zeros_like(ends)
    runs = flash_prefill(q, k, v, 0, key_ends=ends, key_starts=starts.contiguous(), softcap=cap)
    assert (runs.float() - want).abs().max() <= 1.6e-2


def test_capped_attention_is_sdpa_over_capped_logits():
    """The torch path's explicit logits: chunked rows, GQA, boolean and additive masks, a row that sees nothing."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 9, 8, generator=gen), torch.randn(1, 2, 9, 8, generator=gen), torch.randn(1, 2, 9, 8)
    logits = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(8)
    capped = 1.5 * torch.tanh(logits / 1.5)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    want = capped.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
    assert torch.allclose(capped_attention(q, k, v, 1.5, is_causal=True), want, atol=1e-6)
    assert torch.allclose(capped_attention(q, k, v, 1.5, attn_mask=mask), want, atol=1e-6)
    bias = torch.zeros(9, 9).masked_fill(~mask, float("-inf"))
    assert torch.allclose(capped_attention(q, k, v, 1.5, attn_mask=bias), want, atol=1e-6)
    import kvserve.attention.softcap as softcap_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(softcap_module, "CHUNK_LOGITS", 4 * 9 * 2)  # two rows a chunk
        assert torch.allclose(capped_attention(q, k, v, 1.5, attn_mask=mask), want, atol=1e-6)
        assert torch.allclose(capped_attention(q, k, v, 1.5, is_causal=True), want, atol=1e-6)
    per_head = mask.expand(1, 4, 9, 9).clone()
    per_head[:, 1, 5, 2] = False  # one query head's mask differs: the GQA view must keep heads apart
    want_head = capped.masked_fill(~per_head, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
    assert torch.allclose(capped_attention(q, k, v, 1.5, attn_mask=per_head), want_head, atol=1e-6)
    empty = mask.clone()
    empty[3] = False
    assert not capped_attention(q, k, v, 1.5, attn_mask=empty)[:, :, 3].any()
    poisoned = k.clone()
    poisoned[0, 0, 0, 0] = float("nan")  # a NaN stays visible, as in SDPA, in a masked call too
    assert capped_attention(q, poisoned, v, 1.5, attn_mask=mask)[:, :2].isnan().all()


def test_parallel_prefill_is_refused_naming_the_soft_cap(loaded):
    from kvserve.config import EngineConfig
    from kvserve.core.kv_plan import plan_kv

    with pytest.raises(ValueError, match=r"soft-caps.*attn_logit_softcapping=5\).*prefill_parallel=1"):
        plan_kv(EngineConfig(prefill_parallel=2), loaded.config, torch.float32)


def test_generator_applies_the_cap(folder, hf):
    """The one-request generator (a contiguous cache, its metadata from the model's config) decodes greedily as
    transformers does."""
    from kvserve.entrypoints.generation import Generator
    from tests.family_checks import hf_greedy

    prompt = engine_prompts(VOCAB_SIZE)[1]
    out = Generator(load_model(folder, dtype=torch.float32)).generate(
        prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    assert list(out.token_ids) == hf_greedy(hf, prompt, 12)


@pytest.mark.parametrize("field", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_a_negative_cap_is_refused_naming_it(loaded, field):
    """A negative cap (which the kernels would reject mid-request) is refused when the config is read."""
    import dataclasses

    from kvserve.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=f"{field}=-5.0 must be positive"):
        dataclasses.replace(loaded.config, **{field: -5.0})
