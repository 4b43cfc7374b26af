"""Chained block hashes for automatic prefix caching (vLLM v1's ``hash_block_tokens``).

A full block's hash covers its parent block's hash, its own token ids and ``extra`` (anything else that
changes its KV: the KV group, a LoRA adapter, a prompt-cache module), so equal hashes mean equal
*prefixes*, not merely equal blocks. SHA-256 over the ``repr`` of ints, strings and bytes gives the
same value in every process, unlike Python's ``hash``, which salts strings per process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

_STABLE_TYPES = (int, str, bytes, type(None))


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra: tuple = ()) -> int:
    """The 64-bit hash of one full block, chained to ``parent_hash`` (None for the first block)."""
    _check_extra(extra)
    payload = repr((parent_hash, tuple(int(t) for t in token_ids), tuple(extra))).encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "big")


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, extra: tuple = ()) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids``; a partial last block has none."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


def _check_extra(extra: tuple) -> None:
    """Only values whose ``repr`` is the same in every process may salt a hash."""
    for item in extra:
        if isinstance(item, tuple):
            _check_extra(item)
        elif not isinstance(item, _STABLE_TYPES):
            raise TypeError(
                f"extra hash keys must be ints, strings, bytes, None or tuples of them; "
                f"got {item!r} of type {type(item).__name__}"
            )
