"""Packed bfloat16 projections run at bucketed row counts: the same rows out, few oneDNN shapes kept."""

import ctypes
import sys

import psutil
import pytest
import torch
import torch.nn.functional as F

from kvserve.models.packed_linear import EXACT_ROWS, bucket_rows, can_prepack, packed_linear, prepack


def test_bucket_rows_pads_at_most_an_eighth_and_keeps_few_shapes():
    assert [bucket_rows(n) for n in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    buckets = [bucket_rows(n) for n in range(1, 8193)]
    assert all(b >= n and (b - n) * 8 <= n for n, b in zip(range(1, 8193), buckets, strict=True))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) < 100  # 8,192 row counts, each would be a oneDNN primitive of its own


needs_packing = pytest.mark.skipif(
    not can_prepack(torch.empty(1, dtype=torch.bfloat16)), reason="this torch has no oneDNN bfloat16 linear"
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 5, 32, 33, 47, 300, 1025])
def test_padded_rows_give_the_rows_of_a_plain_linear(rows):
    torch.manual_seed(rows)
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    ours = packed_linear(x.reshape(1, rows, 64), prepack(weight), bias)
    assert ours.shape == (1, rows, 96)
    torch.testing.assert_close(ours[0].float(), F.linear(x.float(), weight.float(), bias.float()), atol=0.3, rtol=0.02)


@pytest.mark.slow
@needs_packing
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads resident memory after glibc's malloc_trim")
def test_many_row_counts_keep_memory_bounded():
    """Unbucketed, each of these 300 row counts kept ~0.6 MiB of oneDNN primitive (186 MiB measured)."""
    torch.manual_seed(0)
    packed = prepack(torch.randn(1536, 576, dtype=torch.bfloat16))
    process, trim = psutil.Process(), ctypes.CDLL("libc.so.6").malloc_trim

    def run(counts: range) -> float:
        for rows in counts:
            packed_linear(torch.randn(rows, 576, dtype=torch.bfloat16), packed)
        trim(0)
        return process.memory_info().rss / 2**20

    before = run(range(1, 40))
    after = run(range(40, 340))
    assert after - before < 60, f"{after - before:.0f} MiB kept for 300 row counts"
