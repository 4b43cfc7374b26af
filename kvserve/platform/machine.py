"""A description of the machine a benchmark ran on, recorded next to every figure."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def describe_machine() -> dict[str, object]:
    info: dict[str, object] = {
        "cpu": _cpu_model(),
        "nproc": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def machine_line(m: dict) -> str:
    """A report's machine for its Markdown: ``CPU, N vCPU, M GiB, torch V``."""
    return f"{m.get('cpu')}, {m.get('nproc')} vCPU, {m.get('memory_gib')} GiB, torch {m.get('torch')}"


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None
