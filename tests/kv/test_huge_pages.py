"""KV cache memory on transparent huge pages: zeros of the asked shape, 2 MiB aligned on Linux and advised to
use huge pages (whether the kernel grants them is its decision: benchmarks/decode-kernel/ measured it)."""

from __future__ import annotations

import sys

import pytest
import torch

from kvserve.kv import huge_pages


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_zeros_of_the_asked_shape_and_dtype(dtype):
    t = huge_pages.zeros((3, 5, 16, 2, 8), dtype)
    assert t.shape == (3, 5, 16, 2, 8) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[2, 4, 15, 1, 7] = 1  # the last element is writable: the view covers the whole shape
    assert t.sum() == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are a Linux feature")
def test_a_large_cache_starts_on_a_huge_page_and_is_advised(monkeypatch):
    """Whether the kernel then grants huge pages depends on its free memory (a full test run got none at times);
    what kvserve owes is the advice on 2 MiB-aligned memory, for the whole huge pages it spans."""
    calls = []

    def madvise(address, length, advice):
        calls.append((address, length, advice))
        return 0

    monkeypatch.setattr(huge_pages, "_madvise", lambda: madvise)
    t = huge_pages.zeros((5, 1024, 1024), torch.uint8)  # 5 MiB: two whole huge pages
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert calls == [(t.data_ptr(), 4 << 20, huge_pages.MADV_HUGEPAGE)]
    assert not t.any()


def test_a_small_cache_is_not_advised(monkeypatch):
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *args: calls.append(args))
    assert not huge_pages.zeros((16, 1024), torch.uint8).any()
    assert calls == []
