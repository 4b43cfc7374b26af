"""Turns a ``SchedulerOutput`` into tensors, runs the model over the paged cache, returns logits.

The runner makes no decisions: it moves the blocks it is told to move, builds input ids,
explicit positions and attention metadata, and computes logits only for the rows that need them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.attention.compressed import CompressedAttentionMetadata, CompressedKVCache
from kvserve.attention.offloaded import OffloadAttentionMetadata, OffloadedKVCache
from kvserve.attention.paged import PagedAttentionMetadata, PagedKVCache
from kvserve.models.llama import LlamaForCausalLM
from kvserve.scheduler import ScheduledSequence, SchedulerOutput

if TYPE_CHECKING:  # parallel/ (torch.distributed) is imported only when an engine uses it
    from kvserve.parallel.prefill import ParallelPrefill


@dataclass
class RunnerOutput:
    logits: torch.Tensor | None = None  # (M, vocab) float32
    rows: dict[int, slice] = field(default_factory=dict)  # seq_id -> its rows in ``logits``
    group_slots: dict[int, list[int]] = field(default_factory=dict)  # per-layer groups: seq_id -> slots kept


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        host_cache: PagedKVCache | None,
        num_groups: int = 1,
        device: torch.device | str = "cpu",
        parallel_prefill: ParallelPrefill | None = None,
        layer_to_group: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.layer_to_group = layer_to_group  # () : every layer in group 0
        # Sliding-window layers' windows (() when the model has none), for the attention metadata.
        windows = model.config.layer_windows
        self.layer_windows = windows if any(w is not None for w in windows) else ()
        self.parallel_prefill = parallel_prefill
        self.cache = cache
        self.host_cache = host_cache
        self.num_groups = num_groups
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, rows_from: Mapping[int, int] | None = None) -> RunnerOutput:
        """Run one step. A sequence in ``rows_from`` gets logits for every row of its chunk from that index
        on (prompt logprobs); the others only for their last token, and only when they sample."""
        rows_from = rows_from or {}
        self._move_blocks(out)
        if not out.scheduled:
            return RunnerOutput()
        scheduled = out.scheduled
        input_ids = torch.tensor([t for s in scheduled for t in s.token_ids], dtype=torch.long)
        positions = torch.cat([_positions(s) for s in scheduled])
        if isinstance(self.cache, CompressedKVCache):
            return self._execute_compressed(out, input_ids, positions, rows_from)
        if isinstance(self.cache, OffloadedKVCache):
            metadata = OffloadAttentionMetadata(
                seq_ids=tuple(s.seq_id for s in scheduled),
                query_lens=tuple(len(s.token_ids) for s in scheduled),
                context_lens=tuple(s.num_computed_tokens for s in scheduled),
                block_tables=tuple(s.block_tables[0] for s in scheduled),
                full_lengths=tuple(max(s.full_length, s.num_computed_tokens + len(s.token_ids)) for s in scheduled),
                scored_from=tuple(
                    max(0, s.score_from - s.num_computed_tokens) if s.seq_id in rows_from else len(s.token_ids)
                    for s in scheduled
                ),
                block_size=self.cache.block_size,
            )
            hidden = self.model(input_ids.to(self.device), positions.to(self.device), self.cache, metadata)
            return self._logits(hidden, [len(s.token_ids) for s in scheduled], scheduled, rows_from)
        metadata = PagedAttentionMetadata.build_grouped(
            seq_ids=[s.seq_id for s in scheduled],
            query_lens=[len(s.token_ids) for s in scheduled],
            context_lens=[s.num_computed_tokens for s in scheduled],
            group_block_tables=[[s.block_tables[g] for s in scheduled] for g in range(self.num_groups)],
            block_size=self.cache.block_size,
            device=self.device,
            layer_to_group=self.layer_to_group,
            layer_windows=self.layer_windows,
        )
        if self._parallel_prefill_qualifies(out, rows_from):
            (seq,) = scheduled
            cache = self.cache
            hidden = self.parallel_prefill.run(
                seq.token_ids, metadata.slot_mappings[0],
                cache.k.view(cache.k.shape[0], -1, *cache.k.shape[3:]),
                cache.v.view(cache.v.shape[0], -1, *cache.v.shape[3:]),
            )  # fmt: skip
            if hidden is not None:  # the last chunk's rows: its last one is the prompt's last token
                return RunnerOutput(self.model.compute_logits(hidden[-1:]).cpu(), {seq.seq_id: slice(0, 1)})
        hidden = self.model(input_ids.to(self.device), positions.to(self.device), self.cache, metadata)  # (N, hidden)
        return self._logits(hidden, [len(s.token_ids) for s in scheduled], scheduled, rows_from)

    def _execute_compressed(
        self, out: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor, rows_from: Mapping[int, int]
    ) -> RunnerOutput:
        """A step over per-layer KV groups: the policies may drop rows, so logits rows follow what is left."""
        scheduled = out.scheduled
        metadata = CompressedAttentionMetadata(
            seq_ids=tuple(s.seq_id for s in scheduled),
            query_lens=tuple(len(s.token_ids) for s in scheduled),
            context_lens=tuple(s.num_computed_tokens for s in scheduled),
            policies=tuple(s.kv_policy for s in scheduled),
            group_slots=tuple(s.group_slots for s in scheduled),
            group_targets=tuple(s.group_targets for s in scheduled),
            block_tables=tuple(s.block_tables for s in scheduled),
            keep_all_rows=tuple(rows_from.get(s.seq_id, len(s.token_ids)) < len(s.token_ids) - 1 for s in scheduled),
            block_size=self.cache.block_size,
        )
        hidden = self.model(input_ids.to(self.device), positions.to(self.device), self.cache, metadata)  # (N', hidden)
        result = self._logits(hidden, metadata.final_rows, scheduled, rows_from)
        result.group_slots = {s.seq_id: held for s, held in zip(scheduled, metadata.state.held_after, strict=True)}
        return result

    def _logits(
        self, hidden: torch.Tensor, num_rows: list[int], scheduled: tuple, rows_from: Mapping[int, int]
    ) -> RunnerOutput:
        """Logits of the rows each sequence needs; ``num_rows`` are its rows in ``hidden`` (in order)."""
        wanted, rows, start = [], {}, 0
        for s, n in zip(scheduled, num_rows, strict=True):
            end = start + n
            if s.seq_id in rows_from:  # from that row of the chunk on (all kept: see keep_all_rows)
                chosen = range(max(start, end - (len(s.token_ids) - rows_from[s.seq_id])), end)
            elif s.samples:
                chosen = range(end - 1, end)
            else:
                chosen = range(0)
            rows[s.seq_id] = slice(len(wanted), len(wanted) + len(chosen))
            wanted.extend(chosen)
            start = end
        if not wanted:
            return RunnerOutput(rows=rows)
        index = torch.tensor(wanted, dtype=torch.long, device=self.device)
        return RunnerOutput(self.model.compute_logits(hidden.index_select(0, index)).cpu(), rows)

    def _parallel_prefill_qualifies(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> bool:
        """One sequence's whole prompt in this step, nothing cached, logits for its last token only."""
        if self.parallel_prefill is None or len(out.scheduled) != 1:
            return False
        seq = out.scheduled[0]
        return (
            seq.num_computed_tokens == 0 and seq.samples and seq.seq_id not in rows_from
            and self.parallel_prefill.qualifies(len(seq.token_ids))
        )  # fmt: skip

    def _move_blocks(self, out: SchedulerOutput) -> None:
        # Swap-outs first: the blocks they vacate may be handed out again in this very step.
        if out.blocks_to_swap_out:
            self.cache.swap_out(out.blocks_to_swap_out, self._host())
        if out.blocks_to_swap_in:
            self.cache.swap_in(out.blocks_to_swap_in, self._host())
        if out.blocks_to_copy:
            self.cache.copy_blocks(out.blocks_to_copy)
        if out.slots_to_copy:
            self.cache.copy_slots(out.slots_to_copy)

    def _host(self) -> PagedKVCache:
        if self.host_cache is None:
            raise RuntimeError("the scheduler asked for a swap but the engine has no host tier (swap_space=0)")
        return self.host_cache


def _positions(s: ScheduledSequence) -> torch.Tensor:
    """Explicit position ids (Prompt Cache), or the chunk's indices in its sequence."""
    if s.positions:
        return torch.tensor(s.positions, dtype=torch.long)
    return torch.arange(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids))
