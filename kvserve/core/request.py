"""Request and sequence state: status, token lists and counters. No tensors live here.

A request holds one sequence while its prompt is computed; when the prompt's last logits are
sampled it forks into ``best_of`` sequences that share the prompt's KV blocks.
"""

from __future__ import annotations

import bisect
import enum
import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.policies import FullCache, KVPolicy
from kvserve.prompt_cache.cached_prompt import CachedPrompt
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.text.detokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted, its blocks in the host tier
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    # Per-layer KV groups only: slots each group holds (what the KV policy kept); empty = none yet.
    group_slots: list[int] = field(default_factory=list)
    group_heads: list[tuple[int, ...]] = field(default_factory=list)  # per layer: tokens per KV head packed (Ada-KV)
    text: str = ""
    emitted_chars: int = 0  # characters of text already streamed
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or token that ended it
    # Guided decoding: an xgrammar GrammarMatcher that has accepted every output token (kept across preemption).
    matcher: Any = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None  # with prompt_logprobs: each prompt token's rank (1: the top)
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_token_ids: frozenset[int] = frozenset()  # ends a sequence: the request's stop ids, plus EOS unless ignored
    cache_salt: tuple = ()  # salts prefix-cache hashes; unique when cached blocks must not be reused
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    finished_beams: list[Sequence] = field(default_factory=list)  # beam search hypotheses
    kv_policy: KVPolicy = field(default_factory=FullCache)  # which KV slots each layer keeps
    # Prompt tokens before this one are computed in steps of their own (their logits are not needed), so a
    # compressing policy compresses that context before the scored tokens attend to it.
    score_from: int = 0
    # Prompt Cache: each prompt token's position (empty: its index), and the module KV the prompt starts from.
    prompt_positions: tuple[int, ...] = ()
    prompt_cache: CachedPrompt | None = None
    grammar: Any = None  # guided decoding: the compiled constraint each sequence's matcher starts from
    # A Prompt Cache module's encoding: a prefill the scheduler admits and chunks like any other, whose sequence
    # already holds the module's blocks (the store allocated them); it samples nothing, is never preempted, and
    # leaves its blocks to the store when done.
    encodes_module: bool = False

    def __post_init__(self) -> None:
        self._next_position = max(self.prompt_positions) + 1 if self.prompt_positions else len(self.prompt_token_ids)

    def positions(self, start: int, end: int) -> tuple[int, ...]:
        """Position ids of tokens [start, end) of a sequence; empty when they are the indices themselves.
        Generated tokens follow the prompt's last position."""
        if not self.prompt_positions:
            return ()
        num_prompt = len(self.prompt_positions)
        # Slices and a range, not a generator: a sliding-window step asks for a whole context every step.
        offset = self._next_position - num_prompt  # generated token i takes position offset + i
        generated = range(offset + max(start, num_prompt), offset + end)
        return tuple(self.prompt_positions[start:end]) + tuple(generated)

    def position_of(self, index: int) -> int:
        """The position token ``index`` of a sequence takes (the context length bounds it)."""
        return index + self._next_position - len(self.prompt_token_ids)

    def leading_unseen(self, num_computed: int, window: int) -> int:
        """How many leading slots of a sequence with ``num_computed`` tokens computed no query still to come sees in
        a sliding window of ``window`` positions, its positions not being slot indices (Prompt Cache): the slots
        before the first whose position is within the window of the earliest position still to compute. (A query
        sees the slots before it whose position is within its window, ahead of it included: ``paged_plan``.)"""
        prefix_max, suffix_min = self._position_bounds
        num_prompt = len(prefix_max)
        first = (suffix_min[num_computed] if num_computed < num_prompt else self.position_of(num_computed)) - window + 1
        unseen = bisect.bisect_left(prefix_max, first)  # prompt slots whose every predecessor is before ``first``
        if unseen == num_prompt:  # generated tokens take rising positions past every prompt position
            unseen += max(0, first - self.position_of(num_prompt))
        return min(unseen, num_computed)

    @functools.cached_property
    def _position_bounds(self) -> tuple[list[int], list[int]]:
        """Per prompt slot, the largest position up to it and the smallest from it (generated tokens come after)."""
        positions = self.prompt_positions or range(len(self.prompt_token_ids))
        prefix_max = list(itertools.accumulate(positions, max))
        suffix_min = list(itertools.accumulate(reversed(positions), min))[::-1]
        return prefix_max, suffix_min

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def prefilling(self) -> bool:
        """True until the prompt's last logits are sampled (and the request forks into best_of)."""
        return len(self.seqs) == 1 and not self.seqs[0].output_token_ids

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
