"""HeapTrimmer: glibc's freed heap pages go back to the system, at most once per interval."""

import sys

import psutil
import pytest

from kvserve.platform.heap import HeapTrimmer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trims_at_most_once_per_interval():
    clock = FakeClock()
    heap = HeapTrimmer(interval_s=10.0, clock=clock)
    if not heap.available:
        pytest.skip(f"no malloc_trim in this C library ({sys.platform})")
    assert not heap.maybe_trim()  # the interval counts from construction
    clock.now = 9.9
    assert not heap.maybe_trim()
    clock.now = 10.0
    assert heap.maybe_trim()
    clock.now = 19.0
    assert not heap.maybe_trim()
    clock.now = 20.5
    assert heap.maybe_trim()
    assert heap.trims == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim is Linux-only")
def test_freed_holes_below_a_live_chunk_are_returned():
    """Chunks under glibc's mmap threshold come from the heap; freeing all but the topmost leaves holes
    that free() cannot give back and resident memory keeps counting, until malloc_trim."""
    process = psutil.Process()
    heap = HeapTrimmer(interval_s=0.0)
    if not heap.available:
        pytest.skip("no malloc_trim in this C library")
    heap.maybe_trim()
    chunks = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MiB of 64 KiB chunks, each touched (zeroed)
    top = chunks[-1]
    del chunks
    held = process.memory_info().rss
    assert heap.maybe_trim()
    released = held - process.memory_info().rss
    assert released > 150 * 2**20, f"released {released / 2**20:.0f} MiB"
    assert len(top) == 64 * 1024
