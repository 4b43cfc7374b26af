"""The engine's side of parallel prefill: which steps qualify, which partition, and the KV into the paged cache.

A step qualifies when it is one sequence's whole prompt at once (nothing cached, no prompt logprobs)
and the prompt gives every process at least ``MIN_TOKENS_PER_PROC`` tokens. Anything else, and any
step while the group is down, runs the usual single-process path: a failed parallel prefill is logged,
the group is closed, and the same step is recomputed locally, so the request still completes; the
supervisor (``supervisor.py``) starts a new group with backoff.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import LayerKVSink
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
from kvserve.parallel.supervisor import GroupState, GroupSupervisor
from kvserve.policies.base import KVPolicy

if TYPE_CHECKING:
    from kvserve.core.step import SchedulerOutput

MIN_TOKENS_PER_PROC = 16


@dataclass(frozen=True)
class PrefillRoute:
    """Where a whole prompt was prefilled: over ``processes`` processes, or in this one (1), and why."""

    num_tokens: int
    processes: int
    reason: str = ""  # why it ran in this process

    def describe(self) -> str:
        if self.processes > 1:
            return f"prefill of {self.num_tokens} tokens over {self.processes} processes"
        return f"prefill of {self.num_tokens} tokens in this process: {self.reason}"


class ParallelPrefill:
    def __init__(
        self,
        model: LlamaForCausalLM,
        worker_model: WorkerModel,
        num_procs: int,
        partition: str,
        timeout_s: float = 60.0,
        kv_quant: str | None = None,
    ) -> None:
        """``kv_quant``: the engine's quantized cache format (int8, int4), in which the ranks pass KV."""
        self.num_procs, self.kv_quant = num_procs, kv_quant
        self.windowed = any(w is not None for w in model.config.layer_windows)
        self.table: PartitionTable | None = None
        self.set_partition(partition)
        self.searched: dict[int, tuple[int, ...]] = {}  # context length -> boundaries found by measuring
        self.last_route: PrefillRoute | None = None  # the latest whole prompt offered to qualifies()
        if joined_from_env():  # started torchrun-style: the workers run `kvserve prefill-worker` elsewhere
            self.supervisor = GroupSupervisor(RemotePrefillGroup(model, num_procs, timeout_s=timeout_s), num_procs - 1)
            return

        def start(cancel: threading.Event) -> PrefillGroup:
            return PrefillGroup(model, worker_model, num_procs, timeout_s=timeout_s, cancel=cancel)

        # The first group starts here, so an engine that cannot have one fails at construction.
        self.supervisor = GroupSupervisor(start(threading.Event()), num_procs - 1, start)

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
    def group(self) -> PrefillGroup | RemotePrefillGroup | None:
        """The running group; None while it is restarting or after close."""
        return self.supervisor.group

    @property
    def available(self) -> bool:
        return self.supervisor.group is not None

    def state(self) -> GroupState:
        return self.supervisor.state()

    def qualifies(self, num_tokens: int) -> bool:
        """Whether a whole prompt of ``num_tokens`` runs over the group; one that does not is noted in
        ``last_route`` with the reason."""
        reason = ""
        if num_tokens < self.num_procs * MIN_TOKENS_PER_PROC:
            reason = f"fewer than {self.num_procs * MIN_TOKENS_PER_PROC} tokens ({MIN_TOKENS_PER_PROC} a process)"
        elif not self.available:
            reason = f"the prefill group is down ({self.state().state})"
        if reason:
            self.last_route = PrefillRoute(num_tokens, 1, reason)
        return not reason

    def boundaries(self, context_len: int) -> tuple[int, ...]:
        p = self.num_procs
        if self.partition in ("even", "tsp"):
            return even_partition(context_len, p).boundaries
        if self.partition == "predicted":
            return self.table.predict(context_len, p).boundaries
        if context_len not in self.searched:  # KVR-S: measure real prefills once per length
            self.searched[context_len] = self.search(context_len).partition.boundaries
        return self.searched[context_len]

    def takes(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> bool:
        """Whether the step ``out`` runs over the group: one sequence's whole prompt (a Prompt Cache module's
        too), nothing cached, no prompt logprobs, long enough (``qualifies``), and not under a per-head policy
        (SnapKV: the ranks' votes are summed per slot, not per KV head; such a prompt runs in this process). On a
        model with sliding-window layers, positions must run one by one: the ranks count windows in tokens."""
        if len(out.scheduled) != 1:
            return False
        seq = out.scheduled[0]
        per_head = seq.kv_policy is not None and seq.kv_policy.per_head
        gapped = (
            self.windowed
            and bool(seq.positions)
            and tuple(seq.positions) != tuple(range(seq.positions[0], seq.positions[0] + len(seq.positions)))
        )
        return (
            seq.num_computed_tokens == 0 and seq.ends_prompt and seq.seq_id not in rows_from
            and self.qualifies(len(seq.token_ids)) and not per_head and not gapped
        )  # fmt: skip

    def run(
        self,
        token_ids: list[int],
        sink: LayerKVSink,
        positions: tuple[int, ...] = (),
        policy: KVPolicy | None = None,
    ) -> torch.Tensor | None:
        """Prefill ``token_ids`` (at ``positions``; (): their indices) over the group, handing each layer's KV
        (T, Hkv, D) to ``sink`` (the KV cache stores it), with the scores of a compressing ``policy``'s votes
        (``parallel/votes.py``); the last chunk's final hidden states, or None after a failure (run it
        locally)."""
        scheme = "tsp" if self.partition == "tsp" else "runahead"
        votes = policy.votes(len(token_ids), len(token_ids)) if policy is not None else None
        first, weights = votes if votes is not None else (0, torch.empty(0))
        try:
            with self.supervisor.held() as group:  # a failure loses the group: logged, restarted later
                job = ChunkJob(
                    scheme, tuple(token_ids), self.boundaries(len(token_ids)), tuple(positions),
                    vote_from=first, vote_weights=tuple(weights.tolist()), kv_quant=self.kv_quant,
                )  # fmt: skip
                hidden = group.prefill(job, sink)
        except ParallelPrefillError as exc:
            self.last_route = PrefillRoute(len(token_ids), 1, f"the parallel prefill failed: {exc}")
            return None
        self.last_route = PrefillRoute(len(token_ids), self.num_procs)
        return hidden

    def close(self) -> None:
        """Stop the supervisor and the group (workers, process group). Idempotent."""
        self.supervisor.close()

    def search(self, context_len: int, step: int = 16, repeats: int = 2) -> SearchResult:
        """KVR-S: the partition of ``context_len`` tokens with the lowest measured prefill time. Each candidate
        is timed ``repeats`` times and keeps its fastest run: on a shared host a single run can be off by 30%,
        enough to send the search down the wrong side."""
        ids = tuple(3 + i % 97 for i in range(context_len))  # timing depends on the length, not on the tokens
        step = max(1, min(step, context_len // (2 * self.num_procs)))  # a short context still has room to search

        def measure(partition: Partition) -> float:
            times = []
            for _ in range(repeats):
                with self.supervisor.held() as group:
                    start = time.perf_counter()
                    group.prefill(ChunkJob("runahead", ids, partition.boundaries))
                    times.append(time.perf_counter() - start)
            return min(times)

        result = search_partition(context_len, self.num_procs, measure, step=step, min_chunk=step)
        get_logger().info(
            "KV-Runahead partition for %d tokens: %s (%d prefills measured)",
            context_len, result.partition.boundaries, result.measurements,
        )  # fmt: skip
        return result
