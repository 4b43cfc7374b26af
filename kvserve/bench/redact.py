"""Secrets never reach a report: the values of secret options (``--api-key``) and of keys such as ``api_key``
become ``***`` in its JSON and Markdown."""

from __future__ import annotations

import sys
from collections.abc import Sequence

MASK = "***"
SECRET_OPTIONS = ("--api-key",)
SECRET_KEYS = frozenset({"api_key"})
_MIN_PREFIX = len("--api")  # argparse also takes an unambiguous prefix, e.g. --api-k


def command_line(argv: Sequence[str] | None = None) -> str:
    """``kvserve ARGS`` as run (default: this process's arguments), secret option values masked."""
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(["kvserve", *redact_argv(argv)])


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``--api-key X`` -> ``--api-key ***``, ``--api-key=X`` -> ``--api-key=***``."""
    out, mask_next = [], False
    for arg in argv:
        name, has_value, _ = arg.partition("=")
        if mask_next:
            out.append(MASK)
        elif _is_secret_option(name) and has_value:
            out.append(f"{name}={MASK}")
        else:
            out.append(arg)
        mask_next = not mask_next and _is_secret_option(arg)
    return out


def _is_secret_option(name: str) -> bool:
    return len(name) >= _MIN_PREFIX and any(option.startswith(name) for option in SECRET_OPTIONS)


def redact_keys(value: object) -> object:
    """``value`` (a report) with the value of every ``api_key`` key, at any depth, masked."""
    if isinstance(value, dict):
        return {k: MASK if k in SECRET_KEYS and v else redact_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_keys(v) for v in value]
    return value
