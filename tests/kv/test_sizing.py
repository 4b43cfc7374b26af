"""Blocks for a memory budget, and memory-size strings."""

from __future__ import annotations

import re

import pytest

from kvserve.kv import kv_block_bytes, kv_blocks_for_memory, parse_memory_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1000000", 1_000_000),
        (" 64 kib ", 65536),
        ("3B", 3),
        ("0.5KiB", 512),
        (".5MB", 500_000),
        (4096, 4096),
    ],
)
def test_parse_memory_size(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "2 GiBs", "-1GiB", "1e9", "2 G", "1,000", "1.2.3MB", None, 1.5, True, -4])
def test_parse_memory_size_rejects_and_names_the_value(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        parse_memory_size(bad)


def test_smollm2_blocks_in_2gib():
    # SmolLM2-135M: 30 layers, 3 KV heads, head dim 64; float32; 16-token blocks.
    per_block = 2 * 30 * 3 * 64 * 16 * 4
    assert per_block == 737_280
    assert kv_block_bytes(30, 3, 64, 4, 16) == per_block
    assert kv_blocks_for_memory("2GiB", 30, 3, 64, 4, 16) == 2 * 2**30 // per_block == 2912
    assert kv_blocks_for_memory(per_block - 1, 30, 3, 64, 4) == 0


def test_sizing_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_kv_heads must be an integer >= 1, got 0"):
        kv_block_bytes(30, 0, 64, 4, 16)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 2.0"):
        kv_blocks_for_memory("1GiB", 30, 3, 64, 4, 2.0)
