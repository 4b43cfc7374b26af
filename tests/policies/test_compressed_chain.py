"""The compressed cache's decode steps as one call (``CompressedKVCache.in_place_decode``, ``decode_layers`` with a
table per layer): the same tokens, logprobs, cached keys and slot scores as the eager layers, bit for bit, for every
policy, with groups compacted while decoding; the steps it leaves to the eager layers; its shape errors."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.compressed import CompressedKVCache
from kvserve.entrypoints.llm import LLM
from kvserve.models.decode_chain import DecodeChain
from kvserve.platform import cpu_kernels
from kvserve.sampling.sampling_params import SamplingParams
from tests.policies.test_compressed_engine_tiny import folder, loaded, make_engine, prompt_ids  # noqa: F401
from tests.test_decode_chain import assert_the_chain_changes_nothing
from tests.tiny_models import torch_single_thread  # noqa: F401 - autouse fixture

PROMPTS = (9, 23, 40)  # prompt lengths: the groups start at different sizes and cross blocks at different steps
DECODE = 30  # tokens each: every group outgrows its target plus slack and is compacted several times


@pytest.fixture(autouse=True)
def _kernels_built():
    assert cpu_kernels.cpu_kernels_available()


def run(folder, loaded, chain: bool, policy: str, **options) -> tuple[list, CompressedKVCache, int]:  # noqa: F811
    """Greedy tokens with logprobs for PROMPTS, the cache afterwards, and how many steps ran as one call."""
    loaded.model.decode_chain = False if chain else None  # False: made at the next forward
    engine = make_engine(folder, loaded, kv_policy=policy, kv_budget=0.5, **options)
    cache = engine.runner.cache
    assert isinstance(cache, CompressedKVCache)
    calls = record_finishes(cache)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE, ignore_eos=True, logprobs=2)
    for i, n in enumerate(PROMPTS):
        engine.add_request(prompt_ids(n, seed=i), params, request_id=str(i))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    return [outputs[str(i)] for i in range(len(PROMPTS))], cache, len(calls)


def record_finishes(cache: CompressedKVCache) -> list[torch.Tensor | None]:
    """The weights each one-call decode step hands back, in order (the cache still does its work)."""
    seen: list[torch.Tensor | None] = []
    finish = cache.finish_in_place_decode

    def spy(metadata, weights: torch.Tensor | None) -> None:
        seen.append(weights)
        finish(metadata, weights)

    cache.finish_in_place_decode = spy
    return seen


@pytest.mark.parametrize("policy", ["pyramid", "h2o", "snapkv", "pyramidkv", "local"])
def test_one_call_decode_is_bit_identical_to_the_eager_layers(folder, loaded, policy) -> None:  # noqa: F811
    eager, eager_cache, eager_calls = run(folder, loaded, False, policy)
    chained, chain_cache, chain_calls = run(folder, loaded, True, policy)
    assert eager_calls == 0 and chain_calls >= DECODE - 2  # the decode steps ran as one call
    assert isinstance(loaded.model.decode_chain, DecodeChain)
    for a, b in zip(eager, chained, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    assert torch.equal(eager_cache.k, chain_cache.k) and torch.equal(eager_cache.v, chain_cache.v)
    assert torch.equal(eager_cache.scores, chain_cache.scores)


def test_a_scoring_policy_asks_for_the_weights_and_a_positional_one_does_not(folder, loaded) -> None:  # noqa: F811
    for policy, scores in (("h2o", True), ("local", False)):
        loaded.model.decode_chain = False
        engine = make_engine(folder, loaded, kv_policy=policy, kv_budget=0.5)
        seen = record_finishes(engine.runner.cache)
        engine.add_request(prompt_ids(12), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert seen and all((w is not None) == scores for w in seen)
        if scores:  # (L, B, T): each layer's probabilities sum to 1 over the slots its row read
            sums = seen[-1].sum(dim=-1)
            assert seen[-1].shape[0] == loaded.config.num_layers
            torch.testing.assert_close(sums, torch.ones_like(sums))


def test_the_op_names_per_layer_shapes_that_do_not_match(folder, loaded) -> None:  # noqa: F811
    loaded.model.decode_chain = False
    engine = make_engine(folder, loaded, kv_policy="h2o", kv_budget=0.5)
    chain = DecodeChain.of(loaded.model.layers, type(loaded.model.layers[0]))
    cache = engine.runner.cache
    layers, hidden = loaded.config.num_layers, loaded.config.hidden_size
    rope = loaded.model.rotary.table(torch.tensor([3]), torch.float32)
    tables = torch.ones(layers, 1, 1, dtype=torch.int32)
    ends = torch.full((layers, 1), 4, dtype=torch.int32)
    bad_slots = torch.zeros(layers - 1, 1, dtype=torch.long)  # one layer short
    with pytest.raises(RuntimeError, match=r"slots \(int64\), starts and ends must be \(L, B\)"):
        torch.ops.kvserve.decode_layers(
            torch.zeros(1, hidden), chain.weights, [0] * layers, cache.k, cache.v, *rope, bad_slots, tables,
            torch.zeros_like(ends), ends, chain.num_heads, chain.num_kv_heads, chain.eps, True,
        )  # fmt: skip


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["h2o", "pyramid"])
def test_real_model_compressed_decode_tokens_and_logprobs_do_not_change(policy, dtype, shared_real_loads) -> None:
    llm = LLM(dtype=dtype, kv_cache_memory="64MiB", swap_space=0, kv_policy=policy, kv_budget=0.5)
    prompts = ["Tell me a story about a lighthouse keeper and the storm that changed his life.", "What is 2+2?"]
    assert_the_chain_changes_nothing(llm, prompts, 40)
