"""A progress bar on stderr for slow steps: tqdm on a terminal, shown once a step has taken more than a second.

Where stderr is not a terminal (a log file, a pipe) nothing is drawn: redrawn lines would fill the log with
carriage returns and escape codes, and the step's own log line says when it ends.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from types import TracebackType
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from kvserve.log import get_logger


class DelayedProgress:
    """``with DelayedProgress("Loading model") as p: ... p.update(done, total)``."""

    def __init__(self, label: str, delay: float = 1.0, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.delay = delay
        self.bar: tqdm | None = None
        self._stack = ExitStack()

    def update(self, done: int, total: int) -> None:
        if self.bar is None:
            return
        if self.bar.total != total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)

    def __enter__(self) -> DelayedProgress:
        if _is_terminal(self.stream):
            # leave=False: the bar goes when the step ends; the step's log line stays.
            bar = tqdm(desc=self.label, delay=self.delay, file=self.stream, unit="tensor", leave=False,
                       dynamic_ncols=True)  # fmt: skip
            self.bar = self._stack.enter_context(bar)
            self._stack.enter_context(logging_redirect_tqdm([get_logger()]))  # log lines go above the bar
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stack.__exit__(exc_type, exc, tb)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
