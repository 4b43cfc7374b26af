"""kvserve's logger: INFO lines on stderr by default (as vLLM does), unless the application configured it."""

from __future__ import annotations

import logging
import os
import sys


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
