"""Continuous batching: which sequences run this step and how many tokens each, as plain data.

Iteration-level scheduling in the style of vLLM v1: there is no prefill or decode phase, only each
sequence's ``num_computed_tokens`` against its ``num_tokens``. Every step the scheduler fills a token
budget (``max_num_batched_tokens``) FCFS: running requests first (so decodes are never stalled by a
long prompt, which is computed in chunks), then swapped-out requests, then waiting ones (none while
a request is swapped out: it arrived first). When the KV cache runs out of blocks, the most recently
arrived running request is preempted, by swapping its blocks to the host tier or by freeing them to
recompute later. The scheduler only does bookkeeping through the ``KVCacheManager``; the runner
executes what it emits.

Progress: blocks kept only as a cache (Prompt Cache modules no request pins) are reclaimed
(``KVCacheManager.reclaim``) before a request waits or is preempted for blocks; a module's encoding
counts against ``max_num_seqs`` like any running request; while nothing runs, a waiting head that
cannot start is passed over (what it waits for may be pinned by a later arrival); a module prompt
that could never fit beside its own modules is rejected rather than left waiting; and if nothing
runs and no waiting request can start (module prompts pin their modules on arrival, so together
they can hold the pool), the oldest waiting one is rejected.

Sliding-window KV groups hold only what their window still sees: every step first gives back the
blocks no query of a running sequence sees any more, and a window group gets blocks chunk by chunk
(each sequence is grown to the token count its step reaches), so admission counts each group's real
need, not the whole prompt in every group. A Prompt Cache prompt's positions are not its slot indices: its
window groups start with the modules' blocks of that group (shared) and give back, by position, the leading
blocks no query still to come sees (``Request.leading_unseen``); a module's encoding keeps every block, since
importers read it from positions of their own.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from kvserve.core.request import Request, RequestStatus, Sequence
from kvserve.core.step import ModuleRecompute, ScheduledSequence, SchedulerOutput, StepReport
from kvserve.kv.block_pool import KVCacheError
from kvserve.kv.manager import AllocationStatus, KVCacheManager
from kvserve.policies import KVPolicy


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"  # or "swap" (falls back to recompute when the host tier is full)
    # Per-layer KV groups (a compressing policy may run): each group holds what the request's policy keeps.
    per_layer_groups: bool = False
    # With per-layer groups, each layer's sliding window (None: global): a window layer keeps its window, whatever
    # the policy (which compresses the global layers); (): no sliding-window layers.
    layer_windows: tuple[int | None, ...] = ()
    # Whether a block computed in a step can be a prefix hit for a request admitted in the same step: true where
    # every layer writes the whole step's keys before any sequence attends (the paged cache); an offloaded cache
    # fetches a decode's rows ahead of the layer, so its blocks become findable once the step has run.
    same_step_prefix_hits: bool = True
    # The model has sliding-window layers and every layer in one KV group: a sequence whose positions are not its
    # slot indices (Prompt Cache) carries every slot's position, as a window counts positions, not slots.
    positioned_windows: bool = False


@dataclass
class _Step:
    """The output being built, and what is left of the step's budgets."""

    tokens_left: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write taken from the manager so far
    slot_copies: list[tuple[int, int]] = field(default_factory=list)
    recomputes: list[ModuleRecompute] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self.encoding: set[int] = set()  # module sequences whose encoding has not finished

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if request.encodes_module:
            self.encoding.update(s.seq_id for s in request.seqs)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (best_of sample, beam) starts from ``parent``'s KV: it shares every block (copy-on-write) and
        holds what each of parent's KV groups holds."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.group_slots, child.group_heads = list(parent.group_slots), list(parent.group_heads)

    def free_sequence(self, seq: Sequence) -> None:
        """Release a finished or pruned sequence's blocks."""
        if seq.seq_id in self.kv:
            self.kv.free(seq.seq_id)

    def finish(self, request: Request) -> None:
        """Remove a request from every queue and free all its blocks (finished or aborted)."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        for seq in request.seqs:
            self.free_sequence(seq)
        request.status = RequestStatus.FINISHED

    def recompute(self, request: Request) -> None:
        """Preempt ``request`` by recompute outside a step (its KV could not be trusted after a failed step): free
        its blocks, device or host, and queue it first to compute again from its tokens."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        for seq in request.live_seqs:
            self.free_sequence(seq)
            seq.num_computed_tokens = 0
            seq.group_slots, seq.group_heads = [], []
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput, report: StepReport) -> list[int]:
        """Apply what the step ``out`` did (vLLM v1's ``update_from_output``): every scheduled sequence has its
        tokens computed, and where a policy compacted a sequence's KV groups (``report.group_slots``) the blocks
        past what each group keeps go back to the pool. Returns the module sequences whose encoding is done
        (their blocks now belong to the Prompt Cache store alone)."""
        owners = {seq.seq_id: (request, seq) for request in self.running for seq in request.live_seqs}
        encoded: list[int] = []
        for s in out.scheduled:
            request, seq = owners[s.seq_id]
            seq.num_computed_tokens += len(s.token_ids)
            if not self.config.same_step_prefix_hits:
                self.kv.cache_full_blocks(seq.seq_id, seq.token_ids[: seq.num_computed_tokens])
            held = report.group_slots.get(s.seq_id)
            if held is not None:
                for group, num_slots in enumerate(held):
                    self.kv.shrink(seq.seq_id, group, num_slots)
                seq.group_slots = list(held)
            heads = report.group_heads.get(s.seq_id)
            if heads is not None:
                seq.group_heads = list(heads)
            if request.encodes_module and seq.num_uncomputed_tokens == 0:
                self.running.remove(request)
                self.encoding.discard(seq.seq_id)
                request.status = RequestStatus.FINISHED
                encoded.append(seq.seq_id)
        return encoded

    # ----- one step -----

    def schedule(self) -> SchedulerOutput:
        step = _Step(tokens_left=self.config.max_num_batched_tokens)
        self._release_out_of_window()
        self._schedule_running(step)
        if not step.preempted:  # under memory pressure, admit nothing new this step
            self._schedule_swapped(step)
            # FCFS: a swapped-out request arrived before every waiting one (unless it cannot come back while
            # nothing runs: see _wait).
            if not self.swapped or not self.running:
                self._schedule_waiting(step)
        return SchedulerOutput(
            scheduled=tuple(step.scheduled),
            blocks_to_swap_out=tuple(step.swap_out),
            blocks_to_swap_in=tuple(step.swap_in),
            blocks_to_copy=tuple(step.copies + self.kv.take_pending_copies()),
            slots_to_copy=tuple(step.slot_copies),
            recomputes=tuple(step.recomputes),
            preempted=tuple(step.preempted),
            rejected=tuple(step.rejected),
        )

    def _release_out_of_window(self) -> None:
        """Window groups give back what no query of a running sequence sees any more, for every sequence
        before any grows: a sequence early in the queue may need the block a later one is done with, and
        would otherwise preempt it. This is the end of the previous step as far as blocks go (the engine
        counted its computed tokens, and nothing allocates in between), so the engine keeps no KV
        bookkeeping. ``_reserve`` releases again for sequences admitted or swapped in (idempotent)."""
        for request in self.running:
            for seq in request.live_seqs:
                self._release(request, seq)

    def _release(self, request: Request, seq: Sequence) -> None:
        """``KVCacheManager.release_out_of_window`` for one sequence: by slot, or by position for a Prompt Cache
        prompt; never for a module's encoding (the module keeps every block, see the module docstring)."""
        if request.encodes_module:
            return
        if not request.prompt_positions:
            self.kv.release_out_of_window(seq.seq_id, seq.num_computed_tokens)
            return
        computed = seq.num_computed_tokens
        self.kv.release_out_of_window(seq.seq_id, computed, lambda window: request.leading_unseen(computed, window))

    def _schedule_running(self, step: _Step) -> None:
        kept: list[Request] = []
        queue = list(self.running)
        while queue:
            request = queue.pop(0)
            while not self._reserve(request, step.tokens_left):
                if self.kv.reclaim():  # cached modules no request pins go before any request is preempted
                    continue
                victim = _latest_preemptible(queue) or request  # the latest arrival goes first
                self._preempt(victim, step)
                if victim is request:
                    break
            else:
                kept.append(request)
                self._emit(request, step)
        self.running = kept

    def _schedule_swapped(self, step: _Step) -> None:
        while self.swapped and step.tokens_left > 0:
            request = self.swapped[0]
            if self._num_running_seqs() + _num_seqs(request) > self.config.max_num_seqs:
                return
            # All sequences at once, with room for their next tokens: _preempt made sure they fit.
            if self._blocks_unshared(request) > self.kv.pool.num_free:
                if self.kv.reclaim():
                    continue
                return
            self.swapped.popleft()
            for seq in request.live_seqs:
                step.swap_in += self.kv.swap_in(seq.seq_id)
            self._start(request, step)

    def _schedule_waiting(self, step: _Step) -> None:
        passed: list[Request] = []  # heads left waiting while nothing runs (see _wait)
        while self.waiting and step.tokens_left > 0:
            request = self.waiting[0]
            seqs = request.live_seqs
            if request.prompt_cache and self.encoding.intersection(request.prompt_cache.module_seq_ids):
                if self._wait(passed):  # FCFS: its modules' encodings arrived first and run before it
                    break
                continue
            # A module's encoding has its blocks from the store, prefix hits counted; it still counts as running work.
            allocated = request.encodes_module and seqs[0].seq_id in self.kv
            status = AllocationStatus.OK if allocated else self._admission(request)
            if status == AllocationStatus.NEVER:
                self.waiting.popleft()
                step.rejected.append(request.request_id)
                continue
            if self._num_running_seqs() + _num_seqs(request) > self.config.max_num_seqs:
                break
            if status != AllocationStatus.OK:
                if self.kv.reclaim():  # an unpinned cached module gave its blocks back: look again
                    continue
                if self._wait(passed):  # FCFS: the head waits for blocks, nobody overtakes it
                    break
                continue
            self.waiting.popleft()
            if not allocated:
                for seq in seqs:
                    if self.config.per_layer_groups:  # _reserve gives each group what the policy keeps
                        seq.num_computed_tokens = self._allocate_groups(request, seq, step)
                    else:
                        seq.num_computed_tokens = self._allocate(request, seq, step)
                if request.prefilling:
                    request.num_cached_prompt_tokens = seqs[0].num_computed_tokens
            self._start(request, step)
        stuck = [r for r in passed if not r.encodes_module]  # the store owns an encoding: never rejected here
        if stuck and not self.running and not step.rejected:
            # Nothing runs and no waiting request can start: the modules the waiting ones pinned (on arrival) fill
            # the pool between them, and no step would ever free a block (a rejection this step frees pins: look
            # again next step). The first is rejected; its modules' pins go, and the others (or the encoding
            # they wait for) may fit.
            passed.remove(stuck[0])
            step.rejected.append(stuck[0].request_id)
        self.waiting.extendleft(reversed(passed))

    def _wait(self, passed: list[Request]) -> bool:
        """The waiting head cannot start now: True, it waits and nobody overtakes it (FCFS), while a request
        runs, whose end frees blocks. With none running, no step would ever free what it waits for (blocks of
        modules that later arrivals pinned, an encoding queued after it): it is passed (False), and the next one
        may start; finishing, that one unpins its modules."""
        if self.running:
            return True
        passed.append(self.waiting.popleft())
        return False

    def _start(self, request: Request, step: _Step) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if self._reserve(request, step.tokens_left):
            self._emit(request, step)

    # ----- helpers -----

    def _allocate(self, request: Request, seq: Sequence, step: _Step) -> int:
        """Blocks for an admitted sequence; returns its tokens already computed (prefix hits, Prompt Cache modules)."""
        cached, step_tokens = request.prompt_cache, step.tokens_left  # window groups: the first chunk only
        keep = bool(request.prompt_positions)  # positioned: window groups release by position (see _release)
        if cached is None:
            return self.kv.allocate(
                seq.seq_id, seq.token_ids, request.cache_salt, step_tokens=step_tokens, keep_window=keep
            )
        shared = cached.group_shared or cached.shared_blocks  # several KV groups: each group's blocks
        computed = self.kv.allocate(seq.seq_id, seq.token_ids, request.cache_salt, shared, step_tokens, keep)
        lead = len(cached.shared_blocks) * self.kv.block_size
        end = lead + len(cached.tail_slots)
        # A prefix hit past the shared blocks holds the copy already: copy only the tail slots after it.
        first = max(lead, computed)
        for group, tails in enumerate(cached.group_tails or (cached.tail_slots,)):
            dst = self.kv.slots(seq.seq_id, first, end, group)
            step.slot_copies += zip(tails[first - lead :], dst, strict=True)
        if cached.recompute_count:
            self._recompute(request, seq, computed, step)
        return max(computed, end)

    def _recompute(self, request: Request, seq: Sequence, computed: int, step: _Step) -> None:
        """Queue the selective recompute of an admitted Prompt Cache prompt. Candidates in prefix-hit blocks are
        left as they are: those blocks hold a recompute already (the salt names the share) and may be shared."""
        cached, n = request.prompt_cache, request.prompt_cache.num_tokens
        candidates = tuple(i for i in cached.recompute if i >= computed)
        if not candidates:
            return
        count = min(len(candidates), cached.recompute_count)
        probe = tuple(i for i in cached.recompute_probe if i >= computed)
        step.recomputes.append(
            ModuleRecompute(
                seq.seq_id, tuple(seq.token_ids[:n]), request.positions(0, n), tuple(self.kv.slots(seq.seq_id, 0, n)),
                candidates, count, probe,
            )
        )  # fmt: skip

    def _allocate_groups(self, request: Request, seq: Sequence, step: _Step) -> int:
        """A group per layer: empty, or starting with the imported modules' slots each layer kept (full blocks
        shared, partial last blocks copied); returns the tokens already computed."""
        cached = request.prompt_cache
        if cached is None:
            self.kv.allocate_empty(seq.seq_id)
            seq.group_slots, seq.group_heads = [], []
            return 0
        self.kv.allocate_shared_groups(seq.seq_id, cached.group_shared)  # filled in by _admission
        seq.group_slots, seq.group_heads = cached.group_slots(self.kv.block_size), []
        if not self.kv.reserve(seq.seq_id, seq.group_slots):  # admission counted these blocks
            raise KVCacheError(f"sequence {seq.seq_id}: no blocks for its modules' tails after admission")
        frozen = cached.frozen_slots(self.kv.block_size)
        for group, tails in enumerate(cached.group_tails):
            dst = self.kv.slots(seq.seq_id, frozen[group], frozen[group] + len(tails), group)
            step.slot_copies += zip(tails, dst, strict=True)
        return cached.num_tokens

    def _admission(self, request: Request) -> AllocationStatus:
        """Whether all of a waiting request's sequences can get blocks now, later, or never."""
        if _num_seqs(request) > self.config.max_num_seqs:
            return AllocationStatus.NEVER  # best_of sequences can never run side by side
        seqs = request.live_seqs
        if self.config.per_layer_groups:  # each sequence on its own blocks (re-prefilled after a recompute)
            held, frozen, cached = self._imported_slots(request)
            targets = [
                self._group_targets(request.kv_policy, held, s.num_tokens - cached, s.num_tokens, frozen) for s in seqs
            ]
            shared = sum(f // self.kv.block_size for f in frozen) * len(seqs)  # held by the modules already
            return self.kv.device_status(sum(self.kv.blocks_for(n) for slots in targets for n in slots) - shared)
        module_blocks = request.prompt_cache.shared_blocks if request.prompt_cache else ()
        budget = self.config.max_num_batched_tokens  # the most a step computes: a window group's chunk
        if request.prompt_cache and self._outgrows_modules(request, budget):
            return AllocationStatus.NEVER
        keep = bool(request.prompt_positions)
        if len(seqs) == 1:
            seq = seqs[0]
            shared = request.prompt_cache.group_shared or module_blocks if request.prompt_cache else ()
            return self.kv.can_allocate(seq.num_tokens, seq.token_ids, request.cache_salt, shared, budget, keep)
        # Forked sequences back after recompute are allocated one by one, each needing its own blocks
        # except the cached prompt blocks the first one holds by then. Counting no other hit keeps the
        # sum an upper bound, so allocation cannot run dry half way through the request.
        cached = min(self.kv.cached_prefix_tokens(s.token_ids, request.cache_salt) for s in seqs)
        shared = min(cached, len(request.prompt_token_ids)) // self.kv.block_size
        return self.kv.device_status(
            sum(
                self.kv.blocks_needed(s.num_tokens, budget, len(module_blocks) + (shared if i else 0), keep)
                for i, s in enumerate(seqs)
            )
        )

    def _outgrows_modules(self, request: Request, budget: int) -> bool:
        """Whether a Prompt Cache request can never fit beside its own modules: they keep their blocks while it
        lives (the full ones it shares, and those holding the tails it copies), so only the rest of the pool is
        ever free for it, however long it waits."""
        cached, bs = request.prompt_cache, self.kv.block_size
        shared, tails = cached.group_shared or (cached.shared_blocks,), cached.group_tails or (cached.tail_slots,)
        kept = sum(len(blocks) for blocks in shared) + sum(len({slot // bs for slot in t}) for t in tails)
        num_shared = len(cached.shared_blocks)
        return any(
            self.kv.blocks_needed(s.num_tokens, budget, num_shared, keep_window=True) + kept > self.kv.pool.num_blocks
            for s in request.live_seqs
        )

    def _blocks_unshared(self, request: Request) -> int:
        """Device blocks a request takes at most when each sequence holds its tokens on its own, as after
        a swap-in (a swap copies shared blocks once per sequence), with room for its next step."""
        budget, keep = self.config.max_num_batched_tokens, bool(request.prompt_positions)
        return sum(
            self.kv.blocks_needed(s.num_tokens, min(budget, max(1, s.num_uncomputed_tokens)), keep_window=keep)
            for s in request.live_seqs
        )

    def _tokens_this_step(self, request: Request, seq: Sequence, tokens_left: int) -> int:
        n = min(seq.num_uncomputed_tokens, tokens_left)
        if seq.num_computed_tokens < request.score_from:  # the unscored context runs in steps of its own
            n = min(n, request.score_from - seq.num_computed_tokens)
        return n

    def _reserve(self, request: Request, tokens_left: int) -> bool:
        """Slots for what each live sequence computes this step; False if the cache is full.
        Idempotent: a retry after a preemption only appends what is still missing."""
        for seq in request.live_seqs:
            n = self._tokens_this_step(request, seq, tokens_left)
            if self.config.per_layer_groups:
                held = self._group_slots(seq)
                targets = self._group_targets(
                    request.kv_policy, held, n, seq.num_computed_tokens + n, self._frozen_slots(request)
                )
                # A decoded token is written before its layer compresses (see attention/compressed.py): its slot too.
                writes = 1 if n == 1 else 0
                if not self.kv.reserve(seq.seq_id, [max(h + writes, t) for h, t in zip(held, targets, strict=True)]):
                    return False
            else:
                # Window groups give back what this step's queries no longer see first, so it is reused
                # at once; then every group grows to the step's end (a window group holds only a chunk).
                self._release(request, seq)
                end = seq.num_computed_tokens + n
                if not self.kv.reserve(seq.seq_id, [end] * len(self.kv.groups)):
                    return False
            tokens_left -= n
        return True

    def _group_slots(self, seq: Sequence) -> list[int]:
        """Slots each group holds with keys in them (the manager's count may include this step's reservation)."""
        return list(seq.group_slots) or [0] * len(self.kv.groups)

    def _group_targets(
        self, policy: KVPolicy, held: list[int], new: int, num_tokens: int, frozen: tuple[int, ...] = ()
    ) -> list[int]:
        """Slots each layer group keeps after a step adding ``new`` tokens (one group per layer). Slots in shared
        module blocks (``frozen``) were compressed when the module was encoded and stay as they are; the group's
        own slots after them get the policy's share of the whole sequence, as if the modules were not there (a
        prompt's question after a long document stays in PyramidInfer's recent window, as without modules)."""
        slack = self.kv.block_size
        if frozen:
            own_held = [h - f for h, f in zip(held, frozen, strict=True)]
            own = policy.slots_after_per_layer(own_held, new, num_tokens, slack)
            targets = [f + t for f, t in zip(frozen, own, strict=True)]
        else:
            targets = policy.slots_after_per_layer(held, new, num_tokens, slack)
        for layer, window in enumerate(self.config.layer_windows):
            if window is not None:  # the window, once it is outgrown by a block (as the policy's own rule)
                targets[layer] = held[layer] + new if held[layer] + new <= window + slack else window
        return targets

    def _imported_slots(self, request: Request) -> tuple[list[int], tuple[int, ...], int]:
        """A waiting request's slots per layer from imported modules, the frozen ones, and their tokens. Its
        modules are encoded by now (it waited for them): what each layer kept of them goes into its
        ``CachedPrompt``."""
        cached = request.prompt_cache
        if cached is None:
            return [0] * len(self.kv.groups), (), 0
        if not cached.group_shared:
            request.prompt_cache = cached = dataclasses.replace(cached, **self._module_groups(cached.module_seq_ids))
        return cached.group_slots(self.kv.block_size), cached.frozen_slots(self.kv.block_size), cached.num_tokens

    def _module_groups(self, module_seq_ids: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Per layer group, the modules' full blocks (to share) and the slots of their partial last blocks (to
        copy), as much of each module as that layer kept."""
        bs, shared, tails = self.kv.block_size, [], []
        for group in range(len(self.kv.groups)):
            blocks: list[int] = []
            slots: list[int] = []
            for seq_id in module_seq_ids:
                num_slots = self.kv.num_slots(seq_id, group)
                blocks += self.kv.block_table(seq_id, group)[: num_slots // bs]
                slots += self.kv.slots(seq_id, num_slots // bs * bs, num_slots, group)
            shared.append(tuple(blocks))
            tails.append(tuple(slots))
        return {"group_shared": tuple(shared), "group_tails": tuple(tails)}

    def _frozen_slots(self, request: Request) -> tuple[int, ...]:
        cached = request.prompt_cache
        return cached.frozen_slots(self.kv.block_size) if cached is not None and cached.group_shared else ()

    def _emit(self, request: Request, step: _Step) -> None:
        for seq in request.live_seqs:
            n = self._tokens_this_step(request, seq, step.tokens_left)
            if n == 0:
                continue
            start = seq.num_computed_tokens
            # Full blocks this step computes are findable at once (as in vLLM v1): a request admitted
            # later in this same step may reuse them, because every layer writes the step's keys and
            # values before any sequence attends (else ``update`` registers them after the step).
            if self.config.same_step_prefix_hits:
                self.kv.cache_full_blocks(seq.seq_id, seq.token_ids[: start + n])
            step.scheduled.append(
                ScheduledSequence(
                    request_id=request.request_id,
                    seq_id=seq.seq_id,
                    token_ids=tuple(seq.token_ids[start : start + n]),
                    num_computed_tokens=start,
                    block_tables=self.kv.block_tables(seq.seq_id),
                    samples=start + n == seq.num_tokens and not request.encodes_module,
                    ends_prompt=start + n >= seq.num_prompt_tokens,
                    positions=request.positions(start, start + n),
                    key_positions=request.positions(0, start + n) if self.config.positioned_windows else (),
                    full_length=seq.num_prompt_tokens + request.params.max_tokens,
                    score_from=request.score_from,
                    **self._policy_fields(request, seq, n),
                )
            )
            step.tokens_left -= n

    def _policy_fields(self, request: Request, seq: Sequence, n: int) -> dict:
        if not self.config.per_layer_groups:
            return {}
        held, frozen = self._group_slots(seq), self._frozen_slots(request)
        targets = self._group_targets(request.kv_policy, held, n, seq.num_computed_tokens + n, frozen)
        return {
            "kv_policy": request.kv_policy, "group_slots": tuple(held), "group_targets": tuple(targets),
            "group_frozen": frozen, "group_heads": tuple(seq.group_heads),
        }  # fmt: skip

    def _preempt(self, request: Request, step: _Step) -> None:
        seqs = [s for s in request.live_seqs if s.seq_id in self.kv]
        swap = self.config.preemption_mode == "swap" and self._can_swap_out(request, seqs)
        step.copies += self.kv.take_pending_copies()
        for seq in seqs:
            if swap:
                self._swap_out(seq, step)
            else:
                self._drop_copies_into(self._device_blocks(seq), step)
                self.kv.free(seq.seq_id)
                seq.num_computed_tokens = 0
                seq.group_slots, seq.group_heads = [], []
        if swap:
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)
        else:
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        step.preempted.append(request.request_id)
        self.num_preemptions += 1

    def _swap_out(self, seq: Sequence, step: _Step) -> None:
        # A copy-on-write queued this step runs after the swap-outs: save the copy's source instead of
        # its target, which holds nothing yet, and drop the copy.
        source = {dst: src for src, dst in step.copies}
        plan = self.kv.swap_out(seq.seq_id)
        step.swap_out += [(source.get(device, device), host) for device, host in plan]
        self._drop_copies_into({device for device, _ in plan}, step)

    def _drop_copies_into(self, blocks: set[int], step: _Step) -> None:
        step.copies = [(src, dst) for src, dst in step.copies if dst not in blocks]

    def _device_blocks(self, seq: Sequence) -> set[int]:
        return set(self.kv.held_blocks(seq.seq_id))

    def _can_swap_out(self, request: Request, seqs: list[Sequence]) -> bool:
        if self.kv.host_pool is None:
            return False
        blocks = sum(len(self.kv.held_blocks(s.seq_id)) for s in seqs)
        # Swapped out, forked sequences no longer share blocks: if they could never all come back, or
        # a sequence could never take its next token, swapping would only bounce; recompute instead.
        return blocks <= self.kv.host_pool.num_free and self._blocks_unshared(request) <= self.kv.pool.num_blocks

    def _num_running_seqs(self) -> int:
        return sum(_num_seqs(r) for r in self.running)


def _latest_preemptible(queue: list[Request]) -> Request | None:
    """Take the latest arrival in ``queue`` that may be preempted (a module's encoding never is: the store owns
    its blocks, which it allocated whole), or None."""
    for i in range(len(queue) - 1, -1, -1):
        if not queue[i].encodes_module:
            return queue.pop(i)
    return None


def _num_seqs(request: Request) -> int:
    """Sequences a request runs: one still computing its prompt forks into best_of after it."""
    return request.params.best_of if request.prefilling else len(request.live_seqs)
