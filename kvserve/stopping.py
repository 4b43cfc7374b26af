"""Stop strings: where one starts in generated text, and how much tail to hold back while streaming."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], emitted: int) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in the part of ``text`` not yet emitted."""
    hits = [(i, s) for s in stops if (i := text.find(s, max(0, emitted - len(s) + 1))) != -1]
    return min(hits) if hits else None


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
