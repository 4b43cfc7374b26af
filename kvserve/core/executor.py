"""Where a step runs: the executor between the engine and the model runner (vLLM's ``Executor`` idea).

The engine hands every step to its executor; the runner runs it on one rank and knows nothing of parallelism.
``LocalExecutor`` runs steps in this process, routing a step whose one whole prompt the parallel prefill group
takes (KV-Runahead) there by tagging it (``SchedulerOutput.parallel_prefill``). ``TensorParallelExecutor`` sends
each step to the tensor-parallel workers before running rank 0's share, and turns any failure into a lost group.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kvserve.core.runner import ModelRunner, RunnerOutput
from kvserve.core.step import SchedulerOutput

if TYPE_CHECKING:  # parallel/ (torch.distributed) is imported only when an engine uses it
    from kvserve.parallel.prefill import ParallelPrefill
    from kvserve.parallel.tensor_group import TensorParallelGroup


class Executor(ABC):
    """Runs the engine's steps; ``runner`` is this process's runner (its cache, its model)."""

    runner: ModelRunner
    parallel_prefill: ParallelPrefill | None = None
    tensor_parallel: TensorParallelGroup | None = None

    @abstractmethod
    def execute_step(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> RunnerOutput:
        """Run step ``out``; ``rows_from`` as ``ModelRunner.execute`` takes it."""

    def check(self) -> None:
        """Raise when no step can run any more (a lost rank), so a request is refused at once."""
        return None  # a local executor can always run steps

    def health_error(self) -> str | None:
        """Why no step can run any more, or None while steps can."""
        return None

    def close(self) -> None:
        """Stop the processes this executor started; idempotent."""
        return None


class LocalExecutor(Executor):
    def __init__(self, runner: ModelRunner, parallel_prefill: ParallelPrefill | None = None) -> None:
        self.runner = runner
        self.parallel_prefill = parallel_prefill

    def execute_step(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> RunnerOutput:
        group = self.parallel_prefill
        if group is not None and group.takes(out, rows_from):
            return self.runner.execute(dataclasses.replace(out, parallel_prefill=True), rows_from, group.run)
        return self.runner.execute(out, rows_from)

    def close(self) -> None:
        if self.parallel_prefill is not None:
            self.parallel_prefill.close()


class TensorParallelExecutor(Executor):
    """Rank 0 of a tensor-parallel group; ``threads_before``: this process's torch threads before the group took
    its share of the cores, given back at ``close``."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup, threads_before: int) -> None:
        self.runner = runner
        self.tensor_parallel = group
        self._threads_before = threads_before
        self._closed = False

    def execute_step(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> RunnerOutput:
        self.tensor_parallel.run_step(out, rows_from)
        try:
            return self.runner.execute(out, rows_from)
        except Exception as exc:  # the workers ran (or wait in) this step: they are out of step with us now
            raise self.tensor_parallel.lose(f"a step failed on rank 0: {exc!r}") from exc

    def check(self) -> None:
        self.tensor_parallel.check()

    def health_error(self) -> str | None:
        if self.tensor_parallel.failure is not None:
            return f"the tensor-parallel group is lost: {self.tensor_parallel.failure}"
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.tensor_parallel.close()
        torch.set_num_threads(self._threads_before)
