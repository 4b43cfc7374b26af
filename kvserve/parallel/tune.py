"""``kvserve tune-runahead``: search KV-Runahead partitions on this machine and save them as the KVR-P table.

For each context length the best partition is searched by timing real parallel prefills of that length
(``ParallelPrefill.search``); the table stores them as boundary fractions with the machine's description,
and an engine with ``prefill_partition=predicted`` interpolates between them for any prompt length.
Entries for other process counts already in the file are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvserve.models.dtype import DTYPE_NAMES
from kvserve.models.loader import LoadedModel
from kvserve.parallel.group import WorkerModel
from kvserve.parallel.partition import PartitionTable
from kvserve.parallel.prefill import ParallelPrefill
from kvserve.platform.machine import describe_machine


def default_lengths(max_context: int, smallest: int = 512) -> list[int]:
    """Powers of two from ``smallest`` up to ``max_context``, and ``max_context`` itself."""
    if max_context < smallest:
        return [max_context]
    lengths, n = [], smallest
    while n < max_context:
        lengths.append(n)
        n *= 2
    return [*lengths, max_context]


def tune_runahead(
    loaded: LoadedModel,
    weights: str,
    num_procs: int,
    lengths: Sequence[int],
    output: Path,
    step: int = 64,
    log: Callable[[str], None] = print,
) -> PartitionTable:
    if num_procs < 2:
        raise ValueError(f"tune-runahead needs --prefill-parallel >= 2, got {num_procs}")
    too_long = [n for n in lengths if n > loaded.config.max_position_embeddings]
    if too_long:
        raise ValueError(f"context lengths {too_long} exceed the model's {loaded.config.max_position_embeddings}")
    table = PartitionTable.load(output) if output.is_file() else PartitionTable()
    worker_model = WorkerModel(str(loaded.path), DTYPE_NAMES[loaded.dtype], weights)
    parallel = ParallelPrefill(loaded.model, worker_model, num_procs, "even")
    try:
        for n in lengths:
            result = parallel.search(n, step=step)
            table.add(n, result.partition)
            sizes = result.partition.sizes
            log(f"  {n} tokens: chunks {sizes} ({result.seconds * 1000:.0f} ms, {result.measurements} prefills timed)")
    finally:
        parallel.close()
    machine = {
        **describe_machine(), "model": loaded.path.name, "dtype": DTYPE_NAMES[loaded.dtype], "weights": weights,
        "threads_per_process": max(1, torch.get_num_threads() // num_procs),
    }  # fmt: skip
    table.save(output, machine)
    log(f"saved {output}")
    return table
