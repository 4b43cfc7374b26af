"""The engine's side of parallel prefill: which steps qualify, which partition, and the KV into the paged cache.

A step qualifies when it is one sequence's whole prompt at once (nothing cached, no prompt logprobs)
and the prompt gives every process at least ``MIN_TOKENS_PER_PROC`` tokens. Anything else, and any
step after a failure, runs the usual single-process path: a failed parallel prefill is logged, the
group is closed, and the same step is recomputed locally, so the request still completes.
"""

from __future__ import annotations

import time

import torch

from kvserve.config import PREFILL_PARTITIONS
from kvserve.errors import ParallelPrefillError
from kvserve.log import get_logger
from kvserve.models.llama import LlamaForCausalLM
from kvserve.parallel.chunks import ChunkJob
from kvserve.parallel.group import PrefillGroup, WorkerModel
from kvserve.parallel.partition import (
    Partition,
    PartitionTable,
    SearchResult,
    default_table_path,
    even_partition,
    search_partition,
)
from kvserve.parallel.remote import RemotePrefillGroup, joined_from_env

MIN_TOKENS_PER_PROC = 16


class ParallelPrefill:
    def __init__(
        self,
        model: LlamaForCausalLM,
        worker_model: WorkerModel,
        num_procs: int,
        partition: str,
        timeout_s: float = 60.0,
    ) -> None:
        self.num_procs = num_procs
        self.table: PartitionTable | None = None
        self.set_partition(partition)
        self.searched: dict[int, tuple[int, ...]] = {}  # context length -> boundaries found by measuring
        self.group: PrefillGroup | RemotePrefillGroup | None
        if joined_from_env():  # started torchrun-style: the workers run `kvserve prefill-worker` elsewhere
            self.group = RemotePrefillGroup(model, num_procs, timeout_s=timeout_s)
        else:
            self.group = PrefillGroup(model, worker_model, num_procs, timeout_s=timeout_s)

    def set_partition(self, partition: str) -> None:
        """even | searched | predicted (loads the table of ``kvserve tune-runahead``) | tsp."""
        if partition not in PREFILL_PARTITIONS:
            raise ValueError(f"prefill_partition must be one of {PREFILL_PARTITIONS}, got {partition!r}")
        if partition == "predicted" and self.table is None:
            path = default_table_path()
            if not path.is_file():
                raise ValueError(f"prefill_partition=predicted needs a table at {path}: run `kvserve tune-runahead`")
            self.table = PartitionTable.load(path)
        self.partition = partition

    @property
    def available(self) -> bool:
        return self.group is not None

    def qualifies(self, num_tokens: int) -> bool:
        return self.group is not None and num_tokens >= self.num_procs * MIN_TOKENS_PER_PROC

    def boundaries(self, context_len: int) -> tuple[int, ...]:
        p = self.num_procs
        if self.partition in ("even", "tsp"):
            return even_partition(context_len, p).boundaries
        if self.partition == "predicted":
            return self.table.predict(context_len, p).boundaries
        if context_len not in self.searched:  # KVR-S: measure real prefills once per length
            self.searched[context_len] = self.search(context_len).partition.boundaries
        return self.searched[context_len]

    def run(
        self, token_ids: list[int], slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor | None:
        """Prefill ``token_ids`` over the group, writing each layer's KV at ``slots`` of the (layers, slots,
        Hkv, D) caches; the last chunk's final hidden states, or None after a failure (run it locally)."""
        scheme = "tsp" if self.partition == "tsp" else "runahead"

        def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            k_cache[layer].index_copy_(0, slots, k)
            v_cache[layer].index_copy_(0, slots, v)

        try:
            job = ChunkJob(scheme, tuple(token_ids), self.boundaries(len(token_ids)))
            return self.group.prefill(job, sink)
        except ParallelPrefillError as exc:
            get_logger().error("parallel prefill failed, falling back to single-process prefill: %s", exc)
            self.close()
            return None

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def search(self, context_len: int, step: int = 16, repeats: int = 2) -> SearchResult:
        """KVR-S: the partition of ``context_len`` tokens with the lowest measured prefill time. Each candidate
        is timed ``repeats`` times and keeps its fastest run: on a shared host a single run can be off by 30%,
        enough to send the search down the wrong side."""
        if self.group is None:
            raise ParallelPrefillError("the prefill group is closed")
        ids = tuple(3 + i % 97 for i in range(context_len))  # timing depends on the length, not on the tokens
        step = max(1, min(step, context_len // (2 * self.num_procs)))  # a short context still has room to search

        def measure(partition: Partition) -> float:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                self.group.prefill(ChunkJob("runahead", ids, partition.boundaries))
                times.append(time.perf_counter() - start)
            return min(times)

        result = search_partition(context_len, self.num_procs, measure, step=step, min_chunk=step)
        get_logger().info(
            "KV-Runahead partition for %d tokens: %s (%d prefills measured)",
            context_len, result.partition.boundaries, result.measurements,
        )  # fmt: skip
        return result
