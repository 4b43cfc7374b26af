"""kvserve's logger: INFO lines on stderr by default (as vLLM does), unless the application configured it."""

from __future__ import annotations

import logging
import os
import sys
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
    """Hold kvserve's log records back until the block ends, then write them in order: a text streamed to
    the terminal meanwhile is not cut by log lines (from any thread)."""
    logger = get_logger()
    handlers, propagate = logger.handlers, logger.propagate
    held = MemoryHandler(capacity=sys.maxsize, flushLevel=logging.CRITICAL + 1)  # never flushes by itself
    logger.handlers, logger.propagate = [held], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = handlers, propagate
        for record in held.buffer:
            logger.handle(record)
        held.close()
