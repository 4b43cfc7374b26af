"""The server's API keys: ``--api-key`` (any number of times), ``--api-key-file`` and ``$KVSERVE_API_KEY``.

A keys file holds one key per line; blank lines and lines starting with ``#`` are skipped. Keys are secrets:
errors name the file and line, never a key. With two keys or more each key is a tenant with its own
schemas and prefix-cache blocks (``kvserve/core/isolation.py``).
"""

from __future__ import annotations

from pathlib import Path

ENV_VAR = "KVSERVE_API_KEY"


def read_api_keys(options: list[str] | None, file: str | None, env: str | None) -> list[str]:
    """The keys, in order and without repeats: the options' and the file's, or else the environment's one."""
    keys = [*_checked(options or [], "--api-key"), *(_read_file(file) if file is not None else [])]
    if not keys and env:
        keys = _checked([env], f"${ENV_VAR}")
    return list(dict.fromkeys(keys))


def _read_file(path: str) -> list[str]:
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-key-file {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if key and not key.startswith("#"):
            keys += _checked([key], f"--api-key-file {path!r} line {number}")
    if not keys:
        raise ValueError(f"--api-key-file {path!r} holds no keys (one per line; '#' starts a comment line)")
    return keys


def _checked(keys: list[str], where: str) -> list[str]:
    """Keys that fit a header's ``Bearer <key>``: non-empty, printable ASCII, no spaces."""
    for key in keys:
        if not key or not all("!" <= c <= "~" for c in key):
            raise ValueError(f"{where}: an API key must be non-empty printable ASCII without spaces")
    return keys
