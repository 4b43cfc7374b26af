"""kvserve's logger: INFO lines on stderr by default (as vLLM does), unless the application configured it.

Nothing but the text goes to stdout: kvserve logs to stderr, Python's warnings go there, and a worker process
(parallel prefill, tensor parallel) points its stdout at stderr as it starts (``stdout_to_stderr``), since it
inherits the engine's stdout, into which a print of its own would otherwise write inside the streamed text.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from logging.handlers import MemoryHandler


def get_logger() -> logging.Logger:
    """The ``kvserve`` logger; given a stderr handler on first use unless KVSERVE_CONFIGURE_LOGGING=0."""
    logger = logging.getLogger("kvserve")
    if not logger.handlers and os.environ.get("KVSERVE_CONFIGURE_LOGGING", "1") != "0":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s kvserve: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


@contextmanager
def logs_held() -> Iterator[None]:
    """Hold kvserve's log records and Python's warnings back until the block ends, then write them in order: a
    text streamed to the terminal meanwhile is not cut by log lines or warnings (from any thread of this
    process)."""
    logger = get_logger()
    handlers, propagate = logger.handlers, logger.propagate
    held = MemoryHandler(capacity=sys.maxsize, flushLevel=logging.CRITICAL + 1)  # never flushes by itself
    show = warnings.showwarning

    def hold_warning(*warning: object) -> None:  # message, category, filename, lineno, file, line
        held.handle(logging.makeLogRecord({"levelno": logging.WARNING, "held_warning": warning}))

    logger.handlers, logger.propagate = [held], False
    warnings.showwarning = hold_warning
    try:
        yield
    finally:
        logger.handlers, logger.propagate = handlers, propagate
        if warnings.showwarning is hold_warning:
            warnings.showwarning = show
        for record in held.buffer:
            warning = getattr(record, "held_warning", None)
            if warning is None:
                logger.handle(record)
            else:
                show(*warning)
        held.close()


def stdout_to_stderr() -> None:
    """In a worker process, first thing: its stdout (Python's prints and any library's, C++ included) goes to
    stderr. It inherited the engine's stdout, where ``kvserve generate`` streams the text."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
        os.dup2(2, 1)
    except (OSError, ValueError):  # no stderr to point it at (closed): leave stdout as it is
        pass
