"""``logit_bias`` (OpenAI's) and ``allowed_token_ids`` (vLLM's) steer which token is chosen; the logprobs
reported stay the model's own. Tiny random checkpoint, paged engine, greedy and seeded sampling."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import CompletionOutput
from kvserve.models import LoadedModel, load_model
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import VOCAB_SIZE, TinySpec, torch_single_thread, write_tiny_model  # noqa: F401

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    folder: Path = write_tiny_model(tmp_path_factory.mktemp("logit-bias"), TinySpec(seed=13))
    loaded: LoadedModel = load_model(folder)
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", kv_cache_memory="8MiB", swap_space=0), loaded)


def run(engine: LLMEngine, **options) -> CompletionOutput:
    options = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, **options}
    engine.add_request(PROMPT, SamplingParams(**options))
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    return out.outputs[0]


def test_a_bias_of_100_forces_a_token_and_minus_100_bans_it(engine):
    free = run(engine, logprobs=1)
    first = free.token_ids[0]
    assert run(engine, logit_bias={7: 100.0}).token_ids == [7] * 6
    banned = run(engine, logit_bias={first: -100.0}, logprobs=1)
    assert first not in banned.token_ids
    assert banned.logprobs[0][first] == pytest.approx(free.logprobs[0][first])  # reported: the model's own


def test_allowed_token_ids_limit_greedy_and_sampled_choices(engine):
    allowed = [40, 41, 42]
    assert set(run(engine, allowed_token_ids=allowed).token_ids) <= set(allowed)
    sampled = run(engine, allowed_token_ids=allowed + allowed, temperature=1.0, seed=3, max_tokens=12)
    assert set(sampled.token_ids) <= set(allowed)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (dict(logit_bias={5: 101.0}), "logit_bias values must be in [-100, 100], got 101.0 for token 5"),
        (dict(logit_bias={5: float("nan")}), "logit_bias values must be in [-100, 100]"),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
        (dict(logit_bias={5: 1.0}, use_beam_search=True, n=2, temperature=0), "not to beam search"),
    ],
)
def test_bad_values_are_refused_naming_the_field(options, words):
    with pytest.raises(ValueError) as caught:
        SamplingParams(**options)
    assert words in str(caught.value)


def test_ids_outside_the_vocabulary_are_refused(engine):
    for name, value in (("logit_bias", {VOCAB_SIZE: 1.0}), ("allowed_token_ids", [1, VOCAB_SIZE])):
        with pytest.raises(ValueError) as caught:
            engine.add_request(PROMPT, SamplingParams(**{name: value}))
        message = str(caught.value)
        assert message.startswith(f"{name} [{VOCAB_SIZE}]") and f"vocabulary of {VOCAB_SIZE}" in message
    assert run(engine).token_ids  # the engine goes on
