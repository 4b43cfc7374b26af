"""kvserve's compiled CPU kernels (``csrc/``), built once per machine and loaded as ``torch.ops.kvserve``.

``paged_decode.cpp``: decode attention over paged KV (``attention/decode.py``); ``paged_decode_quant.cpp``: the same
over an int8 or int4 KV cache's rows, read in place (``attention/kv_quant.py``); ``fused_ops.cpp``: RMSNorm,
rotary embedding and SwiGLU's product, one op each (``models/fused.py``); ``speculate.cpp``: InfiniGen's
speculation for a decode batch (``policies/infinigen.py``); ``quant_gemv.cpp``: products with GGUF's
4-bit and 8-bit codes for decode-sized batches in float32, and both with activations rounded to int8
(``models/quant_linear.py``); ``decode_layers.cpp``:
a plain decode step's decoder layers as one call of the above (``models/decode_chain.py``); ``flash_prefill.cpp``:
causal prefill attention in bfloat16 with AVX512-BF16 products, and with a compressing cache's votes summed from
the same logits (``attention/flash_prefill.py``); ``gguf_gemv.cpp``:
products with GGUF's K-quant, Q5_0 and Q8_0 weights in their file's block format (``models/gguf_linear.py``).

The build uses ``torch.utils.cpp_extension`` (g++ and ninja) with ``-march=native``, so it is keyed by a hash
of the sources and their folder, the flags, the torch version and the CPU's flags: a cached build made on
another CPU is never loaded.
It lands in ``$KVSERVE_KERNEL_CACHE`` (default ``~/.cache/kvserve/kernels``) and later starts load it in
well under a second. Processes building at once take turns on a lock the system drops when its holder dies.
``kvserve kernels build`` (``make``'s setup runs it) builds ahead of time, and a CPU engine loads the kernels when
it starts (``prepare_cpu_kernels``), so a request never waits for a compile.
When the build fails (no compiler), or ``KVSERVE_KERNELS=torch`` is set, every caller falls back to the torch
reference beside the kernel, with one warning saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from kvserve.log import get_logger

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_decode.cpp",
        "paged_decode_quant.cpp",
        "fused_ops.cpp",
        "speculate.cpp",
        "quant_gemv.cpp",
        "decode_layers.cpp",
        "flash_prefill.cpp",
        "slot_scores.cpp",
        "gguf_gemv.cpp",
    )
)
HEADERS = (CSRC / "cpu_vec.h", CSRC / "ops.h")
OPS = (
    "paged_decode",
    "paged_decode_quant",
    "rms_norm",
    "rope_",
    "silu_mul",
    "speculate_rows",
    "q4_linear",
    "q8_linear",
    "q4_linear_q8",
    "q8_linear_q8",
    "decode_layers",
    "flash_prefill",
    "flash_prefill_votes",
    "fold_slot_scores",
    "gguf_linear",
    "gguf_dequantize",
)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# ``KVSERVE_KERNEL_ARCH`` (a g++ -march value, default native) builds for an older instruction set, e.g.
# ``haswell`` (AVX2 without VNNI or AVX-512) to run that path's code on a newer CPU.
CFLAGS = ("-O3", "-ffast-math", "-fopenmp", "-std=c++17")


def cflags() -> tuple[str, ...]:
    return (*CFLAGS, f"-march={os.environ.get('KVSERVE_KERNEL_ARCH', 'native')}")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """The extension's name: changes with the sources (and their folder), the flags, torch and the CPU."""
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(cflags()).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    # ninja's build file names the sources by path: two checkouts sharing one build folder would rebuild it
    # whenever the other had built last, so each checkout gets its own.
    digest.update(str(CSRC.resolve()).encode())
    return f"kvserve_kernels_{digest.hexdigest()[:16]}"


def _cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_KERNEL_CACHE", Path.home() / ".cache" / "kvserve" / "kernels"))


def kernels_disabled() -> bool:
    """``KVSERVE_KERNELS=torch``: the torch implementations everywhere, nothing built or loaded."""
    return os.environ.get("KVSERVE_KERNELS", "").lower() == "torch"


def build_directory() -> Path:
    """Where this CPU's build lives (or will)."""
    return _cache_dir() / build_name()


def is_built() -> bool:
    """Whether this CPU's build is in the cache: loading it then takes well under a second."""
    return any(build_directory().glob("*.so"))


def missing_ops() -> list[str]:
    """The ops of ``OPS`` that ``torch.ops.kvserve`` does not have (all of them before a load)."""
    return [op for op in OPS if not hasattr(torch.ops.kvserve, op)]


def load_kernels(verbose: bool = False) -> Path:
    """Build this CPU's kernels (first time, with a log line) or load the cached build; returns its folder.
    Raises ``RuntimeError`` (no compiler or ninja, a failed compile) or ``OSError``/``ImportError``."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which((compiler.split() or [""])[0]) is None:  # CXX may carry a wrapper: "ccache g++"
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("no ninja: pip install ninja")
    name = build_name()
    directory = _cache_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(directory):
        if not any(directory.glob("*.so")):
            get_logger().info(
                "building kvserve's CPU kernels for this CPU in %s (once; minutes on 2 cores; "
                "`kvserve kernels build` does it ahead of time)", directory,
            )  # fmt: skip
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in SOURCES],
            extra_include_paths=[str(CSRC)],
            extra_cflags=list(cflags()),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
    return directory


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (first time on this machine) or load the CPU kernels; False, with a warning, if that fails."""
    if kernels_disabled():
        return False
    try:
        load_kernels()
    except (OSError, RuntimeError, ImportError) as error:  # no compiler or ninja, or the build failed
        get_logger().warning("kvserve's CPU kernels did not build (%s); using the torch implementations", error)
        return False
    return not missing_ops()


def prepare_cpu_kernels(device: torch.device | str) -> bool:
    """Load the kernels (building them the first time, with a log line) before anything runs on ``device``, so
    that no request's latency includes a compile. Nothing on other devices or with ``KVSERVE_KERNELS=torch``."""
    if torch.device(device).type != "cpu" or kernels_disabled():
        return False
    return cpu_kernels_available()


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s build lock: an ``flock`` on ``build.flock``, which the system releases when its holder
    exits, however it dies. Its holder is the only process building there, so torch's own lock file (``lock``),
    found while holding it, was left by a build killed mid-way (torch would wait on it forever): it goes."""
    with open(directory / "build.flock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            get_logger().info("waiting for another process's kernel build in %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            get_logger().warning("removing %s: a kernel build that did not finish left it", stale)
            stale.unlink(missing_ok=True)
        yield


def use_cpu_kernel(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernels take these tensors: on the CPU, in a dtype they support."""
    return all(t.device.type == "cpu" and t.dtype in KERNEL_DTYPES for t in tensors) and cpu_kernels_available()
