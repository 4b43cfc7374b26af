"""Turns a ``SchedulerOutput`` into tensors, runs the model over the paged cache, returns logits.

The runner makes no decisions: it moves the blocks it is told to move, builds input ids,
explicit positions and attention metadata, and computes logits only for the rows that need them.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field

import torch

from kvserve.attention.paged import PagedAttentionMetadata, PagedKVCache
from kvserve.models.llama import LlamaForCausalLM
from kvserve.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    logits: torch.Tensor | None = None  # (M, vocab) float32
    rows: dict[int, slice] = field(default_factory=dict)  # seq_id -> its rows in ``logits``


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        host_cache: PagedKVCache | None,
        num_groups: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.cache = cache
        self.host_cache = host_cache
        self.num_groups = num_groups
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, all_rows: Set[int] = frozenset()) -> RunnerOutput:
        """Run one step. Sequences in ``all_rows`` get logits for every token of their chunk (prompt
        logprobs); the others only for their last token, and only when they sample."""
        self._move_blocks(out)
        if not out.scheduled:
            return RunnerOutput()
        scheduled = out.scheduled
        input_ids = torch.tensor([t for s in scheduled for t in s.token_ids], dtype=torch.long)
        positions = torch.cat(
            [torch.arange(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)) for s in scheduled]
        )
        metadata = PagedAttentionMetadata.build_grouped(
            seq_ids=[s.seq_id for s in scheduled],
            query_lens=[len(s.token_ids) for s in scheduled],
            context_lens=[s.num_computed_tokens for s in scheduled],
            group_block_tables=[[s.block_tables[g] for s in scheduled] for g in range(self.num_groups)],
            block_size=self.cache.block_size,
            device=self.device,
        )
        hidden = self.model(input_ids.to(self.device), positions.to(self.device), self.cache, metadata)  # (N, hidden)
        wanted, rows, start = [], {}, 0
        for s in scheduled:
            end = start + len(s.token_ids)
            if s.seq_id in all_rows:
                chosen = range(start, end)
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

    def _move_blocks(self, out: SchedulerOutput) -> None:
        # Swap-outs first: the blocks they vacate may be handed out again in this very step.
        if out.blocks_to_swap_out:
            self.cache.swap_out(out.blocks_to_swap_out, self._host())
        if out.blocks_to_swap_in:
            self.cache.swap_in(out.blocks_to_swap_in, self._host())
        if out.blocks_to_copy:
            self.cache.copy_blocks(out.blocks_to_copy)

    def _host(self) -> PagedKVCache:
        if self.host_cache is None:
            raise RuntimeError("the scheduler asked for a swap but the engine has no host tier (swap_space=0)")
        return self.host_cache
