"""``kv_cache_dtype``: a float32 model over a bfloat16 or float16 paged cache. The same memory holds twice the
blocks; chunked prefill, prefix hits and swapping generate what one roomy run does; the first token's logprob
stays within rounding of the float32 cache, with the full cache and with a compressing policy's per-layer groups;
configurations it does not cover are refused by name; on the real model the prompt's log-likelihood and the greedy
continuation match the float32 cache, and a compressing policy's decode chain matches its eager layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import RequestOutput
from kvserve.entrypoints.llm import LLM
from kvserve.eval.data import AUSTEN
from kvserve.models.decode_chain import DecodeChain
from kvserve.sampling.sampling_params import SamplingParams
from tests.test_decode_chain import assert_the_chain_changes_nothing
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=3, head_dim=32, max_position_embeddings=512, seed=41)
BLOCK = 4
SHARED = list(range(40, 72))  # 32 tokens two prompts share: eight whole blocks
PROMPTS = [list(range(100, 157)), list(range(3, 12)), SHARED + [200, 201, 202], SHARED + [210, 211]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("kv-dtype"), SPEC)


def block_bytes(element_size: int) -> int:
    return SPEC.num_layers * 2 * SPEC.num_kv_heads * SPEC.head_dim * element_size * BLOCK


def make_engine(folder: Path, kv_cache_dtype: str, **options) -> LLMEngine:
    options = {"kv_cache_memory": "1MiB", "swap_space": 0, **options}
    config = EngineConfig(
        model=str(folder), dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=BLOCK, **options
    )
    return LLMEngine(config)


def run(engine: LLMEngine, params: SamplingParams) -> list[RequestOutput]:
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return [done[i] for i in ids]


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_the_same_memory_holds_twice_the_blocks(folder, kv_cache_dtype) -> None:
    memory = 300 * block_bytes(4)
    narrow, wide = (make_engine(folder, kind, kv_cache_memory=memory) for kind in (kv_cache_dtype, "auto"))
    assert narrow.runner.cache.k.dtype == getattr(torch, kv_cache_dtype)
    assert wide.runner.cache.k.dtype == torch.float32
    assert (narrow.kv.pool.num_blocks, wide.kv.pool.num_blocks) == (600, 300)
    assert f"torch.{kv_cache_dtype}" in narrow.kv_summary


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_chunks_prefix_hits_and_swapping_generate_what_a_roomy_run_does(folder, kv_cache_dtype) -> None:
    roomy = run(make_engine(folder, kv_cache_dtype, enable_prefix_caching=False), greedy())
    # 20 blocks of 4 tokens: the 57-token prompt and its outputs do not fit beside the others.
    tight = make_engine(
        folder, kv_cache_dtype, kv_cache_memory=20 * block_bytes(2), swap_space=64 * block_bytes(2),
        preemption_mode="swap", max_num_batched_tokens=16,
    )  # fmt: skip
    squeezed = run(tight, greedy())
    assert tight.scheduler.num_preemptions > 0 and squeezed[-1].num_cached_tokens > 0
    assert tight.runner.cache.host_cache.k.dtype == getattr(torch, kv_cache_dtype)
    # Chunks attend in other float32 orders, and a last-bit change can round a cached key to its neighbour: the
    # same tokens, logprobs within a few of those roundings.
    for a, b in zip(roomy, squeezed, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-2)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_the_first_token_is_within_rounding_of_the_float32_cache(folder, kv_cache_dtype) -> None:
    narrow = run(make_engine(folder, kv_cache_dtype), greedy(1))
    wide = run(make_engine(folder, "auto"), greedy(1))
    for a, b in zip(wide, narrow, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=2e-2)
        if kv_cache_dtype == "bfloat16":  # 8 bits of mantissa move the logprob at all (float16's 11 may not)
            assert b.outputs[0].cumulative_logprob != a.outputs[0].cumulative_logprob


@pytest.mark.parametrize("policy", ["h2o", "pyramid", "local"])
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_compressing_policy_keeps_its_groups_in_the_narrower_cache(folder, policy, kv_cache_dtype) -> None:
    """Per-layer groups (compressed.py) in half the bytes: twice the blocks in the same memory; prompts longer than
    half their length are compressed in prefill (in 16-token chunks, so the cached part is read back) and again at
    every decode step, and the first token is the float32 cache's within rounding."""
    options = {"kv_policy": policy, "kv_budget": 0.5, "max_num_batched_tokens": 16, "enable_prefix_caching": False}
    memory = 300 * block_bytes(4)
    narrow = make_engine(folder, kv_cache_dtype, kv_cache_memory=memory, **options)
    wide = make_engine(folder, "auto", kv_cache_memory=memory, **options)
    assert narrow.runner.cache.k.dtype == getattr(torch, kv_cache_dtype)
    assert narrow.kv.pool.num_blocks == 2 * wide.kv.pool.num_blocks
    first = run(narrow, greedy(1)), run(wide, greedy(1))
    for b, a in zip(*first, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=2e-2)
    longer = run(narrow, greedy(12))
    assert all(len(out.outputs[0].token_ids) == 12 for out in longer)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_cache_dtype": "int2"}, "one of ['auto', 'float32', 'bfloat16', 'float16', 'int8', 'int4'], got 'int2'"),
        ({"kv_cache_dtype": "float16", "dtype": "bfloat16"}, "narrows a float32 model's cache; this engine runs bf"),
        ({"kv_cache_dtype": "bfloat16", "kv_offload": "host"}, "it needs kv_offload='none', got 'host'"),
        ({"kv_cache_dtype": "bfloat16", "prefill_parallel": 2}, "it needs prefill_parallel=1, got 2"),
    ],
    ids=["unknown", "bfloat16-model", "offload", "parallel-prefill"],
)  # fmt: skip
def test_what_it_does_not_cover_is_refused_by_name(options, message) -> None:
    options = {"dtype": "float32", **options}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineConfig(**options)


def test_the_cli_takes_the_option() -> None:
    import argparse

    from kvserve.entrypoints.cli_common import add_model_args
    from kvserve.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--dtype", "float32", "--kv-cache-dtype", "float16"]))
    assert config.kv_dtype(torch.float32) == torch.float16


@pytest.mark.real_model
def test_real_model_likelihood_and_greedy_tokens_match_the_float32_cache(shared_real_loads) -> None:
    text = AUSTEN.read_text()[20000:22000]
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=0, ignore_eos=True)
    results = {}
    for kv_cache_dtype in ("auto", "bfloat16", "float16"):
        llm = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory="128MiB", max_num_batched_tokens=128)
        ids = llm.engine.tokenizer.encode(text)[:300]  # three chunks of prefill over the cache, then decode
        (out,) = llm.generate([ids], params, use_tqdm=False)
        logprobs = torch.tensor([step[t] for step, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])
        results[kv_cache_dtype] = logprobs, out.outputs[0].token_ids
    wide_logprobs, wide_tokens = results["auto"]
    # Measured (AMD EPYC): per-token |difference| at most 0.064 (bfloat16) and 0.008 (float16), mean nats per
    # token equal to 1e-4.
    for kv_cache_dtype, bound in (("bfloat16", 0.15), ("float16", 0.02)):
        logprobs, tokens = results[kv_cache_dtype]
        assert (logprobs - wide_logprobs).abs().max().item() < bound
        assert logprobs.mean().item() == pytest.approx(wide_logprobs.mean().item(), abs=2e-3)
        assert tokens == wide_tokens


@pytest.mark.real_model
def test_real_model_compressed_groups_in_float16_decode_through_the_chain_as_in_float32(shared_real_loads) -> None:
    """H2O at half the KV over a float16 cache: the one-call decode (per-layer tables, scores folded after it)
    gives the eager layers' tokens and logprobs, and the greedy text starts as the float32 cache's."""
    prompts = [
        "Tell me a story about a lighthouse keeper and the storm that changed his life.",
        "Explain in two sentences why the sky is blue, for a child of six.",
    ]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = {}
    for kv_cache_dtype in ("auto", "float16"):
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", swap_space=0, kv_policy="h2o", kv_budget=0.5,
                  kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        tokens[kv_cache_dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.runner.cache.k.dtype == torch.float16
    assert isinstance(llm.engine.runner.model.decode_chain, DecodeChain)
    for narrow, wide in zip(tokens["float16"], tokens["auto"], strict=True):
        assert narrow[:8] == wide[:8]
    assert_the_chain_changes_nothing(llm, prompts, 24)
