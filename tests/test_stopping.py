"""Stop strings: the tail-only search and the held-back prefix agree with a brute-force reading of the text."""

from __future__ import annotations

import random

import pytest

from kvserve.sampling.stopping import find_stop, partial_stop_len


def reference_partial(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def reference_find(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """Every occurrence that ends in the new text, earliest start first."""
    hits = [(i, s) for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > new_from]
    return min(hits) if hits else None


@pytest.mark.parametrize("seed", range(4))
def test_stop_matching_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(3000):
        text = "".join(rng.choice("aab") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        new_from = rng.randint(0, len(text))
        assert partial_stop_len(text, stops) == reference_partial(text, stops), (text, stops)
        assert find_stop(text, stops, new_from) == reference_find(text, stops, new_from), (text, stops, new_from)


def test_text_searched_before_is_not_searched_again():
    text = "xSTOPx" + "y" * 1000
    assert find_stop(text, ["STOP"], 6) is None  # "STOP" ended before the new text
    assert find_stop(text + "ST", ["STOP"], len(text)) is None
    assert find_stop(text + "STOP", ["STOP"], len(text) + 2) == (len(text), "STOP")  # it ends in the new part
    assert partial_stop_len(text + "ST", ["STOP", "TX"]) == 2


def test_a_long_stop_string_holds_back_only_its_matching_prefix():
    stop = "ab" * 128
    assert partial_stop_len("a" * 5000, [stop]) == 1
    assert partial_stop_len("x" + "ab" * 127 + "a", [stop]) == 255
    assert partial_stop_len("ab" * 200, [stop]) == 254
