"""The compiled CPU kernels' build cache: a lock left by a killed build does not hang later starts, a build
running in another process is waited for, its lock left alone, and ``KVSERVE_KERNEL_ARCH`` builds apart;
``kvserve kernels build``/``status``, and a CPU engine that has its kernels before its first request."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.entrypoints.cli import main
from kvserve.models import load_model
from kvserve.platform import cpu_kernels
from kvserve.platform.cpu_kernels import build_lock, build_name, cflags
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - an autouse fixture

needs_kernels = pytest.mark.skipif(cpu_kernels.kernels_disabled(), reason="KVSERVE_KERNELS=torch")

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


@pytest.mark.slow
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


@needs_kernels
def test_kernels_build_loads_every_op_and_status_says_so(capsys) -> None:
    """In the cache already on a machine that ran the kernels (``make``'s setup builds it): no rebuild."""
    assert main(["kernels", "build"]) == 0
    out = capsys.readouterr().out
    assert f"{len(cpu_kernels.OPS)} ops in {cpu_kernels.build_directory()}" in out
    assert cpu_kernels.missing_ops() == []
    assert main(["kernels", "status"]) == 0
    out = capsys.readouterr().out
    assert f"status: built; {len(cpu_kernels.OPS)} of {len(cpu_kernels.OPS)} ops loaded" in out
    assert str(cpu_kernels.build_directory()) in out


def test_kernels_build_without_a_compiler_fails_saying_so(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.delenv("KVSERVE_KERNELS", raising=False)
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    assert main(["kernels", "build"]) == 1
    err = capsys.readouterr().err
    assert "the CPU kernels did not build: no C++ compiler" in err and "no-such-c++" in err
    assert main(["kernels", "status"]) == 1
    assert "not built for this CPU" in capsys.readouterr().out
    assert not any(tmp_path.rglob("*.so"))


def test_kernels_off_builds_nothing(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("KVSERVE_KERNELS", "torch")
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    assert main(["kernels", "build"]) == 0
    assert "the CPU kernels are off" in capsys.readouterr().out
    assert main(["kernels", "status"]) == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@needs_kernels
def test_a_cpu_engine_has_its_kernels_before_its_first_request(monkeypatch, tmp_path) -> None:
    """Loading the model and starting the engine each load the kernels (a build, the first time): the first
    request never waits for a compile. Not on CUDA, nor with ``KVSERVE_KERNELS=torch``."""
    calls = []
    available = cpu_kernels.cpu_kernels_available
    monkeypatch.setattr(cpu_kernels, "cpu_kernels_available", lambda: calls.append("load") or available())
    folder = write_tiny_model(tmp_path, TinySpec(seed=3))
    loaded = load_model(folder)
    assert calls == ["load"]
    engine = LLMEngine(EngineConfig(model=str(folder), kv_cache_memory=1 << 20), loaded)
    assert calls == ["load", "load"] and cpu_kernels.missing_ops() == []
    engine.add_request("hello world", SamplingParams(max_tokens=2))
    outputs = [out for _ in range(20) for out in engine.step() if out.finished]
    assert len(outputs[0].outputs[0].token_ids) == 2
    calls.clear()
    assert cpu_kernels.prepare_cpu_kernels("cuda") is False
    monkeypatch.setenv("KVSERVE_KERNELS", "torch")
    assert cpu_kernels.prepare_cpu_kernels("cpu") is False
    LLMEngine(EngineConfig(model=str(folder), kv_cache_memory=1 << 20), loaded)
    assert calls == []
