"""KV cache memory on transparent huge pages: zeros of the asked shape, 2 MiB aligned on Linux, and really
backed by huge pages where the kernel allows them."""

from __future__ import annotations

import sys
from pathlib import Path

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
def test_a_large_cache_starts_on_a_huge_page_and_gets_huge_pages():
    before = _anon_huge_kib()
    t = huge_pages.zeros((64, 1024, 1024), torch.uint8)  # 64 MiB
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" not in mode:
        assert _anon_huge_kib() - before >= 32 * 1024  # most of it (some may be refused under pressure)


def _anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0
