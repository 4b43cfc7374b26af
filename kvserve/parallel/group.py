"""A group of prefill processes on one machine: kvserve's own process is the last rank, p - 1 workers the rest.

Workers are real processes (``spawn``) joined with this process in a torch.distributed group on
loopback (gloo; NCCL on CUDA). Each loads the model itself, with its share of the CPU threads. Jobs
(scheme, token ids, chunk boundaries) reach the workers over multiprocessing queues, so an idle group
holds no collective that could time out; tensors travel over torch.distributed. The last rank computes
the last chunk and ends with the whole prompt's KV, which its sink writes into the engine's cache.

Start-up: this process hosts the rendezvous store on a port the system picks (a fresh one per group), and
waits for every worker to report that it has loaded the model, polling the processes meanwhile, so one
that exits early (typically a script without ``if __name__ == "__main__":``, which ``spawn`` re-runs in
the worker) is an error within a second or so instead of a rendezvous time-out. Only then do the ranks
join the process group.

Failures: every wait on a peer has a timeout; a worker that raises reports the error on the status
queue; a dead worker breaks its connections, and the wait for the workers' reports looks at their
processes every ``START_POLL_S``. Each becomes a ``ParallelPrefillError`` in this process, after which
the group is closed (workers stopped, killed if they do not stop; process group destroyed) and
unusable; ``supervisor.py`` starts a new one. A group dropped without ``close()`` is released when it
is collected, so another can start in the same process.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.attention.backend import LayerKVSink
from kvserve.errors import ParallelPrefillError
from kvserve.log import get_logger, stdout_to_stderr
from kvserve.models.llama import LlamaForCausalLM
from kvserve.parallel.chunk_forward import run_chunk
from kvserve.parallel.chunks import ChunkJob
from kvserve.platform.heap import HeapTrimmer

START_POLL_S = 0.2  # how often start-up looks at the worker processes
MAIN_GUARD_ADVICE = (
    "worker processes are started with 'spawn', which runs the main module again in each worker: put the "
    'code that creates LLM(prefill_parallel=...) or LLMEngine under `if __name__ == "__main__":` in your '
    "script (the worker's own error is printed above)"
)


@dataclass(frozen=True)
class WorkerModel:
    """How a worker loads the same model as the engine."""

    path: str | None  # None: the default model
    dtype: str  # "float32" or "bfloat16", already resolved
    weights: str


class PrefillGroup:
    """``num_procs`` ranks; this process is rank ``num_procs - 1``. Use ``prefill`` per prompt, then ``close``.

    ``cancel`` (set from another thread) stops a start-up that is still waiting for the workers.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        worker_model: WorkerModel,
        num_procs: int,
        threads_per_proc: int | None = None,
        timeout_s: float = 60.0,
        start_timeout_s: float = 300.0,
        cancel: threading.Event | None = None,
    ) -> None:
        if num_procs < 2:
            raise ValueError(f"a prefill group needs at least 2 processes, got {num_procs}")
        check_no_world(ParallelPrefillError)
        self.model = model
        self.num_procs = num_procs
        self.rank = num_procs - 1
        self.threads = threads_per_proc or max(1, (os.cpu_count() or 1) // num_procs)
        self.timeout_s = timeout_s
        self.closed = False
        self.model_path = worker_model.path
        # Port 0: the system picks a free port for this group's store, so groups never collide.
        self.store = dist.TCPStore(
            "127.0.0.1", 0, num_procs, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self._spawn(worker_model)
        self._groups: list[object] = []  # the process group once joined, for the finalizer to destroy
        self._finalizer = weakref.finalize(self, _release, self.workers, self.jobs, self._groups)
        try:
            self._wait_loaded(start_timeout_s, cancel)
            dist.init_process_group(
                "gloo", store=self.store, rank=self.rank, world_size=num_procs, timeout=timedelta(seconds=timeout_s)
            )
            self._groups.append(dist.group.WORLD)
        except Exception as exc:
            self.close()
            raise ParallelPrefillError(f"the prefill group did not start: {exc}") from exc
        get_logger().info("parallel prefill: %d processes (this one + %d workers), %d threads each",
                          num_procs, num_procs - 1, self.threads)  # fmt: skip

    def _spawn(self, worker_model: WorkerModel) -> None:
        context = mp.get_context("spawn")
        self.jobs = [context.Queue() for _ in range(self.num_procs - 1)]
        self.status = context.Queue()
        shared = (self.num_procs, self.store.port, worker_model, self.threads, self.timeout_s)
        self.workers = [
            context.Process(
                target=_worker_main,
                args=(rank, *shared, self.jobs[rank], self.status),
                name=f"kvserve-prefill-{rank}",
                daemon=True,  # never outlives kvserve, even if close() is skipped
            )
            for rank in range(self.num_procs - 1)
        ]
        for worker in self.workers:
            worker.start()

    def _wait_loaded(self, timeout_s: float, cancel: threading.Event | None) -> None:
        """Until every worker reports 'loaded'; a worker that exits or fails first, a timeout or ``cancel`` raises."""
        deadline = time.monotonic() + timeout_s
        started: set[int] = set()
        loaded: set[int] = set()
        while len(loaded) < len(self.workers):
            try:
                kind, rank, detail = self.status.get(timeout=START_POLL_S)
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    raise ParallelPrefillError("start-up cancelled (the engine is closing)") from None
                if time.monotonic() > deadline:
                    raise ParallelPrefillError(
                        f"prefill workers {sorted(set(range(len(self.workers))) - loaded)} did not load the model "
                        f"within {timeout_s:g} s"
                    ) from None
                self._check_starting(started, loaded)
                continue
            if kind == "error":
                raise ParallelPrefillError(f"prefill worker {rank} failed: {detail}")
            (started if kind == "started" else loaded).add(rank)

    def _check_starting(self, started: set[int], loaded: set[int]) -> None:
        """Raise, saying what to do, if a worker that has not loaded the model has exited."""
        dead = [r for r, w in enumerate(self.workers) if r not in loaded and not w.is_alive()]
        if not dead:
            return
        while True:  # a dead worker's last messages are already in the pipe: read them before judging
            try:
                kind, rank, detail = self.status.get_nowait()
            except queue.Empty:
                break
            if kind == "error":
                raise ParallelPrefillError(f"prefill worker {rank} failed: {detail}")
            (started if kind == "started" else loaded).add(rank)
        rank = dead[0]
        code = self.workers[rank].exitcode
        if rank not in started:  # it never reached its own code: importing the main module failed
            raise ParallelPrefillError(f"prefill worker {rank} exited (code {code}) on start-up: {MAIN_GUARD_ADVICE}")
        if rank not in loaded:
            raise ParallelPrefillError(
                f"prefill worker {rank} exited (code {code}) while loading the model "
                f"({self.model_path or 'the default model'}); a negative code is the signal that ended it"
            )

    def prefill(self, job: ChunkJob, sink: LayerKVSink | None = None) -> torch.Tensor:
        """Run ``job`` over the group; returns this (last) rank's final hidden states for the last chunk."""
        if self.closed:
            raise ParallelPrefillError("the prefill group is closed")
        if job.world_size != self.num_procs:
            raise ValueError(f"the job has {job.world_size} chunks, the group {self.num_procs} processes")
        dead = self.dead_workers()
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

    def dead_workers(self) -> list[str]:
        return [w.name for w in self.workers if not w.is_alive()]

    def close(self) -> None:
        """Stop the workers (killing any that do not stop in time), destroy the process group, free the port."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()
        self.store = None

    def _collect(self, expected: str, timeout_s: float) -> None:
        """One ``expected`` message per worker, or the first error / a timeout as ParallelPrefillError. The worker
        processes are looked at every ``START_POLL_S`` meanwhile: one that died (after its sends, say) is an error
        within a second, not at the timeout."""
        pending = set(range(self.num_procs - 1))
        deadline = time.monotonic() + timeout_s
        while pending:
            try:
                kind, rank, detail = self.status.get(timeout=max(0.0, min(START_POLL_S, deadline - time.monotonic())))
            except queue.Empty:
                dead = sorted(r for r in pending if not self.workers[r].is_alive())
                if dead:
                    codes = ", ".join(f"{r}: exit code {self.workers[r].exitcode}" for r in dead)
                    raise ParallelPrefillError(
                        f"prefill worker(s) exited before reporting '{expected}' ({codes})"
                    ) from None
                if time.monotonic() < deadline:
                    continue
                raise ParallelPrefillError(
                    f"prefill workers {sorted(pending)} did not report '{expected}' within {timeout_s:g} s (alive)"
                ) from None
            if kind == "error":
                raise ParallelPrefillError(f"prefill worker {rank} failed: {detail}")
            if kind == expected:
                pending.discard(rank)


def _worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    worker_model: WorkerModel,
    threads: int,
    timeout_s: float,
    jobs: mp.Queue,
    status: mp.Queue,
) -> None:
    """A worker's life: load the model, join the group, run chunk jobs until told to stop (None)."""
    stdout_to_stderr()  # the engine's stdout carries the text `kvserve generate` streams
    status.put(("started", rank, None))  # past the main module's import: the engine can tell the two apart
    # The engine's process logs the load; a worker's own INFO lines (a group restarting mid-generation)
    # would land inside the text `kvserve generate` streams.
    get_logger().setLevel(logging.WARNING)
    try:
        torch.set_num_threads(threads)
        from kvserve.models.dtype import DTYPES
        from kvserve.models.loader import load_model

        loaded = load_model(worker_model.path, DTYPES[worker_model.dtype], weights=worker_model.weights)
        status.put(("loaded", rank, None))
        store = dist.TCPStore("127.0.0.1", store_port, world_size, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        heap = HeapTrimmer()  # chunk activations differ in shape with every prompt
        while (job := jobs.get()) is not None:
            run_chunk(loaded.model, job, rank, timeout_s)
            status.put(("done", rank, None))
            heap.maybe_trim()
    except Exception as exc:  # reported to the engine, which fails the prefill and closes the group
        status.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_no_world(error: type[Exception]) -> None:
    """One torch.distributed world per process (a prefill or a tensor-parallel group): raise ``error`` for a second,
    after letting a dropped engine's group be collected."""
    if dist.is_initialized():
        gc.collect()  # an engine dropped without close() (in a reference cycle) releases its group here
    if dist.is_initialized():
        raise error(
            "torch.distributed is already initialised in this process (another engine's parallel prefill or "
            "tensor-parallel group): close that engine first (llm.close(), or `with LLM(...) as llm:`)"
        )


def _release(workers: list[mp.Process], jobs: list[mp.Queue], groups: list[object]) -> None:
    """Destroy the process group this group joined (if it is still the one) and stop the workers."""
    for pg in groups:
        if dist.is_initialized() and dist.group.WORLD is pg:
            dist.destroy_process_group()
    groups.clear()
    stop_workers(workers, jobs)


def stop_workers(workers: list[mp.Process], jobs: list[mp.Queue], grace_s: float = 5.0) -> None:
    """Send each job queue its stop (None), then join every worker, killing one that does not exit in time."""
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
