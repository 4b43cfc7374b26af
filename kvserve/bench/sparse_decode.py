"""Sparse decode by context length: InfiniGen without offload against full attention, batch 1, KV on the device.

``kvserve bench offload --tiers device --policies full,infinigen``: two engines over the same loaded model, the
paged cache (``full``) and the same cache whose decodes attend only to the rows InfiniGen's rehearsal selects,
read in place (``infinigen``, ``attention/sparse_decode.py``; window groups and InfiniGen on the global layers of
a model with sliding windows). Per context length both prefill the same prompt, then their decode steps
alternate, one of each in turn, so a shared machine's load falls on both alike; reported: each one's median step
time, and the share of earlier rows the sparse layers read (its ``read_fraction`` over the measured steps).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvserve.core.engine import LLMEngine
from kvserve.platform.machine import machine_line
from kvserve.sampling.sampling_params import SamplingParams

WARMUP_TOKENS = 2


@dataclass
class SparseCell:
    context: int
    full_ms: float  # median decode step, full attention
    sparse_ms: float  # median decode step, InfiniGen's sparse decode
    read_fraction: float  # rows the sparse layers read, of the rows before each decode row
    steps: int


def measure(
    full: LLMEngine, sparse: LLMEngine, prompt: list[int], steps: int, log: Callable[[str], None]
) -> SparseCell:
    """Prefill ``prompt`` in both engines, then ``steps`` measured decode steps of each, alternating."""
    params = SamplingParams(max_tokens=WARMUP_TOKENS + steps + 2, temperature=0.0, ignore_eos=True)
    engines = (full, sparse)
    ids = [engine.add_request(prompt, params, add_special_tokens=False) for engine in engines]
    for engine in engines:  # the prefill (one step under max_num_batched_tokens) and the warm-up
        for _ in range(1 + WARMUP_TOKENS):
            engine.step()
    stats = sparse.runner.cache.stats
    before = (sum(stats.selected_rows), sum(stats.cached_rows))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        for engine, spent in zip(engines, times, strict=True):
            start = time.perf_counter()
            engine.step()
            spent.append(time.perf_counter() - start)
    read = (sum(stats.selected_rows) - before[0]) / max(1, sum(stats.cached_rows) - before[1])
    for engine, request_id in zip(engines, ids, strict=True):
        engine.abort_request(request_id)
    full_ms, sparse_ms = (statistics.median(t) * 1e3 for t in times)
    log(f"    full {full_ms:.1f} ms/step, infinigen {sparse_ms:.1f} ms/step, reads {read:.1%} of the rows")
    return SparseCell(len(prompt), full_ms, sparse_ms, read, steps)


def as_rows(cells: list[SparseCell]) -> list[dict]:
    return [asdict(c) for c in cells]


def markdown(report: dict) -> str:
    lines = [
        f"# Sparse decode by context length: {report['model']}, {report['dtype']}, {report['threads']} threads, "
        "batch 1",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {machine_line(report['machine'])}. {report['note']}",
        "",
        "| context | full ms/token | infinigen ms/token | speed-up | rows read (sparse layers) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in report["results"]:
        lines.append(
            f"| {c['context']:,} | {c['full_ms']:.1f} | {c['sparse_ms']:.1f} | {c['full_ms'] / c['sparse_ms']:.2f}x "
            f"| {c['read_fraction']:.1%} |"
        )
    return "\n".join(lines) + "\n"
