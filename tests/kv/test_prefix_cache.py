"""Chained block hashes: stable across processes, chained over the parent, salted by ``extra``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve.kv import hash_block_tokens, hash_prompt_blocks


def test_hash_is_a_64_bit_int_and_deterministic():
    h = hash_block_tokens(None, (1, 2, 3, 4))
    assert isinstance(h, int) and 0 <= h < 2**64
    assert h == hash_block_tokens(None, [1, 2, 3, 4])


def test_hash_is_stable_across_processes():
    code = "from kvserve.kv import hash_block_tokens as h; print(h(h(None, (1, 2)), (3, 4), ('lora-a', b'x', 7)))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert int(out) == hash_block_tokens(hash_block_tokens(None, (1, 2)), (3, 4), ("lora-a", b"x", 7))


def test_hash_chains_over_parent_and_extra():
    block = (5, 6, 7, 8)
    first = hash_block_tokens(None, (1, 2, 3, 4))
    other_first = hash_block_tokens(None, (9, 9, 9, 9))
    assert hash_block_tokens(first, block) != hash_block_tokens(other_first, block)
    assert hash_block_tokens(None, block) != hash_block_tokens(None, block, extra=(0,))
    assert hash_block_tokens(None, block, extra=(0,)) != hash_block_tokens(None, block, extra=(1,))


def test_hash_prompt_blocks_covers_full_blocks_only():
    tokens = list(range(10))
    hashes = hash_prompt_blocks(tokens, 4, extra=("x",))
    h0 = hash_block_tokens(None, (0, 1, 2, 3), ("x",))
    assert hashes == [h0, hash_block_tokens(h0, (4, 5, 6, 7), ("x",))]
    assert hash_prompt_blocks(tokens[:3], 4) == []
    assert len(hash_prompt_blocks(tokens[:8], 4)) == 2


def test_bad_inputs():
    with pytest.raises(TypeError, match="got 1.5 of type float"):
        hash_block_tokens(None, (1,), extra=(1.5,))
    with pytest.raises(TypeError, match="of type object"):
        hash_block_tokens(None, (1,), extra=(("ok", object()),))
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        hash_prompt_blocks([1, 2], 0)


def test_kv_package_imports_no_torch():
    code = "import sys, kvserve.kv; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
