"""Turns a ``SchedulerOutput`` into tensors, runs the model over the KV cache, returns logits and a step report.

The runner makes no decisions and knows no kind of cache: the cache moves the blocks it is told to
move and builds its own attention metadata (``attention/backend.py``); the runner builds input ids and
explicit positions, runs the model (or hands a whole prompt to parallel prefill when that takes it),
computes logits only for the rows that need them, and returns what the cache learned as a ``StepReport``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.attention.blend import recompute_modules
from kvserve.core.step import ScheduledSequence, SchedulerOutput, StepReport
from kvserve.models.llama import LlamaForCausalLM

if TYPE_CHECKING:  # parallel/ (torch.distributed) is imported only when an engine uses it
    from kvserve.parallel.prefill import ParallelPrefill
    from kvserve.parallel.tensor_group import TensorParallelGroup


@dataclass
class RunnerOutput:
    logits: torch.Tensor | None = None  # (M, vocab) float32
    rows: dict[int, slice] = field(default_factory=dict)  # seq_id -> its rows in ``logits``
    report: StepReport = field(default_factory=StepReport)  # for Scheduler.update


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: AttentionBackend,
        device: torch.device | str = "cpu",
        parallel_prefill: ParallelPrefill | None = None,
        tensor_parallel: TensorParallelGroup | None = None,
        computes_logits: bool = True,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.parallel_prefill = parallel_prefill
        self.tensor_parallel = tensor_parallel  # rank 0's group: each step goes to the workers first
        self.computes_logits = computes_logits  # False on a tensor-parallel worker: rank 0 samples

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, rows_from: Mapping[int, int] | None = None) -> RunnerOutput:
        """Run one step. A sequence in ``rows_from`` gets logits for every row of its chunk from that index
        on (prompt logprobs); the others only for their last token, and only when they sample."""
        rows_from = rows_from or {}
        if self.tensor_parallel is None:
            return self._execute(out, rows_from)
        self.tensor_parallel.run_step(out, rows_from)
        try:
            return self._execute(out, rows_from)
        except Exception as exc:  # the workers ran (or wait in) this step: they are out of step with us now
            raise self.tensor_parallel.lose(f"a step failed on rank 0: {exc!r}") from exc

    def _execute(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> RunnerOutput:
        self.cache.apply_moves(out)
        for job in out.recomputes:  # Prompt Cache selective recompute: the modules' KV before any query reads it
            recompute_modules(self.model, self.cache, job)
        if not out.scheduled:
            return RunnerOutput()
        scheduled = out.scheduled
        metadata = self.cache.build_metadata(out, rows_from)
        if self.parallel_prefill is not None and self.parallel_prefill.takes(out, rows_from):
            seq = scheduled[0]
            hidden = self._prefill_in_parallel(seq, metadata)
            if hidden is not None and not seq.samples:  # a module's encoding: its KV is all it leaves
                return RunnerOutput(rows={seq.seq_id: slice(0, 0)}, report=self.cache.report(metadata))
            if hidden is not None:  # the last chunk's rows: its last one is the prompt's last token
                logits = self.model.compute_logits(hidden[-1:]).cpu()
                return RunnerOutput(logits, {seq.seq_id: slice(0, 1)}, self.cache.report(metadata))
        input_ids = torch.tensor([t for s in scheduled for t in s.token_ids], dtype=torch.long)
        positions = torch.cat([_positions(s) for s in scheduled])
        hidden = self.model(input_ids.to(self.device), positions.to(self.device), self.cache, metadata)  # (N', hidden)
        report = self.cache.report(metadata)
        return self._logits(hidden, report, scheduled, rows_from)

    def _prefill_in_parallel(self, seq: ScheduledSequence, metadata: AttentionMetadata) -> torch.Tensor | None:
        """The whole prompt over the prefill group, each layer's KV stored by the cache; None after a failure."""

        def sink(layer: int, k: torch.Tensor, v: torch.Tensor, scores: torch.Tensor | None) -> None:
            self.cache.store_layer(layer, k, v, metadata, scores)

        return self.parallel_prefill.run(list(seq.token_ids), sink, seq.positions, seq.kv_policy)

    def _logits(
        self, hidden: torch.Tensor, report: StepReport, scheduled: tuple, rows_from: Mapping[int, int]
    ) -> RunnerOutput:
        """Logits of the rows each sequence needs; ``report.output_rows`` are its rows in ``hidden`` (in order)."""
        wanted, rows, start = [], {}, 0
        for s, n in zip(scheduled, report.output_rows, strict=True):
            end = start + n
            if s.seq_id in rows_from:  # from that row of the chunk on (a cache keeps all of them)
                chosen = range(max(start, end - (len(s.token_ids) - rows_from[s.seq_id])), end)
            elif s.samples:
                chosen = range(end - 1, end)
            else:
                chosen = range(0)
            rows[s.seq_id] = slice(len(wanted), len(wanted) + len(chosen))
            wanted.extend(chosen)
            start = end
        if not wanted or not self.computes_logits:
            return RunnerOutput(rows=rows, report=report)
        index = torch.tensor(wanted, dtype=torch.long, device=self.device)
        return RunnerOutput(self.model.compute_logits(hidden.index_select(0, index)).cpu(), rows, report)


def _positions(s: ScheduledSequence) -> torch.Tensor:
    """Explicit position ids (Prompt Cache), or the chunk's indices in its sequence."""
    if s.positions:
        return torch.tensor(s.positions, dtype=torch.long)
    return torch.arange(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids))
