"""The compiled CPU kernels' build cache: a lock left by a killed build does not hang later starts, a build
running in another process is waited for, its lock left alone, and ``KVSERVE_KERNEL_ARCH`` builds apart."""

from __future__ import annotations

import subprocess
import sys
import time

from kvserve.cpu_kernels import build_lock, build_name, cflags

# Another process building: it holds the build lock, makes torch's lock file, builds for a while, and fails if
# that file was taken from under it.
BUILDER = """
import fcntl, pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
with open(folder / "build.flock", "a") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    (folder / "lock").touch()
    (folder / "building").touch()
    time.sleep(1.5)
    if not (folder / "lock").exists():
        sys.exit(1)
    (folder / "lock").unlink()
"""


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path) -> None:
    (tmp_path / "lock").touch()  # just now: no age tells it apart from a running build's
    start = time.monotonic()
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - start < 1.0


def test_a_build_in_another_process_is_waited_for(tmp_path) -> None:
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path)])
    while not (tmp_path / "building").exists():
        assert builder.poll() is None, "the builder exited early"
        time.sleep(0.01)
    start = time.monotonic()
    with build_lock(tmp_path):
        waited = time.monotonic() - start
    assert builder.wait(timeout=30) == 0  # its lock file was still there when it finished
    assert waited > 0.5


def test_kernel_arch_chooses_the_march_and_its_own_build(monkeypatch) -> None:
    """``KVSERVE_KERNEL_ARCH`` builds for another instruction set (e.g. AVX2 on an AVX-512 CPU) in a build of its
    own: the flag reaches g++ and the build's name, so the native build is never loaded in its place."""
    monkeypatch.delenv("KVSERVE_KERNEL_ARCH", raising=False)
    native = build_name()
    assert "-march=native" in cflags()
    monkeypatch.setenv("KVSERVE_KERNEL_ARCH", "haswell")
    assert "-march=haswell" in cflags() and "-march=native" not in cflags()
    assert build_name() != native
