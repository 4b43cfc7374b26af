"""How many KV blocks fit in a memory budget, and memory sizes as people write them ("2GiB", "1.5GB")."""

from __future__ import annotations

import re
from decimal import Decimal

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_memory_size(size: str | int) -> int:
    """Bytes in ``size``: a plain count, or a number with a decimal (GB) or binary (GiB) unit; rounded down."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 0:
            raise ValueError(f"memory size must be >= 0 bytes, got {size}")
        return size
    match = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"memory size {size!r} is not a byte count with an optional unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '2GiB' or '1.5GB'"
        )
    return int(Decimal(match.group(1)) * _UNITS[match.group(2).lower()])


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype_size: int, block_size: int) -> int:
    """Bytes of one block across the layers that share it: keys and values, hence the 2."""
    for name, value in [
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_size", dtype_size),
        ("block_size", block_size),
    ]:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_size * block_size


def kv_blocks_for_memory(
    memory: str | int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_size: int, block_size: int = 16
) -> int:
    """Whole blocks that fit in ``memory`` (bytes, or a size string such as "2GiB")."""
    per_block = kv_block_bytes(num_layers, num_kv_heads, head_dim, dtype_size, block_size)
    return parse_memory_size(memory) // per_block
