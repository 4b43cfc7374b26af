"""Prefill workers joined torchrun-style, e.g. on other machines: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` in the environment of every process.

Ranks 0 .. WORLD_SIZE - 2 run ``kvserve prefill-worker --model ...``; the engine is the last rank, started
with ``RANK = WORLD_SIZE - 1`` and ``--prefill-parallel WORLD_SIZE``. Jobs go out as a broadcast from the
engine's rank, on which idle workers wait (hence the long group timeout); each KV message has its own
timeout, so a worker that dies or hangs mid-prefill still fails the prefill quickly. There is no status
channel: once the engine has received every layer's KV (or finished the last all-gather) the earlier
ranks are done with this prompt.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from kvserve.attention.backend import LayerKVSink
from kvserve.errors import ParallelPrefillError
from kvserve.log import get_logger
from kvserve.models.llama import LlamaForCausalLM
from kvserve.parallel.chunk_forward import run_chunk
from kvserve.parallel.chunks import ChunkJob

ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
IDLE_TIMEOUT = timedelta(days=7)  # how long a worker waits for the next prompt


def joined_from_env() -> bool:
    """True when this process was started with torchrun-style variables (the engine then joins them)."""
    return all(name in os.environ for name in ENV_VARS)


def _env_rank() -> tuple[int, int]:
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as exc:
        raise ParallelPrefillError(f"torchrun-style variables {ENV_VARS} are missing or not integers: {exc}") from exc


class RemotePrefillGroup:
    """The engine's end of a group of ``kvserve prefill-worker`` processes; it is the last rank."""

    def __init__(self, model: LlamaForCausalLM, num_procs: int, timeout_s: float = 60.0) -> None:
        rank, world_size = _env_rank()
        if world_size != num_procs or rank != world_size - 1:
            raise ParallelPrefillError(
                f"the engine must be the last rank of the group: prefill_parallel={num_procs} needs WORLD_SIZE="
                f"{num_procs} and RANK={num_procs - 1}, got WORLD_SIZE={world_size} RANK={rank}"
            )
        if dist.is_initialized():
            raise ParallelPrefillError("torch.distributed is already initialised here: one prefill group per process")
        self.model, self.num_procs, self.rank, self.timeout_s = model, num_procs, rank, timeout_s
        self.threads = torch.get_num_threads()  # the other ranks have machines (or cores) of their own
        self.workers: list = []  # not ours to start or stop
        self.closed = False
        dist.init_process_group("gloo", init_method="env://", timeout=IDLE_TIMEOUT)
        get_logger().info(
            "parallel prefill: joined %s:%s as rank %d of %d",
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], rank, world_size,
        )  # fmt: skip

    def prefill(self, job: ChunkJob, sink: LayerKVSink | None = None) -> torch.Tensor:
        if self.closed:
            raise ParallelPrefillError("the prefill group is closed")
        if job.world_size != self.num_procs:
            raise ValueError(f"the job has {job.world_size} chunks, the group {self.num_procs} processes")
        try:
            dist.broadcast_object_list([job], src=self.rank)
            return run_chunk(self.model, job, self.rank, self.timeout_s, sink)
        except (ParallelPrefillError, RuntimeError) as exc:
            self.close()
            raise ParallelPrefillError(f"parallel prefill over the joined group failed: {exc}") from exc

    def close(self) -> None:
        """Tell the workers to exit (best effort: some may be gone) and leave the group."""
        if self.closed:
            return
        self.closed = True
        try:
            dist.broadcast_object_list([None], src=self.rank)
        except RuntimeError:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def serve_worker(model: LlamaForCausalLM, timeout_s: float = 60.0) -> int:
    """``kvserve prefill-worker``: join the group from the environment and run chunks until told to stop."""
    rank, world_size = _env_rank()
    if rank >= world_size - 1:
        raise ParallelPrefillError(f"RANK={rank}: the last rank (WORLD_SIZE - 1 = {world_size - 1}) is the engine")
    dist.init_process_group("gloo", init_method="env://", timeout=IDLE_TIMEOUT)
    get_logger().info("prefill worker: rank %d of %d, waiting for prompts", rank, world_size)
    try:
        while True:
            box: list[ChunkJob | None] = [None]
            dist.broadcast_object_list(box, src=world_size - 1)
            if box[0] is None:
                return 0
            run_chunk(model, box[0], rank, timeout_s)
    finally:
        dist.destroy_process_group()
