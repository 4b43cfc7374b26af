"""Turns a ``SchedulerOutput`` into tensors, runs the model over the KV cache, returns logits and a step report.

The runner makes no decisions and knows no kind of cache: the cache moves the blocks it is told to
move and builds its own attention metadata (``attention/backend.py``); the runner builds input ids and
explicit positions, runs the model, computes logits only for the rows that need them, and returns what the
cache learned as a ``StepReport``. It runs a step on one rank and knows nothing of parallelism: it dispatches
on the step's content (block moves, ``recomputes``, a step tagged ``parallel_prefill`` whose whole prompt the
executor's prefill function computes in other processes); the executor (``core/executor.py``) decides where
steps run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, LayerKVSink
from kvserve.attention.blend import recompute_modules
from kvserve.core.step import ScheduledSequence, SchedulerOutput, StepReport
from kvserve.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from kvserve.policies import KVPolicy

# Prefills a whole prompt in other processes (``ParallelPrefill.run``): (token ids, a sink that stores each layer's
# KV, positions, the sequence's policy) -> the last chunk's hidden states, or None to run the prompt here instead.
WholePromptPrefill = Callable[[list[int], LayerKVSink, tuple[int, ...], "KVPolicy | None"], "torch.Tensor | None"]


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
        computes_logits: bool = True,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.computes_logits = computes_logits  # False on a tensor-parallel worker: rank 0 samples

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        rows_from: Mapping[int, int] | None = None,
        prefill_elsewhere: WholePromptPrefill | None = None,
    ) -> RunnerOutput:
        """Run one step. A sequence in ``rows_from`` gets logits for every row of its chunk from that index
        on (prompt logprobs); the others only for their last token, and only when they sample. The one whole
        prompt of a step tagged ``parallel_prefill`` goes to ``prefill_elsewhere`` (and runs here if that fails)."""
        rows_from = rows_from or {}
        self.cache.apply_moves(out)
        for job in out.recomputes:  # Prompt Cache selective recompute: the modules' KV before any query reads it
            recompute_modules(self.model, self.cache, job)
        if not out.scheduled:
            return RunnerOutput()
        scheduled = out.scheduled
        metadata = self.cache.build_metadata(out, rows_from)
        if out.parallel_prefill:
            seq = scheduled[0]
            hidden = self._prefill_elsewhere(prefill_elsewhere, seq, metadata)
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

    def _prefill_elsewhere(
        self, prefill: WholePromptPrefill, seq: ScheduledSequence, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """The whole prompt prefilled elsewhere, each layer's KV stored by the cache; None after a failure."""

        def sink(layer: int, k: torch.Tensor, v: torch.Tensor, scores: torch.Tensor | None) -> None:
            self.cache.store_layer(layer, k, v, metadata, scores)

        return prefill(list(seq.token_ids), sink, seq.positions, seq.kv_policy)

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
