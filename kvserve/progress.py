"""A progress line on stderr for slow steps, shown only once a step has taken more than a second."""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO


class DelayedProgress:
    """``with DelayedProgress("Loading model") as p: ... p.update(done, total)``.

    A background thread redraws the line every 0.2 s after ``delay`` seconds, so a step that
    finishes quickly prints nothing, and one that stalls before its first update still shows.
    """

    def __init__(self, label: str, delay: float = 1.0, stream: TextIO = sys.stderr) -> None:
        self.label = label
        self.delay = delay
        self.stream = stream
        self.done = 0
        self.total = 0
        self._stop = threading.Event()
        self._shown = False
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def update(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def __enter__(self) -> DelayedProgress:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        if self._shown:
            status = "failed" if exc_type else f"done in {time.perf_counter() - self._start:.1f} s"
            self.stream.write(f"\r{self.label}: {status}\033[K\n")
            self.stream.flush()

    def _run(self) -> None:
        if self._stop.wait(self.delay):
            return
        frames = "|/-\\"
        tick = 0
        while not self._stop.is_set():
            counts = f" {100 * self.done // self.total}% ({self.done}/{self.total})" if self.total else ""
            self.stream.write(f"\r{self.label} {frames[tick % 4]}{counts}\033[K")
            self.stream.flush()
            self._shown = True
            tick += 1
            self._stop.wait(0.2)
