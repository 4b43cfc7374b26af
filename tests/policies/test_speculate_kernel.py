"""InfiniGen's compiled speculation (``csrc/speculate.cpp``) against its torch reference (``speculate_paged``):
the same counts and the same picks per KV head over odd lengths, block boundaries, ranges that start
mid-block (sliding windows), GQA ratios and dtypes; the slots it returns follow the block tables; bad
ranges are refused; and tensor parallelism (a count averaged over ranks) takes the reference."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.platform import cpu_kernels
from kvserve.policies.infinigen import InfiniGen, PagedCandidates, speculate_paged


def _case(batch, kv_heads, group, dims, block_size, ranges, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-end // block_size) for _, end in ranges)
    num_blocks = batch * width + 3
    partial_keys = torch.randn(kv_heads, num_blocks, dims, block_size, generator=gen).to(dtype)  # blocks transposed
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width).int()
    partial_q = torch.randn(batch, kv_heads, group, dims, generator=gen).mul(2).to(dtype)
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.int32)
    ends = torch.tensor([e for _, e in ranges], dtype=torch.int32)
    return partial_q, partial_keys, PagedCandidates(tables, block_size, starts, ends)


def _kv_logits(partial_q, partial_keys, candidates):
    """(B, Hkv, W * block_size): each candidate's logit, the max over its KV head's query heads."""
    batch = partial_q.shape[0]
    positions = torch.arange(candidates.block_tables.shape[1] * candidates.block_size).expand(batch, -1)
    slots = candidates.slots(positions)  # (B, T), each row through its own table
    by_slot = partial_keys.transpose(-1, -2).flatten(1, 2)  # (Hkv, slots, r)
    keys = by_slot[:, slots].transpose(0, 1)  # (B, Hkv, T, r)
    return torch.matmul(partial_q, keys.transpose(-1, -2)).float().amax(2)


def _picks(selection, slots):
    """Per (row, KV head): the sorted chosen positions and their slots."""
    out = []
    for b, count in enumerate(selection.counts.tolist()):
        for h in range(selection.index.shape[1]):
            order = selection.index[b, h, :count].argsort()
            out.append((selection.index[b, h, :count][order].tolist(), slots[b, h, :count][order].tolist()))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("kv_heads", "group", "dims"), [(3, 3, 20), (2, 4, 16), (1, 8, 77), (4, 1, 5)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("alpha", [0.5, 3.0, 1e9])
def test_kernel_selects_what_the_reference_selects(dtype, kv_heads, group, dims, block_size, alpha):
    assert cpu_kernels.cpu_kernels_available()
    # One candidate, a block boundary either side, a window start mid-block, long rows.
    ranges = [(0, 1), (0, block_size), (0, block_size + 1), (3, 2 * block_size + 3), (0, 613), (100, 301), (7, 4099)]
    partial_q, partial_keys, candidates = _case(len(ranges), kv_heads, group, dims, block_size, ranges, dtype)
    policy = InfiniGen(alpha=alpha)
    got, got_slots = policy.select_decode_rows(0, partial_q, partial_keys, candidates, head_dim=64)
    want, want_slots = speculate_paged(partial_q, partial_keys, candidates, 64, alpha)
    assert got.counts.tolist() == want.counts.tolist()
    assert got.index.shape == want.index.shape and got_slots.shape == got.index.shape
    assert got.chosen.tolist() == want.chosen.tolist()
    if dtype == torch.float32:
        assert _picks(got, got_slots) == _picks(want, want_slots)
    else:  # bfloat16 logits tie often, and a tie may go either way: the picks' logits are the same values
        logits = _kv_logits(partial_q, partial_keys, candidates)
        for b, count in enumerate(got.counts.tolist()):
            for h in range(kv_heads):
                mine, theirs = (logits[b, h, s.index[b, h, :count]].sort().values for s in (got, want))
                assert torch.equal(mine, theirs)
        assert torch.equal(got_slots, candidates.slots(got.index))
    for b, (start, end) in enumerate(ranges):  # inside the row's range, ascending, distinct
        picks = got.index[b, :, : got.counts[b]]
        assert ((picks >= start) & (picks < end)).all()
        assert (picks.diff(dim=-1) > 0).all()
    if alpha == 1e9:  # everything is within alpha: every candidate, every head
        assert got.counts.tolist() == [end - start for start, end in ranges]


def test_count_is_the_floored_mean_of_the_heads_counts():
    """Hand-made logits: head 0 has 3 candidates within alpha of its best, head 1 has 1 -> count 2."""
    scale = math.sqrt(4)  # head_dim 4: q.k / 2
    partial_keys = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)  # one block of 4 keys, r = 1
    partial_q = torch.tensor([1.0, -4.0]).mul(scale).view(1, 1, 2, 1)  # logits k and -4k
    candidates = PagedCandidates(torch.zeros(1, 1, dtype=torch.int32), 4, torch.tensor([0], dtype=torch.int32),
                                 torch.tensor([4], dtype=torch.int32))  # fmt: skip
    selection, slots = InfiniGen(alpha=2.5).select_decode_rows(0, partial_q, partial_keys, candidates, head_dim=4)
    # head 0: 4,3,2 within 2.5 of 4 (3 of them); head 1: -4 alone within 2.5 of -4 (1); mean 2.
    assert selection.counts.tolist() == [2]
    # KV logit = max over the group: max(k, -4k) = k, so the two largest keys.
    assert sorted(selection.index[0, 0].tolist()) == [2, 3] and sorted(slots[0, 0].tolist()) == [2, 3]


def test_a_range_outside_the_table_is_refused():
    partial_q, partial_keys, candidates = _case(1, 1, 2, 8, 4, [(0, 8)], torch.float32)
    bad = PagedCandidates(candidates.block_tables, 4, candidates.starts, torch.tensor([9], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="speculates over 0..9"):
        InfiniGen(alpha=1.0).select_decode_rows(0, partial_q, partial_keys, bad, head_dim=8)


def test_tensor_parallel_counts_take_the_reference(monkeypatch):
    """A rank mean makes the count depend on other ranks' heads: the kernel is not called."""
    partial_q, partial_keys, candidates = _case(2, 2, 2, 8, 4, [(0, 9), (2, 15)], torch.float32)

    def no_kernel(*args):
        raise AssertionError("the kernel ran under a rank mean")

    monkeypatch.setattr(torch.ops.kvserve, "speculate_rows", no_kernel, raising=False)
    doubled = InfiniGen(alpha=1.0).select_decode_rows(
        0, partial_q, partial_keys, candidates, head_dim=8, rank_mean=lambda t: t * 2
    )[0]
    alone = speculate_paged(partial_q, partial_keys, candidates, 8, 1.0)[0]
    assert (doubled.counts >= alone.counts).all() and (doubled.counts > alone.counts).any()
