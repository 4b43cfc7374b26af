"""Sliding windows on hand-made cases, and perplexity through a scorer with known logprobs."""

from __future__ import annotations

import math

import pytest

from kvserve.eval.loglikelihood import Loglikelihood, LoglikelihoodRequest
from kvserve.eval.perplexity import Window, evaluate_perplexity, sliding_windows


def test_windows_score_every_token_but_the_first_exactly_once():
    windows = sliding_windows(10, context=4, stride=2)
    assert windows == [
        Window(0, 4, 1),  # the first window scores tokens 1..3
        Window(2, 6, 4),  # later ones only what the previous window did not score
        Window(4, 8, 6),
        Window(6, 10, 8),
    ]
    scored = [t for w in windows for t in range(w.scored_from, w.end)]
    assert scored == list(range(1, 10))


@pytest.mark.parametrize(("num_tokens", "context", "stride"), [(2, 2, 1), (7, 4, 4), (100, 16, 5), (5, 64, 8)])
def test_windows_cover_the_text(num_tokens, context, stride):
    windows = sliding_windows(num_tokens, context, stride)
    scored = [t for w in windows for t in range(w.scored_from, w.end)]
    assert scored == list(range(1, num_tokens))
    assert all(w.end - w.begin <= context and w.scored_from > w.begin for w in windows)


@pytest.mark.parametrize(
    ("num_tokens", "context", "stride", "message"),
    [
        (1, 4, 2, "at least 2"),
        (10, 1, 1, "context must be >= 2"),
        (10, 4, 5, "stride must be in"),
        (10, 4, 0, "stride"),
    ],
)
def test_bad_window_settings_are_errors(num_tokens, context, stride, message):
    with pytest.raises(ValueError, match=message):
        sliding_windows(num_tokens, context, stride)


class HalvingScorer:
    """Every token has probability 1/2, so the perplexity is exactly 2."""

    name = "fake"

    def __init__(self) -> None:
        self.requests: list[LoglikelihoodRequest] = []

    def loglikelihood(self, requests):
        self.requests.extend(requests)
        return [Loglikelihood(len(r.continuation) * math.log(0.5), True, len(r.continuation)) for r in requests]


def test_perplexity_of_known_logprobs():
    scorer = HalvingScorer()
    tokens = list(range(100, 120))
    result = evaluate_perplexity(scorer, tokens, "one two three four", context=8, stride=4)
    assert result.perplexity == pytest.approx(2.0)
    assert result.scored_tokens == 19
    assert result.nll == pytest.approx(19 * math.log(2))
    assert result.word_perplexity == pytest.approx(math.exp(19 * math.log(2) / 4))
    assert result.bits_per_byte == pytest.approx(19 / len(b"one two three four"))
    # The scorer saw each window's history as context and only new tokens as continuation.
    first, second = scorer.requests[:2]
    assert first.context == (100,) and first.continuation == tuple(range(101, 108))
    assert second.context == tuple(range(104, 108)) and second.continuation == tuple(range(108, 112))
    assert result.processed_tokens == sum(len(r.context) + len(r.continuation) for r in scorer.requests)
