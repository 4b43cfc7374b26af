"""Tensor-parallel serving: one scheduler in the engine's process (rank 0), workers that run the same steps.

The engine process keeps the scheduler, the KV manager, the Prompt Cache store and the sampler. Every rank
(the engine's included) holds its share of the weights (``models/sharding.py``) and a KV cache with the same
blocks for its own KV heads. Each step, rank 0 broadcasts the scheduler's plain-data ``SchedulerOutput``;
every rank runs it through its own ``ModelRunner`` (block moves, attention metadata, the model, which meets
in all-reduces: ``tensor_model.py``); only rank 0 computes logits and samples (SPMD, as in vLLM).

Two process groups: the default one (gloo on CPU, NCCL on CUDA) carries the all-reduces and has the step
timeout, so a rank that hangs fails the step within it; a gloo group carries the step messages, on which idle
workers wait without a time limit (rank 0's end of it has the step timeout). A rank that dies breaks its
connections: the step fails at once. A worker that fails, or a local one found dead by the watch thread,
loses the group for good: every later step and request is refused with the reason (``TensorParallelError``),
``/health`` answers 503, and the local workers are stopped (killed if they do not stop).

Launch: ``size`` ranks over ``nnodes`` machines, ``size / nnodes`` per machine. Rank 0 hosts the rendezvous
(``master_addr:master_port``; a free port on one machine). The engine's machine (node 0) starts its other
ranks as spawned processes; every other node runs ``run_node`` (``kvserve serve ... --node-rank K``), which
starts that node's ranks and waits for them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.errors import TensorParallelError
from kvserve.log import get_logger, stdout_to_stderr
from kvserve.models.sharding import TensorShard
from kvserve.parallel.group import check_no_world, stop_workers
from kvserve.parallel.tensor_model import CommStats, RankMean, parallelize
from kvserve.platform.heap import HeapTrimmer

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvserve.attention.backend import AttentionBackend
    from kvserve.config import EngineConfig
    from kvserve.core.step import SchedulerOutput

IDLE_TIMEOUT = timedelta(days=7)  # how long a worker waits for the next step
START_POLL_S = 0.2
WATCH_POLL_S = 0.5


@dataclass(frozen=True)
class Launch:
    """Where the ranks run: ``size`` over ``nnodes`` machines; this is machine ``node_rank``."""

    size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port, for one machine
    timeout_s: float = 60.0  # a step's collectives; a rank that hangs fails the step after this

    @classmethod
    def of(cls, config: EngineConfig) -> Launch:
        return cls(
            config.tensor_parallel_size, config.nnodes, config.node_rank, config.master_addr, config.master_port,
            config.tensor_parallel_timeout,
        )  # fmt: skip

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def local_ranks(self) -> range:
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)


@dataclass(frozen=True)
class _WorkerArgs:
    config: EngineConfig
    launch: Launch
    rank: int
    store_port: int
    threads: int


def threads_per_rank(launch: Launch) -> int:
    """This machine's cores shared by its ranks."""
    return max(1, (os.cpu_count() or 1) // launch.per_node)


class TensorParallelGroup:
    """Rank 0's end: constructing it spawns this machine's workers; load rank 0's shard meanwhile, then ``join``
    with it; ``run_step`` before each local step; ``close``."""

    def __init__(self, config: EngineConfig) -> None:
        check_no_world(TensorParallelError)
        self.launch = Launch.of(config)
        self.config = config
        self.size = self.launch.size
        self.shard = TensorShard(0, self.size)
        self.threads = threads_per_rank(self.launch)
        self.stats = CommStats()
        self.failure: str | None = None  # why the group was lost; it stays lost
        self.closed = False
        self._control: object | None = None
        self.store = dist.TCPStore(
            self.launch.master_addr if self.launch.nnodes > 1 else "127.0.0.1", self.launch.master_port,
            self.size, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False,
        )  # fmt: skip
        self.workers, self.status = _spawn(config, self.launch, self.store.port, self.threads, skip_rank=0)
        self._finalizer = weakref.finalize(self, stop_workers, self.workers, [])
        self._closing = threading.Event()

    def join(self, model: torch.nn.Module, cache: AttentionBackend, start_timeout_s: float = 300.0) -> None:
        """Wait for the local workers to load, then join the process groups with rank 0's ``model`` and ``cache``."""
        try:
            _wait_loaded(self.workers, self.status, start_timeout_s)
            # A timeout is each process's own: rank 0 gives up on a worker that does not take a step within the
            # step timeout, while idle workers wait for the next step as long as it takes.
            self._control = _join_world(
                self.config, self.launch, self.store, 0, model, cache, self.stats, self.launch.timeout_s
            )
        except Exception as exc:
            self.close()
            raise TensorParallelError(f"the tensor-parallel group did not start: {exc}") from exc
        threading.Thread(
            target=_watch, args=(weakref.ref(self), self._closing), name="kvserve-tp-watch", daemon=True
        ).start()
        get_logger().info(
            "tensor parallel: %d ranks over %d machine(s), %d here (this process + %d workers), %d threads each",
            self.size, self.launch.nnodes, self.launch.per_node, len(self.workers), self.threads,
        )  # fmt: skip

    def run_step(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> None:
        """Send the step to every worker (they run it while this rank does); refused once the group is lost."""
        self.check()
        try:
            dist.broadcast_object_list([(out, dict(rows_from))], src=0, group=self._control)
        except RuntimeError as exc:
            raise self.lose(f"sending a step to the workers failed: {exc}") from exc

    def check(self) -> None:
        """Raise ``TensorParallelError`` (closing the group) once it is lost or closed."""
        if self.failure is not None:
            raise self.lose(self.failure)
        if self.closed:
            raise TensorParallelError("the tensor-parallel group is closed")

    def lose(self, reason: str) -> TensorParallelError:
        """Record the loss (the first reason stays), stop the group; returns the error to raise."""
        if self.failure is None:
            self.failure = reason
            get_logger().error("tensor-parallel group lost: %s", reason)
        self.close()
        return TensorParallelError(f"the tensor-parallel group is lost: {self.failure}")

    def dead_workers(self) -> list[str]:
        return [f"{w.name} (exit code {w.exitcode})" for w in self.workers if not w.is_alive()]

    @property
    def workers_alive(self) -> int:
        return sum(w.is_alive() for w in self.workers)

    def close(self) -> None:
        """Tell the workers to stop (best effort), leave the process groups, stop (or kill) local workers."""
        if self.closed:
            return
        self.closed = True
        self._closing.set()
        if self.failure is None and self._control is not None:
            try:
                dist.broadcast_object_list([None], src=0, group=self._control)
            except RuntimeError:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
        self._finalizer()


def _join_world(
    config: EngineConfig,
    launch: Launch,
    store: dist.TCPStore,
    rank: int,
    model: torch.nn.Module,
    cache: AttentionBackend,
    stats: CommStats,
    control_timeout_s: float,
) -> object:
    """Join the default group (all-reduces, gloo or NCCL, the step timeout) and the gloo group of step messages
    (``control_timeout_s``); wrap ``model``'s row-parallel projections and give ``cache`` the score mean over the
    ranks. Returns the step-message group."""
    backend = "nccl" if torch.device(config.device).type == "cuda" else "gloo"
    timeout = timedelta(seconds=launch.timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=launch.size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s))
    parallelize(model, dist.group.WORLD, stats)
    cache.set_rank_mean(RankMean(dist.group.WORLD, launch.size, stats))
    return control


def _spawn(
    config: EngineConfig, launch: Launch, store_port: int, threads: int, skip_rank: int | None
) -> tuple[list[mp.Process], mp.Queue]:
    context = mp.get_context("spawn")
    status = context.Queue()
    workers = [
        context.Process(
            target=_worker_main,
            args=(_WorkerArgs(config, launch, rank, store_port, threads), status),
            name=f"kvserve-tp-{rank}",
            daemon=True,
        )  # fmt: skip
        for rank in launch.local_ranks
        if rank != skip_rank
    ]
    for worker in workers:
        worker.start()
    return workers, status


def _wait_loaded(workers: list[mp.Process], status: mp.Queue, timeout_s: float) -> None:
    """Until every local worker reports 'loaded'; one that fails or exits first, or a timeout, raises."""
    deadline = time.monotonic() + timeout_s
    loaded: set[str] = set()
    while len(loaded) < len(workers):
        try:
            kind, name, detail = status.get(timeout=START_POLL_S)
        except queue.Empty:
            dead = [w for w in workers if w.name not in loaded and not w.is_alive()]
            if dead:
                raise TensorParallelError(
                    f"tensor-parallel worker {dead[0].name} exited (code {dead[0].exitcode}) before loading the "
                    'model; a script that starts one needs `if __name__ == "__main__":` (workers are spawned)'
                ) from None
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not load within {timeout_s:g} s") from None
            continue
        if kind == "error":
            raise TensorParallelError(f"tensor-parallel worker {name} failed: {detail}")
        if kind == "loaded":
            loaded.add(name)


def _worker_main(args: _WorkerArgs, status: mp.Queue) -> None:
    """A worker's life: load its shard and build its cache, join the groups, run steps until told to stop."""
    name = f"kvserve-tp-{args.rank}"
    stdout_to_stderr()  # the engine's stdout carries the text `kvserve generate` streams
    get_logger().setLevel(logging.WARNING)  # the engine's process logs; a worker's lines would interleave
    try:
        torch.set_num_threads(args.threads)
        if torch.device(args.config.device).type == "cuda":  # one device per rank of this machine
            torch.cuda.set_device(args.rank - args.launch.local_ranks[0])
        runner = _worker_runner(args.config, TensorShard(args.rank, args.launch.size))
        status.put(("loaded", name, None))
        launch = args.launch
        store = dist.TCPStore(
            launch.master_addr, args.store_port, launch.size, is_master=False, timeout=timedelta(seconds=300)
        )
        control = _join_world(
            args.config, launch, store, args.rank, runner.model, runner.cache, CommStats(), IDLE_TIMEOUT.total_seconds()
        )
        _serve_steps(runner, control)
    except Exception as exc:  # the engine's collectives fail too; this names the cause in the worker's log
        status.put(("error", name, f"{type(exc).__name__}: {exc}"))
        get_logger().error("tensor-parallel worker %s failed: %s\n%s", name, exc, traceback.format_exc(limit=4))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_runner(config: EngineConfig, shard: TensorShard):  # noqa: ANN202 - kvserve.core.runner.ModelRunner
    from kvserve.core.kv_cache import make_kv_cache
    from kvserve.core.kv_plan import plan_kv
    from kvserve.core.runner import ModelRunner
    from kvserve.models.loader import load_model

    loaded = load_model(
        config.model, config.torch_dtype, config.device, weights=config.weights, tokenizer=config.tokenizer,
        shard=shard,
    )  # fmt: skip
    plan = plan_kv(config, loaded.config, loaded.dtype)  # the same plan, so the same blocks, as rank 0's
    return ModelRunner(loaded.model, make_kv_cache(config, plan, loaded), config.device, computes_logits=False)


def _serve_steps(runner: object, control: object) -> None:
    heap = HeapTrimmer()
    while True:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        if box[0] is None:
            return
        out, rows_from = box[0]
        runner.execute(out, rows_from)
        heap.maybe_trim()


def run_node(config: EngineConfig) -> int:
    """A machine other than the engine's (``node_rank`` > 0): start its ranks, wait until they end; their exit
    status (0 when the engine closed the group)."""
    launch = Launch.of(config)
    if launch.node_rank == 0:
        raise ValueError("node_rank 0 runs the engine; run_node is for the other machines")
    workers, status = _spawn(config, launch, launch.master_port, threads_per_rank(launch), skip_rank=None)
    get_logger().info(
        "tensor parallel: node %d of %d, ranks %d-%d, rendezvous at %s:%d",
        launch.node_rank, launch.nnodes, launch.local_ranks[0], launch.local_ranks[-1], launch.master_addr,
        launch.master_port,
    )  # fmt: skip
    try:
        for worker in workers:
            worker.join()
    finally:
        stop_workers(workers, [])
    failures = []
    while True:
        try:
            kind, name, detail = status.get_nowait()
        except queue.Empty:
            break
        if kind == "error":
            failures.append(f"{name}: {detail}")
    for failure in failures:
        get_logger().error("tensor-parallel worker %s", failure)
    return 1 if failures or any(w.exitcode for w in workers) else 0


def _watch(ref: weakref.ref[TensorParallelGroup], closing: threading.Event) -> None:
    """Mark the group lost as soon as a local worker is gone, also while the engine is idle (``/health``)."""
    while not closing.wait(WATCH_POLL_S):
        group = ref()
        if group is None:
            return
        dead = group.dead_workers()
        if dead and group.failure is None:
            group.failure = f"worker process(es) exited: {', '.join(dead)}"
            get_logger().error("tensor-parallel group lost: %s", group.failure)
        del group
