"""Stop strings: where one starts in generated text, and how much tail to hold back while streaming.

Both functions look only at the end of the text (the new characters plus one stop string's length
before them), so a step costs the same whether the text is 10 or 10,000 characters long; the number
and length of stop strings are bounded by ``SamplingParams``.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], new_from: int) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string that ends in ``text[new_from:]``, the part not yet
    searched; text before it was searched when it was new."""
    hits = [(i, s) for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) != -1]
    return min(hits) if hits else None


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        best = max(best, _partial(text, stop))
    return best


def _partial(text: str, stop: str) -> int:
    """The longest suffix of ``text`` that ``stop`` starts with (shorter than ``stop``): only the places in the
    tail where ``stop``'s first character occurs can start one, and the first that fits is the longest."""
    tail = text[max(0, len(text) - len(stop) + 1) :] if len(stop) > 1 else ""
    i = tail.find(stop[0]) if tail else -1
    while i != -1:
        if stop.startswith(tail[i:]):
            return len(tail) - i
        i = tail.find(stop[0], i + 1)
    return 0
