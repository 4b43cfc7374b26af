"""``kvserve kernels build`` and ``kvserve kernels status``: the compiled CPU kernels (``cpu_kernels.py``) built
ahead of time (``make``'s setup runs ``build``), and whether this CPU's build is cached, where, with which ops."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvserve.platform import cpu_kernels

OFF = "KVSERVE_KERNELS=torch: the CPU kernels are off (kvserve runs the torch implementations)"


def add_kernels_parser(sub: argparse._SubParsersAction) -> None:
    kernels = sub.add_parser("kernels", help="build kvserve's CPU kernels for this CPU, or say whether they are")
    kernels_sub = kernels.add_subparsers(dest="kernels_command", required=True)
    build = kernels_sub.add_parser(
        "build", help="build this CPU's kernels into the cache (minutes on 2 cores; instant when cached); exits 1 "
        "when they cannot build (no compiler)",
    )  # fmt: skip
    build.add_argument("--verbose", action="store_true", help="show the compiler's commands and progress")
    build.set_defaults(func=cmd_kernels_build)
    status = kernels_sub.add_parser(
        "status", help="whether this CPU's build is cached, where, and its ops (never builds); exits 1 when not built"
    )
    status.set_defaults(func=cmd_kernels_status)


def cmd_kernels_build(args: argparse.Namespace) -> int:
    if cpu_kernels.kernels_disabled():
        print(f"kernels: {OFF}; nothing to build")
        return 0
    cached = cpu_kernels.is_built()
    start = time.monotonic()
    try:
        directory = cpu_kernels.load_kernels(verbose=args.verbose)
    except (OSError, RuntimeError, ImportError) as error:
        print(f"kvserve: error: the CPU kernels did not build: {error}\nkvserve still runs without them, on the torch "
              "implementations (KVSERVE_KERNELS=torch chooses that without this warning)", file=sys.stderr)  # fmt: skip
        return 1
    missing = cpu_kernels.missing_ops()
    if missing:
        print(f"kvserve: error: the build in {directory} lacks ops: {' '.join(missing)}", file=sys.stderr)
        return 1
    how = "cached, loaded" if cached else "built"
    print(f"kernels: {how} in {time.monotonic() - start:.1f} s: {len(cpu_kernels.OPS)} ops in {directory}")
    return 0


def cmd_kernels_status(args: argparse.Namespace) -> int:
    flags = " ".join(cpu_kernels.cflags())
    print(f"build:  {cpu_kernels.build_name()} ({flags}; torch {torch.__version__})")
    print(f"cache:  {cpu_kernels.build_directory()}")
    if cpu_kernels.kernels_disabled():
        print(f"status: {OFF}")
        return 0
    if not cpu_kernels.is_built():
        print("status: not built for this CPU (`kvserve kernels build` builds it; else an engine's start does)")
        return 1
    try:  # the library itself: no compiler run, even where ninja would find the sources newer
        torch.ops.load_library(cpu_kernels.build_directory() / f"{cpu_kernels.build_name()}.so")
    except (OSError, RuntimeError) as error:
        print(f"status: built, but did not load: {error}")
        return 1
    loaded = [op for op in cpu_kernels.OPS if op not in cpu_kernels.missing_ops()]
    print(f"status: built; {len(loaded)} of {len(cpu_kernels.OPS)} ops loaded: {' '.join(loaded)}")
    return 0 if len(loaded) == len(cpu_kernels.OPS) else 1
