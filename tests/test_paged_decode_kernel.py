"""The compiled paged decode kernel against its torch reference: odd lengths, block boundaries, windows, GQA
ratios, head sizes (the fixed-shape fast path and the generic one) and dtypes; the probabilities it returns
for H2O/PyramidInfer scoring; and the fallback when no kernel is built."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import decode as decode_module
from kvserve.attention.decode import merge_attention, paged_decode, paged_decode_lse, paged_decode_reference
from kvserve.platform import cpu_kernels as kernels

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _case(batch, heads, kv_heads, head_dim, block_size, ranges, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-end // block_size) for _, end in ranges) + 1
    num_blocks = batch * width + 5
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width).int()
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.int32)
    ends = torch.tensor([e for _, e in ranges], dtype=torch.int32)
    return q, k, v, tables, starts, ends


def test_the_kernel_builds_on_this_machine():
    """g++ and ninja are part of kvserve's install: the kernel must build here, not silently fall back."""
    assert kernels.cpu_kernels_available()
    assert hasattr(torch.ops.kvserve, "paged_decode")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (8, 2, 64), (4, 4, 16), (6, 2, 24), (8, 1, 32), (4, 1, 256)],
    ids=["smollm2-g3", "g4", "mha", "d24", "mqa-g8", "gemma3-d256"],
)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_kernel_matches_the_reference(dtype, heads, kv_heads, head_dim, block_size):
    # One key, a block boundary either side, a window start mid-block, and lengths past one 256-key span.
    ranges = [(0, 1), (0, block_size), (0, block_size + 1), (3, 2 * block_size + 3), (0, 257), (100, 613)]
    q, k, v, tables, starts, ends = _case(len(ranges), heads, kv_heads, head_dim, block_size, ranges, dtype)
    got, got_weights = paged_decode(q, k, v, tables, starts, ends, want_weights=True)
    want, want_weights = paged_decode_reference(q, k, v, tables, starts, ends, want_weights=True)
    sdpa, _ = paged_decode_reference(q, k, v, tables, starts, ends)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype]
    assert (got.float() - sdpa.float()).abs().max().item() <= TOLERANCE[dtype]
    assert torch.allclose(got_weights, want_weights, atol=1e-6)
    # A row's probabilities sum to one over its range and are zero outside it.
    assert torch.allclose(got_weights.sum(dim=1), torch.ones(len(ranges)), atol=1e-5)
    for row, (start, end) in enumerate(ranges):
        assert not got_weights[row, :start].any() and not got_weights[row, end:].any()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (6, 2, 24)], ids=str)
def test_float32_queries_over_a_narrower_cache(kv_dtype, heads, kv_heads, head_dim):
    """A float32 model's bfloat16/float16 cache: the keys and values widen exactly, so the kernel keeps float32
    accuracy against the reference over the same rounded cache."""
    ranges = [(0, 1), (0, 17), (3, 35), (0, 257), (100, 613)]
    q, k, v, tables, starts, ends = _case(len(ranges), heads, kv_heads, head_dim, 16, ranges, torch.float32)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    got, got_weights = paged_decode(q, k, v, tables, starts, ends, want_weights=True)
    want, want_weights = paged_decode_reference(q, k, v, tables, starts, ends, want_weights=True)
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() <= TOLERANCE[torch.float32]
    assert torch.allclose(got_weights, want_weights, atol=1e-6)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 64), (4, 4, 128), (2, 2, 64), (4, 1, 256)], ids=str
)
def test_bfloat16_queries_score_as_float32_arithmetic_would(heads, kv_heads, head_dim):
    """bfloat16 queries over a bfloat16 cache take the CPU's bfloat16 dot products where it has them (exact
    products, float32 sums): the log-sum-exps and probabilities must match float32 queries holding the same
    rounded values to float32 rounding, over odd lengths and block boundaries (4-key chunks with a tail)."""
    ranges = [(0, 1), (0, 3), (0, 17), (3, 35), (0, 257), (100, 613)]
    q, k, v, tables, starts, ends = _case(len(ranges), heads, kv_heads, head_dim, 16, ranges, torch.bfloat16)
    got, got_lse = paged_decode_lse(q, k, v, tables, starts, ends)
    wide, wide_lse = paged_decode_lse(q.float(), k, v, tables, starts, ends)
    _, got_weights = paged_decode(q, k, v, tables, starts, ends, want_weights=True)
    _, wide_weights = paged_decode(q.float(), k, v, tables, starts, ends, want_weights=True)
    assert torch.allclose(got_lse, wide_lse, atol=1e-5, rtol=0)
    assert torch.allclose(got_weights, wide_weights, atol=1e-6, rtol=1e-5)
    assert (got.float() - wide).abs().max().item() <= 8e-3  # the bfloat16 output's rounding


def test_a_cache_wider_than_the_queries_is_refused():
    q, k, v, tables, starts, ends = _case(1, 4, 2, 16, 4, [(0, 5)], torch.bfloat16)
    with pytest.raises(RuntimeError, match="narrower under float32 q; got q BFloat16, k_cache Float"):
        torch.ops.kvserve.paged_decode(q, k.float(), v.float(), tables, starts, ends, 0.25, False)


def test_a_row_does_not_depend_on_the_rest_of_the_batch():
    ranges = [(0, 700), (0, 33), (5, 400)]
    q, k, v, tables, starts, ends = _case(3, 9, 3, 64, 16, ranges, torch.bfloat16)
    together, _ = paged_decode(q, k, v, tables, starts, ends)
    for row in range(3):
        alone, _ = paged_decode(
            q[row : row + 1], k, v, tables[row : row + 1], starts[row : row + 1], ends[row : row + 1]
        )
        assert torch.equal(alone[0], together[row])


def test_rows_outside_their_table_are_refused():
    q, k, v, tables, starts, ends = _case(1, 4, 2, 16, 4, [(0, 9)], torch.float32)
    with pytest.raises(RuntimeError, match="outside its table"):
        paged_decode(q, k, v, tables, starts, torch.tensor([tables.shape[1] * 4 + 1], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_two_ranges_merged_by_log_sum_exp_are_one_range(monkeypatch, dtype, use_kernel):
    """What Ada-KV's decode does: a head's packed run and the later slots attended apart, then merged."""
    if not use_kernel:
        monkeypatch.setattr(decode_module, "use_cpu_kernel", lambda *tensors: False)
    whole = [(0, 40), (3, 300), (5, 6), (0, 17)]
    splits = [10, 200, 5, 17]  # the last two: an empty first range, an empty second range
    q, k, v, tables, starts, ends = _case(len(whole), 9, 3, 64, 16, whole, dtype)
    mids = torch.tensor(splits, dtype=torch.int32)
    first, first_lse = paged_decode_lse(q, k, v, tables, starts, mids)
    second, second_lse = paged_decode_lse(q, k, v, tables, mids, ends)
    merged = merge_attention(first, first_lse, second, second_lse)
    want, _ = paged_decode_reference(q, k, v, tables, starts, ends)
    assert (merged.float() - want.float()).abs().max().item() <= 2 * TOLERANCE[dtype]
    assert torch.isneginf(first_lse[2]).all() and not first[2].float().any()  # [5, 5): nothing to attend
    assert torch.isneginf(second_lse[3]).all() and not second[3].float().any()
    _, whole_lse = paged_decode_lse(q, k, v, tables, starts, ends)
    assert torch.allclose(torch.logaddexp(first_lse, second_lse), whole_lse, atol=1e-4)


def test_without_a_kernel_the_reference_answers(monkeypatch):
    q, k, v, tables, starts, ends = _case(2, 9, 3, 64, 16, [(0, 40), (0, 7)], torch.float32)
    monkeypatch.setattr(decode_module, "use_cpu_kernel", lambda *tensors: False)
    got, weights = paged_decode(q, k, v, tables, starts, ends, want_weights=True)
    want, want_weights = paged_decode_reference(q, k, v, tables, starts, ends, want_weights=True)
    assert torch.equal(got, want) and torch.equal(weights, want_weights)


def test_the_build_is_keyed_by_the_cpu(monkeypatch):
    """A build made on a CPU with other instructions is never loaded (``-march=native``)."""
    here = kernels.build_name()
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "flags : fpu sse2")
    assert kernels.build_name() != here


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("g++: not found")

    warnings = []
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(kernels.get_logger(), "warning", lambda message, *args: warnings.append(message % args))
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    assert kernels.cpu_kernels_available.__wrapped__() is False
    assert warnings and "did not build (g++: not found)" in warnings[0]
