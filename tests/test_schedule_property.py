"""Randomised schedules over the real Scheduler, KVCacheManager and Prompt Cache ModuleStore: every request ends,
and at the end every device and host block is free again.

Hypothesis draws a configuration (pool sizes, block budget, max_num_seqs, recompute or swap preemption, device or
host module tier) and a run of operations: requests whose prompts share prefixes (prefix hits), some importing
modules (pinned, encoded eagerly or lazily), best_of forks, cancellations, module registrations and
removals, and steps. A step does what the engine does with a ``SchedulerOutput`` (``engine.py``): finishes
rejected requests, applies the step (``Scheduler.update``), hands finished encodings to the store, and appends a
token to every sequence that samples. Only the model is left out: a token is a number, and the store's tensor
reads and writes go to a stand-in that holds nothing.

Module prompts pin their modules when they are added, not when they are admitted, so module prompts waiting together
can pin more of the pool than any one of them can then run beside (or starve the scratch sequence a module encoded
after a context needs): the scheduler then rejects the first of them. ``test_module_pins_that_fill_the_pool`` below
is that case written out.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.core.request import Request, Sequence
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.core.step import StepReport
from kvserve.kv.manager import KVCacheManager
from kvserve.prompt_cache.cache import _assemble
from kvserve.prompt_cache.cached_module import CachedModule
from kvserve.prompt_cache.store import EncodeJob, ModuleStore, PromptCacheError
from kvserve.sampling.sampling_params import SamplingParams

BLOCK = 4
PREFIXES = [[7 + (i * 13 + j * 5) % 90 for j in range(24)] for i in range(3)]  # shared prompt heads: prefix hits
MODULES = [[100 + 10 * m + j % 10 for j in range(4 + 3 * m)] for m in range(4)]  # 4..13 tokens each
CONTEXT = [1, 2, 3, 4, 5]  # the schema text before its modules (a module may be encoded after it)
UNCACHED_FROM = 200  # positions of a module prompt's own tokens
ENCODE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
MAX_STEPS = 3000  # far above what any schedule here needs: reaching it means a request could not progress


class NoTensors:
    """The store's view of the KV tensors, holding nothing (bookkeeping is what is under test)."""

    def read_slots(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, len(slots), 1, 1), torch.zeros(1, len(slots), 1, 1)

    def write_slots(self, slots: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        pass

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        pass


@dataclass
class Sim:
    """The engine's side of the loop, without a model."""

    kv: KVCacheManager
    scheduler: Scheduler
    store: ModuleStore
    requests: dict[str, Request] = field(default_factory=dict)
    pinned: dict[str, list[CachedModule]] = field(default_factory=dict)
    encodings: dict[int, EncodeJob] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    seq_ids: itertools.count = field(default_factory=itertools.count)
    names: itertools.count = field(default_factory=itertools.count)

    def register(self, m: int, context: bool) -> None:
        key = ("s", f"m{m}")
        if key in self.store.modules:
            return
        positions = list(range(20 * m + len(CONTEXT), 20 * m + len(CONTEXT) + len(MODULES[m])))
        ctx = (CONTEXT, list(range(len(CONTEXT)))) if context else ([], [])
        try:
            self.store.add(key, MODULES[m], positions, encode=m % 2 == 0, context=ctx)
        except PromptCacheError:  # no room for it now: refused, as the engine refuses the schema
            self.store.modules.pop(key, None)
        self._queue_encodings()

    def add(self, prompt: list[int], max_tokens: int, best_of: int, modules: list[int]) -> None:
        request_id = f"r{next(self.names)}"
        params = SamplingParams(max_tokens=max_tokens, best_of=best_of, n=1, temperature=1.0, ignore_eos=True)
        extra = {}
        if modules:
            pinned = []
            try:
                for m in modules:
                    module = self.store.modules.get(("s", f"m{m}"))
                    if module is None:
                        raise PromptCacheError("not registered")
                    pinned.append(self.store.pin(module))
            except PromptCacheError:  # removed, or no room to load it: the request is refused
                for blocks in pinned:
                    self.store.unpin(blocks.module)
                self._queue_encodings()
                return
            self._queue_encodings()
            positions = list(range(UNCACHED_FROM, UNCACHED_FROM + len(prompt)))
            prepared = _assemble(pinned, prompt, positions, BLOCK, "schema")
            prompt = prepared.token_ids
            extra = {"prompt_positions": tuple(prepared.positions), "prompt_cache": prepared.cached,
                     "cache_salt": prepared.salt}  # fmt: skip
            self.pinned[request_id] = prepared.modules
        seq = Sequence(next(self.seq_ids), list(prompt), len(prompt), None, None)
        request = Request(request_id, None, list(prompt), params, [seq], **extra)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def _queue_encodings(self) -> None:
        for job in self.store.take_encode_jobs():
            seq = Sequence(job.seq_id, list(job.token_ids), len(job.token_ids), None, None, job.computed)
            request = Request(
                f"encode:{job.module.key[1]}:{job.seq_id}", None, list(job.token_ids), ENCODE_PARAMS, [seq],
                prompt_positions=job.positions, encodes_module=True, cache_salt=job.cache_salt,
            )  # fmt: skip
            self.encodings[job.seq_id] = job
            self.scheduler.add(request)

    def cancel(self, index: int) -> None:
        live = sorted(self.requests)
        if live:
            request = self.requests[live[index % len(live)]]
            for seq in request.live_seqs:
                seq.finish_reason = "abort"
            self._release(request)

    def remove_module(self, m: int) -> None:
        self.store.remove(("s", f"m{m}"))

    def step(self) -> bool:
        """One engine step; False if it did nothing at all (the same state schedules the same nothing again)."""
        out = self.scheduler.schedule()
        for request_id in out.rejected:
            request = self.requests[request_id]
            for seq in request.live_seqs:
                seq.finish_reason = "length"
            self._release(request)
        for seq_id in self.scheduler.update(out, StepReport()):
            self.store.finish_encoding(self.encodings.pop(seq_id))
        owners = {s.seq_id: r for r in self.requests.values() for s in r.live_seqs}
        touched = {}
        for s in out.scheduled:
            if s.samples and s.seq_id in owners:
                request = owners[s.seq_id]
                touched[request.request_id] = request
                for seq in self._fork(request, next(q for q in request.seqs if q.seq_id == s.seq_id)):
                    seq.token_ids.append(7 + (seq.seq_id * 31 + seq.num_tokens * 7) % 90)
                    if len(seq.output_token_ids) >= request.params.max_tokens:
                        seq.finish_reason = "length"
        for request in touched.values():
            for seq in request.seqs:
                if seq.finished and seq.seq_id in self.kv:
                    self.scheduler.free_sequence(seq)
            if not request.live_seqs:
                self._release(request)
        return not out.empty or bool(out.rejected or out.preempted)

    def _fork(self, request: Request, seq: Sequence) -> list[Sequence]:
        if not request.prefilling or request.params.best_of == 1:
            return [seq]
        for _ in range(1, request.params.best_of):
            child = Sequence(next(self.seq_ids), list(seq.token_ids), seq.num_prompt_tokens, None, None)
            child.num_computed_tokens = seq.num_computed_tokens
            self.scheduler.fork(seq, child)
            request.seqs.append(child)
        return list(request.seqs)

    def _release(self, request: Request) -> None:
        self.scheduler.finish(request)
        del self.requests[request.request_id]
        self.finished.add(request.request_id)
        for module in self.pinned.pop(request.request_id, []):
            self.store.unpin(module)


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    head = draw(st.sampled_from(PREFIXES))[: draw(st.integers(0, 24))]
    tail = draw(st.lists(st.integers(3, 99), min_size=0 if head else 1, max_size=40))
    return head + tail


MODULE_CHOICE = st.lists(st.integers(0, len(MODULES) - 1), min_size=1, max_size=3, unique=True)
OPERATIONS = st.one_of(
    st.tuples(st.just("add"), prompts(), st.integers(1, 24), st.sampled_from([1, 1, 1, 2, 3]), st.just([])),
    st.tuples(st.just("add"), prompts(), st.integers(1, 6), st.just(1), MODULE_CHOICE),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("register"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("remove"), st.integers(0, 3)),
)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(
    num_blocks=st.integers(6, 40),
    num_host_blocks=st.sampled_from([0, 16, 64]),
    mode=st.sampled_from(["recompute", "swap"]),
    tier=st.sampled_from(["device", "host"]),
    max_num_seqs=st.integers(1, 5),
    token_budget=st.integers(4, 48),
    operations=st.lists(OPERATIONS, min_size=10, max_size=60),
)
def test_every_request_ends_and_every_block_is_free_again(
    num_blocks, num_host_blocks, mode, tier, max_num_seqs, token_budget, operations
) -> None:
    kv = KVCacheManager(num_blocks, BLOCK, num_host_blocks=num_host_blocks)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs, token_budget, mode), kv)
    # Device-tier modules may keep half the pool between requests, as the engine allows them.
    store = ModuleStore(kv, NoTensors(), tier, budget_bytes=num_blocks * BLOCK // 2, token_bytes=1)
    sim = Sim(kv, scheduler, store)
    for op in operations:
        if op[0] == "add":
            _, prompt, max_tokens, best_of, modules = op
            sim.add(prompt, max_tokens, min(best_of, max_num_seqs), modules)  # as the engine refuses more
        elif op[0] == "step":
            for _ in range(op[1]):
                sim.step()
        elif op[0] == "cancel":
            sim.cancel(op[1])
        elif op[0] == "register":
            sim.register(op[1], op[2])
        else:
            sim.remove_module(op[1])
    steps = 0
    while scheduler.has_unfinished():
        steps += 1
        stuck = f"{len(scheduler.waiting)} waiting, {len(scheduler.running)} running, {len(scheduler.swapped)} swapped"
        assert steps <= MAX_STEPS, f"no end after {MAX_STEPS} steps: {stuck}"
        assert sim.step(), f"no progress: a step did nothing with {stuck}"
    assert not sim.requests and not sim.encodings and not scheduler.encoding
    for key in list(store.modules):
        store.remove(key)
    assert kv.usage().num_sequences == 0 and not kv.take_pending_copies()
    assert kv.pool.num_free == num_blocks and all(b.ref_count == 0 for b in kv.pool.blocks)
    if kv.host_pool is not None:
        assert kv.host_pool.num_free == num_host_blocks


def test_module_pins_that_fill_the_pool_end_in_one_rejection() -> None:
    """Two module prompts pin 4 of 9 blocks on arrival; each alone fits beside its modules, neither in the 5 left
    while both wait. Without the scheduler's way out nothing would run again; with it the first is rejected
    (``finish_reason`` length: the engine reports ``kv_cache_capacity``) and the other runs to its end."""
    kv = KVCacheManager(9, BLOCK)
    scheduler = Scheduler(SchedulerConfig(4, 64, "recompute"), kv)
    store = ModuleStore(kv, NoTensors(), "device", budget_bytes=9 * BLOCK // 2, token_bytes=1)
    sim = Sim(kv, scheduler, store)
    sim.register(0, False)  # 4 tokens: 1 block
    sim.register(2, False)  # 10 tokens: 3 blocks
    while scheduler.has_unfinished():
        sim.step()
    sim.add(list(range(10, 30)), 2, 1, [2])
    sim.add(list(range(40, 60)), 2, 1, [0])
    rejected: list[str] = []
    schedule = scheduler.schedule

    def spied():
        out = schedule()
        rejected.extend(out.rejected)
        return out

    scheduler.schedule = spied
    for _ in range(MAX_STEPS):
        if not scheduler.has_unfinished():
            break
        assert sim.step(), "no progress"
    assert not scheduler.has_unfinished()
    assert len(rejected) == 1 and sim.finished == {"r0", "r1"}
