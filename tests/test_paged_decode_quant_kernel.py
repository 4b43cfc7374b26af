"""The compiled decode kernel over a quantized KV cache (``csrc/paged_decode_quant.cpp``) against dequantise-then-
attend: the whole cache dequantised to float32 (``KVQuant.dequantize``), then ``paged_decode_reference`` over it.
int8 and int4 rows, rotated or not, SmolLM2's and Gemma 3's shapes (the fast paths) and head dims they do not
cover (the generic path), blocks of 16 and the by-slot view, windows, an empty range, soft-capping, the
probabilities H2O reads, rows of several spans, and the torch path the kernel falls back to."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.attention import decode as decode_module
from kvserve.attention.decode import paged_decode, paged_decode_lse, paged_decode_reference
from kvserve.attention.kv_quant import KVQuant
from kvserve.platform import cpu_kernels as kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels_available(), reason="kvserve's CPU kernels did not build")

RTOL = 1e-5  # of the largest output: float32 accumulations, the codes read exactly
GEOMETRIES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256), "d80": (6, 2, 80)}
# One key, a block boundary either side, a window start mid-block, past one 256-key span, an empty range, and a
# window over a long row (several spans).
RANGES = [(0, 1), (0, 16), (0, 17), (3, 35), (0, 257), (100, 613), (5, 5), (40, 3000)]


def _case(bits, heads, kv_heads, head_dim, block_size, ranges, rotate=True, seed=0):
    """q (B, H, D) float32, the quantized caches' rows, their tables, starts and ends, and the format. Keys carry a
    few large channels (what the rotation spreads); values a mean away from zero (int4's minimum)."""
    gen = torch.Generator().manual_seed(seed)
    quant = KVQuant("int8" if bits == 8 else "int4", head_dim, rotate=rotate)
    batch = len(ranges)
    width = max(-(-end // block_size) for _, end in ranges) + 1
    num_blocks = batch * width + 5
    shape = (num_blocks, block_size, kv_heads, head_dim)
    keys = torch.randn(shape, generator=gen)
    keys[..., :3] *= 8.0
    values = torch.randn(shape, generator=gen) + 0.5
    q = torch.randn(batch, heads, head_dim, generator=gen)
    q, keys, values = quant.rotated(q), quant.rotated(keys), quant.rotated(values)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width).int()
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.int32)
    ends = torch.tensor([e for _, e in ranges], dtype=torch.int32)
    return q, quant.quantize(keys), quant.quantize(values), tables, starts, ends, quant


def _by_slot(k, v, tables, block_size):
    """The same cache as blocks of one token, (-1, 1, Hkv, row_bytes), and each row's table of slots."""
    slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size)).flatten(1).int()
    return k.view(-1, 1, *k.shape[2:]), v.view(-1, 1, *v.shape[2:]), slots


def _close(got, want):
    """Within RTOL of the largest value, over the rows that attend something (an empty row's reference is NaN)."""
    live = ~torch.isnan(want).any(dim=-1)
    scale = want[live].abs().max().item()
    assert (got[live].float() - want[live].float()).abs().max().item() <= RTOL * scale


def _weights_close(got, want):
    """Each key's probability within 1e-6, over the rows that attend something (an empty row's reference is NaN);
    an empty row's are zero."""
    live = ~torch.isnan(want).any(dim=-1)
    assert torch.allclose(got[live], want[live], atol=1e-6, rtol=0)
    assert not got[~live].any()


def test_the_kernel_builds_on_this_machine():
    assert hasattr(torch.ops.kvserve, "paged_decode_quant")
    assert "paged_decode_quant" in kernels.OPS


@pytest.mark.parametrize("rotate", [True, False], ids=["rotated", "plain"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
def test_kernel_matches_dequantise_then_attend(bits, geometry, rotate):
    heads, kv_heads, head_dim = GEOMETRIES[geometry]
    q, k, v, tables, starts, ends, quant = _case(bits, heads, kv_heads, head_dim, 16, RANGES, rotate)
    kf, vf = quant.dequantize(k), quant.dequantize(v)
    got, got_weights = paged_decode(q, k, v, tables, starts, ends, want_weights=True, quant=quant)
    want, want_weights = paged_decode_reference(q, kf, vf, tables, starts, ends, want_weights=True)
    assert got.dtype == torch.float32 and got.shape == q.shape
    _close(got, want)
    _weights_close(got_weights, want_weights)
    empty = RANGES.index((5, 5))
    assert not got[empty].any() and not got_weights[empty].any()
    for row, (start, end) in enumerate(RANGES):
        assert not got_weights[row, :start].any() and not got_weights[row, end:].any()
    # The by-slot view: the same keys in the same order, so the same bits.
    ks, vs, slots = _by_slot(k, v, tables, 16)
    by_slot, by_slot_weights = paged_decode(q, ks, vs, slots, starts, ends, want_weights=True, quant=quant)
    assert torch.equal(by_slot, got) and torch.equal(by_slot_weights, got_weights)


@pytest.mark.parametrize("geometry", ["smollm2", "gemma3"])
@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
def test_log_sum_exp_and_a_soft_cap(bits, geometry):
    heads, kv_heads, head_dim = GEOMETRIES[geometry]
    q, k, v, tables, starts, ends, quant = _case(bits, heads, kv_heads, head_dim, 16, RANGES, seed=1)
    kf, vf = quant.dequantize(k), quant.dequantize(v)
    got, got_lse = paged_decode_lse(q, k, v, tables, starts, ends, quant=quant)
    with pytest.MonkeyPatch.context() as patch:  # the torch path's log-sum-exp over the float cache
        patch.setattr(decode_module, "use_cpu_kernel", lambda *tensors: False)
        want, want_lse = paged_decode_lse(q, kf, vf, tables, starts, ends)
    _close(got, want)
    live = ends > starts
    assert torch.allclose(got_lse[live], want_lse[live], atol=1e-5, rtol=0)
    assert torch.isneginf(got_lse[~live]).all() and not got[~live].any()
    # A cap that bends the logits (they reach about 4 here).
    capped, capped_weights = paged_decode(q, k, v, tables, starts, ends, want_weights=True, softcap=2.0, quant=quant)
    want, want_weights = paged_decode_reference(q, kf, vf, tables, starts, ends, want_weights=True, softcap=2.0)
    _close(capped, want)
    _weights_close(capped_weights, want_weights)
    assert (capped - got)[live].abs().max() > 1e-3


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 128), (8, 1, 64), (2, 2, 18), (3, 1, 6)], ids=str)
@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
def test_other_shapes(bits, heads, kv_heads, head_dim):
    """Group sizes and head dims beside the two models': a fast path's other instances (D = 128, G = 4), the generic
    path (G = 8, D not a multiple of 16), blocks of 5."""
    ranges = [(0, 1), (0, 5), (2, 300), (7, 40)]
    q, k, v, tables, starts, ends, quant = _case(bits, heads, kv_heads, head_dim, 5, ranges, seed=2)
    got, got_weights = paged_decode(q, k, v, tables, starts, ends, want_weights=True, quant=quant)
    want, want_weights = paged_decode_reference(
        q, quant.dequantize(k), quant.dequantize(v), tables, starts, ends, want_weights=True
    )
    _close(got, want)
    _weights_close(got_weights, want_weights)


@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
def test_a_row_does_not_depend_on_the_rest_of_the_batch(bits):
    ranges = [(0, 700), (0, 33), (5, 400), (0, 3000)]
    q, k, v, tables, starts, ends, quant = _case(bits, 9, 3, 64, 16, ranges, seed=3)
    together, _ = paged_decode(q, k, v, tables, starts, ends, quant=quant)
    for row in range(len(ranges)):
        one = slice(row, row + 1)
        alone, _ = paged_decode(q[one], k, v, tables[one], starts[one], ends[one], quant=quant)
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
def test_the_torch_path_dequantises_the_gathered_blocks(monkeypatch, bits):
    """``paged_decode_reference`` with the format is the reference over the dequantised cache, and it is what
    ``paged_decode`` answers without a kernel (``KVSERVE_KERNELS=torch``)."""
    q, k, v, tables, starts, ends, quant = _case(bits, 4, 1, 256, 16, [(0, 40), (3, 300), (0, 1)], seed=4)
    kf, vf = quant.dequantize(k), quant.dequantize(v)
    want, want_weights = paged_decode_reference(q, kf, vf, tables, starts, ends, want_weights=True, softcap=3.0)
    got, got_weights = paged_decode_reference(
        q, k, v, tables, starts, ends, want_weights=True, softcap=3.0, quant=quant
    )
    assert torch.equal(got, want) and torch.equal(got_weights, want_weights)
    monkeypatch.setattr(decode_module, "use_cpu_kernel", lambda *tensors: False)
    fallback, fallback_weights = paged_decode(q, k, v, tables, starts, ends, True, 3.0, quant=quant)
    assert torch.equal(fallback, want) and torch.equal(fallback_weights, want_weights)
    out, lse = paged_decode_lse(q, k, v, tables, starts, ends, 3.0, quant=quant)
    want_out, want_lse = paged_decode_lse(q, kf, vf, tables, starts, ends, 3.0)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
def test_bfloat16_queries(bits):
    """A bfloat16 model's queries go to the kernel as float32 and its output comes back in bfloat16."""
    q, k, v, tables, starts, ends, quant = _case(bits, 9, 3, 64, 16, [(0, 40), (3, 700)], seed=5)
    q = q.bfloat16()
    got, _ = paged_decode(q, k, v, tables, starts, ends, quant=quant)
    want, _ = paged_decode_reference(q.float(), quant.dequantize(k), quant.dequantize(v), tables, starts, ends)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 2**-8 * want.abs().max()  # the bfloat16 output's rounding
    torch_path, _ = paged_decode_reference(q, k, v, tables, starts, ends, quant=quant)
    assert torch_path.dtype == torch.bfloat16 and (torch_path.float() - want).abs().max() < 0.05


def test_bad_calls_are_refused():
    q, k, v, tables, starts, ends, quant = _case(8, 4, 2, 16, 4, [(0, 9)])
    scale = 1 / math.sqrt(16)
    with pytest.raises(RuntimeError, match="int8 or int4"):
        torch.ops.kvserve.paged_decode_quant(q, k, v, tables, starts, ends, scale, 3, False, 0.0)
    with pytest.raises(RuntimeError, match="int4 rows of head_dim 16 are 12 bytes"):
        torch.ops.kvserve.paged_decode_quant(q, k, v, tables, starts, ends, scale, 4, False, 0.0)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvserve.paged_decode_quant(q.bfloat16(), k, v, tables, starts, ends, scale, 8, False, 0.0)
    with pytest.raises(RuntimeError, match="uint8"):
        torch.ops.kvserve.paged_decode_quant(q, k.float(), v.float(), tables, starts, ends, scale, 8, False, 0.0)
    with pytest.raises(RuntimeError, match="outside its table"):
        paged_decode(q, k, v, tables, starts, torch.tensor([tables.shape[1] * 4 + 1], dtype=torch.int32), quant=quant)
