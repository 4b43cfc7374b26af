"""``min_tokens`` (vLLM's): no stop token is sampled and no stop string counts before a sequence has that many
tokens; the logprobs reported are still the model's own. Tiny random checkpoint, paged engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import RequestOutput
from kvserve.models import LoadedModel, load_model
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    folder: Path = write_tiny_model(tmp_path_factory.mktemp("min-tokens"), TinySpec(seed=11))
    loaded: LoadedModel = load_model(folder)
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", kv_cache_memory="8MiB", swap_space=0), loaded)


def run(engine: LLMEngine, **options) -> RequestOutput:
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=10, **options))
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    return out


def test_stop_tokens_are_not_sampled_before_min_tokens(engine):
    free = run(engine, ignore_eos=True).outputs[0].token_ids
    first = free[0]
    assert run(engine, stop_token_ids=[first]).outputs[0].token_ids == [first]
    held = run(engine, stop_token_ids=[first], min_tokens=3, logprobs=1).outputs[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 4
    assert math.isfinite(held.logprobs[0][first])  # the banned token's logprob is the model's, not -inf


def test_stop_strings_count_only_after_min_tokens(engine):
    free = run(engine, ignore_eos=True).outputs[0]
    stop = free.text[:2]
    assert run(engine, ignore_eos=True, stop=[stop]).outputs[0].text == ""
    late = run(engine, ignore_eos=True, stop=[stop], min_tokens=4).outputs[0]
    assert late.token_ids[:5] == free.token_ids[:5]  # the first stop-string check is at the fifth token
    assert late.text == free.text[: len(late.text)] and len(late.text) > 0


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (dict(min_tokens=11, max_tokens=10), "min_tokens must be an integer in [0, 10], got 11"),
        (dict(min_tokens=-1), "min_tokens must be an integer in [0, 16], got -1"),
        (dict(min_tokens=2, use_beam_search=True, n=2, temperature=0), "not to beam search"),
    ],
)
def test_min_tokens_out_of_range_is_refused(options, words):
    with pytest.raises(ValueError) as caught:
        SamplingParams(**options)
    assert words in str(caught.value)
