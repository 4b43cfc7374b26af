"""The fused CPU ops of a layer's elementwise steps (RMSNorm, RoPE in place, silu * up) against the torch code
they replace, in float32 and bfloat16, and independent of where a row sits in the batch (batch-invariant mode)."""

from __future__ import annotations

import pytest
import torch

from kvserve.models import fused
from kvserve.platform import cpu_kernels

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: within rounding; bfloat16: equal but for rare one-ulp flips (exp's and a sum's last bit)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    else:
        assert (got != want).float().mean().item() < 1e-3
        torch.testing.assert_close(got.float(), want.float(), atol=0.0, rtol=2**-7)


@pytest.fixture(autouse=True)
def _kernels_built():
    assert cpu_kernels.cpu_kernels_available()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 17, 64])
def test_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    _close(fused.rms_norm(x, weight, 1e-5), fused.rms_norm_reference(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_rotates_a_strided_view_in_place(dtype):
    gen = torch.Generator().manual_seed(1)
    n, heads, kv_heads, dim = 5, 9, 3, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    cos, sin = (torch.randn(n, 1, dim, generator=gen).to(dtype) for _ in range(2))
    qk = qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim)
    values_before = qkv[:, (heads + kv_heads) * dim :].clone()
    want = fused.rotate_reference(qk.clone(), (cos, sin))
    got = fused.rotate_(qk, (cos, sin))
    assert got.data_ptr() == qkv.data_ptr()  # in place
    _close(got, want, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], values_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul(dtype):
    gate_up = (torch.randn(6, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    _close(fused.silu_mul(gate_up, 1536), fused.silu_mul_reference(gate_up, 1536), dtype)


def test_a_row_gets_the_same_bits_wherever_it_sits():
    """RMSNorm's sum runs in a fixed order: the same row at another offset in memory normalises the same."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(33, 576, generator=gen).to(torch.bfloat16)
    weight = torch.randn(576, generator=gen).to(torch.bfloat16)
    together = fused.rms_norm(rows, weight, 1e-5)
    for r in (0, 1, 17, 32):
        assert torch.equal(fused.rms_norm(rows[r : r + 1].clone(), weight, 1e-5)[0], together[r])
