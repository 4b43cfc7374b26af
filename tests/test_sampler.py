"""Sampler (greedy, temperature, top-k, top-p, per-request seeds) and SamplingParams validation."""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvserve.sampling.sampler import make_generator, sample
from kvserve.sampling.sampling_params import SamplingParams

# Chi-square critical values at p = 0.001 (df = 1, 2, 3); seeded draws keep these tests deterministic.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27}
PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    generator = make_generator(params)
    return [sample(logits, params, generator) for _ in range(n)]


def _counts(draws: list[int], size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(draws), minlength=size).double()


def _chi2(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's statistic over the tokens with non-zero expected probability."""
    expected = expected_probs.double() * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def _random_logits(seed: int, size: int = 50) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed)) * 3


# ----- greedy and filters -----


@pytest.mark.parametrize("seed", range(5))
def test_greedy_picks_argmax(seed) -> None:
    logits = _random_logits(seed)
    params = SamplingParams(temperature=0.0)
    assert params.greedy
    assert make_generator(params) is None
    assert sample(logits, params, None) == int(logits.argmax())


def test_greedy_ignores_top_k_and_top_p() -> None:
    logits = _random_logits(10)
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.5)
    assert sample(logits, params, None) == int(logits.argmax())


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_equals_greedy(temperature) -> None:
    for seed in range(5):
        logits = _random_logits(seed)
        params = SamplingParams(temperature=temperature, top_k=1, seed=seed)
        assert set(_draw(logits, params, 30)) == {int(logits.argmax())}


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    # Nearly flat: without the filter, 40 draws would hit many tokens.
    logits = torch.linspace(0.0, 0.1, 20)
    params = SamplingParams(temperature=1.0, top_p=1e-6, seed=1)
    assert set(_draw(logits, params, 40)) == {19}
    assert len(set(_draw(logits, SamplingParams(temperature=1.0, seed=1), 40))) > 5


@pytest.mark.parametrize(("top_p", "allowed"), [(0.35, {3}), (0.65, {3, 2}), (0.85, {3, 2, 1}), (0.95, {3, 2, 1, 0})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, allowed) -> None:
    """Probabilities 0.4, 0.3, 0.2, 0.1: the nucleus is the most likely tokens until their sum reaches top_p."""
    logits = PROBS.log()
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=3)
    draws = _draw(logits, params, 600)
    assert set(draws) == allowed
    kept = torch.zeros(4)
    kept[list(allowed)] = PROBS[list(allowed)]
    if len(allowed) > 1:  # the kept tokens keep their relative odds
        assert _chi2(_counts(draws, 4), kept / kept.sum()) < CHI2_CRITICAL[len(allowed) - 1]


def test_top_k_keeps_k_most_likely_renormalised() -> None:
    logits = PROBS.log()
    params = SamplingParams(temperature=1.0, top_k=3, seed=4)
    counts = _counts(_draw(logits, params, 3000), 4)
    assert counts[0] == 0
    expected = torch.tensor([0.0, 0.2, 0.3, 0.4]) / 0.9
    assert _chi2(counts, expected) < CHI2_CRITICAL[2]


# ----- seeds -----


def test_same_seed_gives_same_samples() -> None:
    logits = torch.zeros(1000)  # flat
    params = SamplingParams(temperature=1.0, seed=1234)
    first = _draw(logits, params, 50)
    torch.manual_seed(999)  # the global RNG must not matter
    torch.rand(10)
    assert _draw(logits, params, 50) == first


def test_different_seeds_differ_on_a_flat_distribution() -> None:
    logits = torch.zeros(1000)
    a = _draw(logits, SamplingParams(temperature=1.0, seed=1), 20)
    b = _draw(logits, SamplingParams(temperature=1.0, seed=2), 20)
    assert a != b
    assert len(set(a)) > 10  # really sampling, not stuck on one token


def test_unseeded_requests_differ() -> None:
    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0)
    assert _draw(logits, params, 20) != _draw(logits, params, 20)


# ----- distribution -----


def test_samples_follow_the_distribution() -> None:
    logits = PROBS.log()
    counts = _counts(_draw(logits, SamplingParams(temperature=1.0, seed=5), 4000), 4)
    assert _chi2(counts, PROBS) < CHI2_CRITICAL[3]
    # The check has teeth: the same counts are far from a uniform distribution.
    assert _chi2(counts, torch.full((4,), 0.25)) > 100


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_the_distribution(temperature) -> None:
    logits = PROBS.log()
    counts = _counts(_draw(logits, SamplingParams(temperature=temperature, seed=6), 4000), 4)
    tempered = torch.softmax(logits / temperature, dim=-1)
    assert _chi2(counts, tempered) < CHI2_CRITICAL[3]
    assert _chi2(counts, PROBS) > 50  # distinguishable from temperature 1


# ----- SamplingParams validation -----


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"max_tokens": -3}, "max_tokens", "-3"),
        ({"max_tokens": 2.5}, "max_tokens", "2.5"),
        ({"temperature": -1}, "temperature", "-1"),
        ({"temperature": float("nan")}, "temperature", "nan"),
        ({"top_p": 0}, "top_p", "0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": 0}, "top_k", "0"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"stop": [""]}, "stop", "['']"),
        ({"stop": ["ok", ""]}, "stop", "['ok', '']"),
    ],
)
def test_invalid_sampling_params_name_field_and_value(kwargs, field, value) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert re.search(rf"\b{field}\b", message), message
    assert value in message, message


def test_valid_edge_values_are_accepted() -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, stop="END")
    assert params.greedy
    assert params.stop == ["END"]  # a single string is normalised to a list
    assert not SamplingParams(temperature=1e-3, top_p=1e-9, top_k=1).greedy
    assert math.isclose(SamplingParams().temperature, 1.0)
