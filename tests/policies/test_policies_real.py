"""KV policies on the real default model (SmolLM2-135M-Instruct, float32): lossless at budget 1, half the KV
blocks at budget 0.5 with a small perplexity cost, and per-request policies through the HTTP server."""

from __future__ import annotations

import math

import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import WIKITEXT2
from kvserve.eval.loglikelihood import EngineScorer
from kvserve.eval.perplexity import evaluate_perplexity
from kvserve.sampling.sampling_params import SamplingParams
from tests.server.conftest import start_server

pytestmark = pytest.mark.real_model

OPTIONS = dict(dtype="float32", kv_cache_memory="256MiB", swap_space=0)


def engine(default_model, kv_policy: str, kv_budget: float | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_policy=kv_policy, kv_budget=kv_budget, **OPTIONS), default_model)


def generate(engine: LLMEngine, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[i].outputs[0].token_ids for i in ids]


@pytest.fixture(scope="module")
def wikitext(default_model) -> list[int]:
    return default_model.tokenizer.encode(WIKITEXT2.read_text(encoding="utf-8"), add_special_tokens=False)[:2560]


def test_pyramid_at_budget_one_generates_the_full_cache_tokens(default_model, wikitext) -> None:
    prompts = [wikitext[:700], "The capital of France is"]
    assert generate(engine(default_model, "pyramid", 1.0), prompts, 24) == generate(
        engine(default_model, "full"), prompts, 24
    )


def test_pyramid_halves_the_kv_cache_at_a_small_perplexity_cost(default_model, wikitext) -> None:
    text = default_model.tokenizer.decode(wikitext)
    results = {}
    for policy, budget in (("full", None), ("pyramid", 0.5), ("local", 0.1)):
        e = engine(default_model, policy, budget)
        results[policy] = evaluate_perplexity(EngineScorer(e, progress=False), wikitext, text, 2048, 512).perplexity
    assert results["pyramid"] < results["full"] * 1.10  # 1,536 tokens of context at half the KV
    assert results["local"] > results["full"] * 1.02  # a 10% window costs: the measure can tell

    e = engine(default_model, "pyramid", 0.5)
    e.add_request(wikitext[:2000], SamplingParams(max_tokens=2, temperature=0.0))
    e.step()
    full_blocks = default_model.config.num_layers * math.ceil(2000 / e.kv.block_size)
    assert e.kv_usage().used_blocks <= 0.55 * full_blocks


def test_adakv_gives_heads_their_own_budgets_in_snapkvs_memory(default_model, wikitext) -> None:
    usage, heads = {}, None
    for policy in ("snapkv", "adakv"):
        e = engine(default_model, policy, 0.5)
        e.add_request(wikitext[:1500], SamplingParams(max_tokens=2, temperature=0.0))
        e.step()
        ((_, seq),) = e._seqs.values()
        usage[policy] = (e.kv_usage().used_blocks, list(seq.group_slots))
        heads = seq.group_heads
    assert usage["adakv"] == usage["snapkv"]  # the same slots and blocks per layer
    kv_heads = default_model.config.num_kv_heads
    assert all(sum(h) == kv_heads * n for h, n in zip(heads, usage["adakv"][1], strict=True))
    assert sum(max(h) > 1.5 * min(h) for h in heads) >= 5  # the allocation moves budget between heads

    text = default_model.tokenizer.decode(wikitext)
    full = evaluate_perplexity(EngineScorer(engine(default_model, "full"), progress=False), wikitext, text, 2048, 512)
    ada = evaluate_perplexity(
        EngineScorer(engine(default_model, "adakv", 0.5), progress=False), wikitext, text, 2048, 512
    )
    assert ada.perplexity < full.perplexity * 1.05  # 1,536 tokens of context, half the KV
    outputs = generate(engine(default_model, "adakv", 0.5), [wikitext[:1200]], 40)
    assert len(outputs[0]) == 40  # decoding past the packed prompt evicts among the later slots


def test_server_takes_a_policy_per_request(default_model) -> None:
    running = start_server(engine(default_model, "pyramid", 0.5), name="smol")
    try:
        client = running.client()
        prompt = "The capital of France is"
        reference = generate(engine(default_model, "full"), [prompt], 8)
        response = client.completions.create(
            model="smol", prompt=prompt, max_tokens=8, temperature=0, extra_body={"kv_policy": "full"}
        )
        assert response.choices[0].text == default_model.tokenizer.decode(reference[0])
        compressed = client.completions.create(
            model="smol", prompt=prompt, max_tokens=8, temperature=0, extra_body={"kv_policy": "h2o", "kv_budget": 0.3}
        )
        assert compressed.usage.completion_tokens == 8
        with pytest.raises(Exception, match="kv_budget must be in") as error:
            client.completions.create(model="smol", prompt=prompt, max_tokens=4, extra_body={"kv_budget": 2})
        assert getattr(error.value, "status_code", None) == 400
    finally:
        running.stop()
