"""The compiled CPU kernels' build cache: a lock left by a killed build does not hang every later start."""

from __future__ import annotations

import os
import time

from kvserve.cpu_kernels import clear_stale_lock


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()  # a build may be running right now
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
    assert not clear_stale_lock(tmp_path)  # nothing left to remove
