"""The engine's log-likelihoods against transformers' on the same tiny checkpoint, through every path
a long eval takes: several requests per window, prompts split over chunked-prefill steps, greedy flags."""

from __future__ import annotations

import random

import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.hf_reference import TransformersScorer
from kvserve.eval.loglikelihood import EngineScorer, LoglikelihoodRequest
from kvserve.models import load_model
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

SPEC = TinySpec(num_heads=4, num_kv_heads=2, seed=11)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ll"), SPEC)


def random_requests(count: int, vocab: int, seed: int = 0) -> list[LoglikelihoodRequest]:
    rng = random.Random(seed)
    return [
        LoglikelihoodRequest(
            tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 40))),
            tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 30))),
        )
        for _ in range(count)
    ]


@pytest.mark.slow
def test_engine_matches_transformers(folder):
    loaded = load_model(folder)
    # A small token budget splits the longer prompts over several prefill steps.
    engine = LLMEngine(EngineConfig(block_size=4, max_num_batched_tokens=24, max_num_seqs=4), loaded)
    requests = random_requests(12, loaded.config.vocab_size)
    ours = EngineScorer(engine, window=5, progress=False).loglikelihood(requests)
    reference = TransformersScorer.load(folder, progress=False).loglikelihood(requests)
    assert [r.num_tokens for r in ours] == [len(r.continuation) for r in requests]
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert mine.is_greedy == theirs.is_greedy
    assert not engine.has_unfinished_requests() and engine.kv_usage().used_blocks == 0


@pytest.mark.slow
def test_greedy_continuation_is_flagged(folder):
    """Append the tiny model's own greedy choices: the engine must flag them greedy, and a changed
    last token not."""
    loaded = load_model(folder)
    engine = LLMEngine(EngineConfig(block_size=4), loaded)
    context = (5, 17, 42, 99)
    from kvserve.sampling.sampling_params import SamplingParams

    out = engine.add_request(list(context), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished and o.request_id == out]
        if finished:
            greedy = tuple(finished[0].outputs[0].token_ids)
    scorer = EngineScorer(engine, progress=False)
    flipped = greedy[:-1] + ((greedy[-1] + 1) % loaded.config.vocab_size,)
    on, off = scorer.loglikelihood([LoglikelihoodRequest(context, greedy), LoglikelihoodRequest(context, flipped)])
    assert on.is_greedy and not off.is_greedy and on.logprob > off.logprob


@pytest.mark.slow
def test_a_request_larger_than_the_cache_is_an_error(folder):
    loaded = load_model(folder)
    engine = LLMEngine(EngineConfig(block_size=4, kv_cache_memory=4 * 2 * 2 * 8 * 4 * 2 * 4), loaded)
    capacity = engine.kv.pool.num_blocks * engine.kv.block_size
    with pytest.raises(ValueError, match=f"the whole KV cache holds {capacity} tokens"):
        EngineScorer(engine, progress=False).loglikelihood([LoglikelihoodRequest((1,) * capacity, (2, 3))])
    assert not engine.has_unfinished_requests()


def test_requests_need_context_and_continuation():
    with pytest.raises(ValueError, match="needs a context and a continuation, got 0 and 2 tokens"):
        LoglikelihoodRequest((), (1, 2))
