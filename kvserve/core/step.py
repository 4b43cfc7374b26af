"""The step contract: what the scheduler emits, what the executor and runner run, what a step reports back.

Plain data, imported by the scheduler, the executor, the runner and every KV cache, so that none of them imports
another for it. A step flows as::

    Scheduler.schedule() -> SchedulerOutput -> Executor.execute_step -> ModelRunner -> AttentionBackend
    Scheduler.update(StepReport) <--------------------------------------------------------'

The work in a step is tagged by its content: ``ScheduledSequence``s run through the model, ``ModuleRecompute``s
(Prompt Cache selective recompute) run before them, and a ``SchedulerOutput.parallel_prefill`` step hands one
whole prompt to the parallel prefill group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.policies.base import KVPolicy


@dataclass(frozen=True)
class ScheduledSequence:
    request_id: str
    seq_id: int
    token_ids: tuple[int, ...]  # the tokens computed this step
    num_computed_tokens: int  # tokens already in the cache before this step
    block_tables: tuple[tuple[int, ...], ...]  # one per KV group
    samples: bool  # this chunk reaches the sequence's last token, so its logits are sampled
    ends_prompt: bool = False  # this chunk reaches the prompt's last token (a module's encoding too)
    # Per-layer groups only: the policy, the slots each group holds before the step and keeps after it.
    kv_policy: KVPolicy | None = None
    group_slots: tuple[int, ...] = ()
    group_targets: tuple[int, ...] = ()
    group_frozen: tuple[int, ...] = ()  # [layer] leading slots in shared module blocks (Prompt Cache): kept as is
    group_heads: tuple[tuple[int, ...], ...] = ()  # [layer] tokens per KV head packed (Ada-KV), () per layer if none
    positions: tuple[int, ...] = ()  # position ids of token_ids; empty: num_computed_tokens onwards
    full_length: int = 0  # prompt + max_tokens: the KV the sequence may reach (an offloaded pool's limit scales it)
    score_from: int = 0  # the request's first scored token (Request.score_from; the eval tools set it)
    # With ``SchedulerConfig.positioned_windows``: the position of every slot up to the step's last token, for a
    # sequence whose positions are not its slot indices (Prompt Cache); empty otherwise.
    key_positions: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModuleRecompute:
    """Selective recompute of a Prompt Cache prompt's imported tokens (``attention/blend.py``), run after the
    step's moves and before its forward: ``count`` of the ``candidates`` whose KV deviates most once the modules
    attend to each other are recomputed, into slots of the sequence's own blocks."""

    seq_id: int
    token_ids: tuple[int, ...]  # the imported module tokens, in sequence order
    positions: tuple[int, ...]  # their position ids (schema positions, gaps allowed)
    slots: tuple[int, ...]  # their cache slots
    candidates: tuple[int, ...]  # indices into the above that may be recomputed (their slots are the sequence's own)
    count: int  # how many candidates to recompute (all of them: no selection pass)
    # The candidates whose layer-1 KV can deviate: the selection pass runs only them when they are at least
    # ``count`` (the others' deviation is zero). () : every candidate.
    probe: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...] = ()
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()  # (device block, host block)
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()  # (host block, device block)
    blocks_to_copy: tuple[tuple[int, int], ...] = ()  # copy-on-write (src, dst) device blocks
    slots_to_copy: tuple[tuple[int, int], ...] = ()  # Prompt Cache module tails: (src, dst) device slots
    recomputes: tuple[ModuleRecompute, ...] = ()  # Prompt Cache selective recompute, after the moves
    preempted: tuple[str, ...] = ()  # request ids preempted this step
    rejected: tuple[str, ...] = ()  # request ids that can never fit in the KV cache
    # The executor routed the step's one whole prompt to the parallel prefill group (KV-Runahead).
    parallel_prefill: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def empty(self) -> bool:
        moves = self.blocks_to_swap_out or self.blocks_to_swap_in or self.slots_to_copy
        return not (self.scheduled or moves or self.recomputes)


@dataclass(frozen=True)
class StepReport:
    """What a step learned that the scheduler applies (``Scheduler.update``), as plain data.

    ``group_slots``: per sequence whose KV groups a policy compacted, the slots each group holds after the
    step (the blocks past them go back to the pool); ``group_heads``: per sequence whose policy gives KV heads
    their own budgets, the tokens each head of each group holds packed (``attention/head_budgets.py``).
    ``output_rows``: per sequence, its rows in the model's output (fewer than its tokens where a policy dropped
    rows during prefill).
    """

    group_slots: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    group_heads: Mapping[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    output_rows: tuple[int, ...] = ()
