"""A group of prefill processes on one machine: kvserve's own process is the last rank, p - 1 workers the rest.

Workers are real processes (``spawn``) joined with this process in a torch.distributed group on
loopback (gloo; NCCL on CUDA). Each loads the model itself, with its share of the CPU threads. Jobs
(scheme, token ids, chunk boundaries) reach the workers over multiprocessing queues, so an idle group
holds no collective that could time out; tensors travel over torch.distributed. The last rank computes
the last chunk and ends with the whole prompt's KV, which its sink writes into the engine's cache.

Failures: every wait on a peer has a timeout; a worker that raises reports the error on the status
queue; a dead worker breaks its connections. Each becomes a ``ParallelPrefillError`` in this process,
after which the group is closed (workers stopped, killed if they do not stop) and unusable.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.errors import ParallelPrefillError
from kvserve.log import get_logger
from kvserve.models.llama import LlamaForCausalLM
from kvserve.parallel.chunks import ChunkJob, KVSink, run_chunk


@dataclass(frozen=True)
class WorkerModel:
    """How a worker loads the same model as the engine."""

    path: str | None  # None: the default model
    dtype: str  # "float32" or "bfloat16", already resolved
    weights: str


class PrefillGroup:
    """``num_procs`` ranks; this process is rank ``num_procs - 1``. Use ``prefill`` per prompt, then ``close``."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        worker_model: WorkerModel,
        num_procs: int,
        threads_per_proc: int | None = None,
        timeout_s: float = 60.0,
        start_timeout_s: float = 300.0,
    ) -> None:
        if num_procs < 2:
            raise ValueError(f"a prefill group needs at least 2 processes, got {num_procs}")
        if dist.is_initialized():
            raise ParallelPrefillError("torch.distributed is already initialised here: one prefill group per process")
        self.model = model
        self.num_procs = num_procs
        self.rank = num_procs - 1
        self.threads = threads_per_proc or max(1, (os.cpu_count() or 1) // num_procs)
        self.timeout_s = timeout_s
        self.closed = False
        context = mp.get_context("spawn")
        self.jobs = [context.Queue() for _ in range(num_procs - 1)]
        self.status = context.Queue()
        address = f"tcp://127.0.0.1:{_free_port()}"
        self.workers = [
            context.Process(
                target=_worker_main,
                args=(rank, num_procs, address, worker_model, self.threads, timeout_s, self.jobs[rank], self.status),
                name=f"kvserve-prefill-{rank}",
                daemon=True,  # never outlives kvserve, even if close() is skipped
            )
            for rank in range(num_procs - 1)
        ]
        for worker in self.workers:
            worker.start()
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, self.jobs)
        try:
            dist.init_process_group(
                "gloo", init_method=address, rank=self.rank, world_size=num_procs,
                timeout=timedelta(seconds=start_timeout_s),
            )  # fmt: skip
            self._collect("ready", start_timeout_s)
        except Exception as exc:
            self.close()
            raise ParallelPrefillError(f"the prefill group did not start: {exc}") from exc
        get_logger().info("parallel prefill: %d processes (this one + %d workers), %d threads each",
                          num_procs, num_procs - 1, self.threads)  # fmt: skip

    def prefill(self, job: ChunkJob, sink: KVSink | None = None) -> torch.Tensor:
        """Run ``job`` over the group; returns this (last) rank's final hidden states for the last chunk."""
        if self.closed:
            raise ParallelPrefillError("the prefill group is closed")
        if job.world_size != self.num_procs:
            raise ValueError(f"the job has {job.world_size} chunks, the group {self.num_procs} processes")
        dead = [w.name for w in self.workers if not w.is_alive()]
        if dead:
            self.close()
            raise ParallelPrefillError(f"prefill worker(s) {dead} exited")
        for jobs in self.jobs:
            jobs.put(job)
        saved_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # share the cores with the workers during the prefill
        try:
            hidden = run_chunk(self.model, job, self.rank, self.timeout_s, sink)
            self._collect("done", self.timeout_s)  # workers finished: their sends are complete
        except ParallelPrefillError:
            self.close()
            raise
        finally:
            torch.set_num_threads(saved_threads)
        return hidden

    def close(self) -> None:
        """Stop the workers (killing any that do not stop in time) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _collect(self, expected: str, timeout_s: float) -> None:
        """One ``expected`` message per worker, or the first error / a timeout as ParallelPrefillError."""
        pending = set(range(self.num_procs - 1))
        while pending:
            try:
                kind, rank, detail = self.status.get(timeout=timeout_s)
            except queue.Empty:
                alive = [r for r in pending if self.workers[r].is_alive()]
                raise ParallelPrefillError(
                    f"prefill workers {sorted(pending)} did not report '{expected}' within {timeout_s:g} s "
                    f"(alive: {alive})"
                ) from None
            if kind == "error":
                raise ParallelPrefillError(f"prefill worker {rank} failed: {detail}")
            if kind == expected:
                pending.discard(rank)


def _worker_main(
    rank: int,
    world_size: int,
    address: str,
    worker_model: WorkerModel,
    threads: int,
    timeout_s: float,
    jobs: mp.Queue,
    status: mp.Queue,
) -> None:
    """A worker's life: load the model, join the group, run chunk jobs until told to stop (None)."""
    try:
        torch.set_num_threads(threads)
        from kvserve.models.dtype import DTYPES
        from kvserve.models.loader import load_model

        loaded = load_model(worker_model.path, DTYPES[worker_model.dtype], weights=worker_model.weights)
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size)
        status.put(("ready", rank, None))
        while (job := jobs.get()) is not None:
            run_chunk(loaded.model, job, rank, timeout_s)
            status.put(("done", rank, None))
    except Exception as exc:  # reported to the engine, which fails the prefill and closes the group
        status.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop_workers(workers: list[mp.Process], jobs: list[mp.Queue], grace_s: float = 5.0) -> None:
    for q in jobs:
        try:
            q.put(None)
        except (OSError, ValueError):  # queue already closed
            pass
    for worker in workers:
        worker.join(timeout=grace_s)
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=grace_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
