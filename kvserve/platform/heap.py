"""Return freed heap memory to the operating system, so that a long-running process's resident memory
follows what it holds now, not the high-water mark of every step shape it has run.

glibc's malloc keeps freed chunks in per-thread arenas and returns memory only from an arena's top.
A server's steps allocate activations of ever-changing shapes (prompt lengths, batch sizes), so free
holes accumulate below live chunks and resident memory creeps up for hours (measured with
``kvserve bench soak``; Python objects and tensors stayed constant). ``malloc_trim(0)`` gives every
whole free page of every arena back (``madvise``), at the cost of a walk over the free lists.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

TRIM_INTERVAL_S = 10.0  # a walk over the free lists takes milliseconds: rare enough to cost nothing per step


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    """Calls ``malloc_trim`` at most once per ``interval_s``; ``maybe_trim()`` is cheap to call every step."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._trim = _load_malloc_trim()
        self._last = clock()
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> bool:
        """Trim if ``interval_s`` has passed since the last trim; returns whether it trimmed."""
        now = self._clock()
        if self._trim is None or now - self._last < self.interval_s:
            return False
        self._last = now
        self._trim(0)
        self.trims += 1
        return True
