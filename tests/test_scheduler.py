"""Scheduler, exactly: who runs, how many tokens each, which blocks move, with no model.

After vLLM's CPU-only scheduler tests: a real ``KVCacheManager`` with a tiny spec (a handful of
blocks of 4 tokens), hand-made ``Request``/``Sequence`` objects, and a harness that plays the engine
between steps (counts computed tokens, registers full blocks, appends a fake sampled token, forks
``best_of`` sequences after the prompt, finishes sequences at ``max_tokens``). The harness also plays
the runner on a simulated KV store -- swap-outs, swap-ins, copy-on-write copies in the runner's
order, then the step's writes -- and checks that every scheduled sequence reads back its own context,
so a wrong plan shows up as a sequence reading another one's token.
"""

from __future__ import annotations

import random

import pytest

from kvserve.core.request import Request, RequestStatus, Sequence
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.core.step import ScheduledSequence, SchedulerOutput
from kvserve.kv import KVCacheManager
from kvserve.sampling.sampling_params import SamplingParams

BLOCK = 4


def prompt(k: int, n: int) -> list[int]:
    """Prompt ``k`` of ``n`` tokens; different ``k`` share no block."""
    return [100 * k + i for i in range(n)]


def fake_token(seq: Sequence) -> int:
    """A sampled token unique to the sequence and position, so forked sequences diverge."""
    return 1_000_000 + 1000 * seq.seq_id + seq.num_tokens


class KVStore:
    """What the runner's tensors would hold: slot contents per device / host block."""

    def __init__(self) -> None:
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def move(self, out: SchedulerOutput) -> None:
        """The runner's order: swap-outs, swap-ins, then copies; each reads all before it writes."""
        for pairs, src, dst in (
            (out.blocks_to_swap_out, self.device, self.host),
            (out.blocks_to_swap_in, self.host, self.device),
            (out.blocks_to_copy, self.device, self.device),
        ):
            values = [list(src.get(a, [None] * BLOCK)) for a, _ in pairs]
            for (_, b), value in zip(pairs, values, strict=True):
                dst[b] = value

    def read(self, table: tuple[int, ...], num_tokens: int) -> list:
        return [self.device.get(table[p // BLOCK], [None] * BLOCK)[p % BLOCK] for p in range(num_tokens)]

    def write(self, table: tuple[int, ...], start: int, tokens: tuple[int, ...]) -> None:
        for i, token in enumerate(tokens):
            pos = start + i
            self.device.setdefault(table[pos // BLOCK], [None] * BLOCK)[pos % BLOCK] = token


class Harness:
    """A scheduler over a real KV manager, and the engine's per-step bookkeeping."""

    def __init__(
        self,
        num_blocks: int = 12,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        **config: object,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK, num_host_blocks=num_host_blocks,
                                 enable_prefix_caching=enable_prefix_caching)  # fmt: skip
        self.sched = Scheduler(SchedulerConfig(**config), self.kv)
        self.store = KVStore()
        self.seqs: dict[int, tuple[Request, Sequence]] = {}
        self.requests: dict[str, Request] = {}
        self.finished: list[str] = []  # request ids, in finishing order (rejected ones too)
        self.rejected: list[str] = []
        self._next_seq_id = 0

    def new_seq(self, token_ids: list[int], num_prompt: int) -> Sequence:
        seq = Sequence(self._next_seq_id, list(token_ids), num_prompt, generator=None, detokenizer=None)
        self._next_seq_id += 1
        return seq

    def add(self, request_id: str, token_ids: list[int], max_tokens: int = 100, n: int = 1) -> Request:
        seq = self.new_seq(token_ids, len(token_ids))
        params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, max_tokens=max_tokens)
        request = Request(request_id, None, list(token_ids), params, [seq])
        self.seqs[seq.seq_id] = (request, seq)
        self.requests[request_id] = request
        self.sched.add(request)
        return request

    def fork(self, request: Request, seq: Sequence) -> Sequence:
        """A sibling of ``seq`` sharing its blocks, as the engine makes for best_of / beams."""
        child = self.new_seq(seq.token_ids, seq.num_prompt_tokens)
        child.num_computed_tokens = seq.num_computed_tokens
        self.kv.fork(seq.seq_id, child.seq_id)
        request.seqs.append(child)
        self.seqs[child.seq_id] = (request, child)
        return child

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.store.move(out)
        for s in out.scheduled:
            request, seq = self.seqs[s.seq_id]
            table = s.block_tables[0]
            assert self.store.read(table, s.num_computed_tokens) == seq.token_ids[: s.num_computed_tokens]
            self.store.write(table, s.num_computed_tokens, s.token_ids)
            seq.num_computed_tokens += len(s.token_ids)
            self.kv.cache_full_blocks(seq.seq_id, seq.token_ids[: seq.num_computed_tokens])
        for s in out.scheduled:
            if s.samples:
                self._sample(*self.seqs[s.seq_id])
        for request_id in out.rejected:
            self.rejected.append(request_id)
            self._finish(self.requests[request_id])
        return out

    def _sample(self, request: Request, seq: Sequence) -> None:
        if request.prefilling:
            for _ in range(request.params.best_of - 1):
                self.fork(request, seq)
            family = list(request.seqs)
        else:
            family = [seq]
        for s in family:
            s.token_ids.append(fake_token(s))
            if len(s.output_token_ids) >= request.params.max_tokens:
                s.finish_reason = "length"
                self.sched.free_sequence(s)
        if not request.live_seqs:
            self._finish(request)

    def _finish(self, request: Request) -> None:
        self.sched.finish(request)
        self.finished.append(request.request_id)

    def run(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_unfinished():
            assert len(outs) < max_steps, "the scheduler made no progress"
            outs.append(self.step())
        return outs


def rows(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, tokens this step, tokens computed before, samples) per scheduled sequence."""
    return [(s.request_id, len(s.token_ids), s.num_computed_tokens, s.samples) for s in out.scheduled]


def tables(out: SchedulerOutput) -> dict[int, tuple[int, ...]]:
    return {s.seq_id: s.block_tables[0] for s in out.scheduled}


def used_blocks(h: Harness) -> int:
    return h.kv.usage().used_blocks


# ----- admission, FCFS, budgets -----


def test_first_step_prefills_whole_prompts_in_arrival_order_then_decodes():
    h = Harness(num_blocks=12)
    a = h.add("a", prompt(1, 5))
    h.add("b", prompt(2, 3))
    out = h.step()
    assert out.scheduled == (
        ScheduledSequence("a", 0, tuple(prompt(1, 5)), 0, ((0, 1),), True, ends_prompt=True, full_length=5 + 100),
        ScheduledSequence("b", 1, tuple(prompt(2, 3)), 0, ((2,),), True, ends_prompt=True, full_length=3 + 100),
    )
    assert out.num_batched_tokens == 8
    assert not (out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy or out.preempted)
    assert a.status is RequestStatus.RUNNING and not h.sched.waiting

    out = h.step()  # decodes: one token each, the one sampled last step
    assert out.scheduled == (
        ScheduledSequence("a", 0, (fake_token_at(0, 5),), 5, ((0, 1),), True, ends_prompt=True, full_length=5 + 100),
        ScheduledSequence("b", 1, (fake_token_at(1, 3),), 3, ((2,),), True, ends_prompt=True, full_length=3 + 100),
    )
    out = h.step()  # b's fifth slot needs a second block
    assert rows(out) == [("a", 1, 6, True), ("b", 1, 4, True)]
    assert tables(out) == {0: (0, 1), 1: (2, 3)}


def fake_token_at(seq_id: int, position: int) -> int:
    return 1_000_000 + 1000 * seq_id + position


def test_max_num_seqs_holds_later_arrivals_back_until_a_request_finishes():
    h = Harness(num_blocks=12, max_num_seqs=2)
    for i, rid in enumerate("abc"):
        h.add(rid, prompt(i, 4), max_tokens=2)
    assert rows(h.step()) == [("a", 4, 0, True), ("b", 4, 0, True)]
    assert [r.request_id for r in h.sched.waiting] == ["c"]
    assert rows(h.step()) == [("a", 1, 4, True), ("b", 1, 4, True)]
    assert h.finished == ["a", "b"]
    assert rows(h.step()) == [("c", 4, 0, True)]


def test_max_num_seqs_counts_the_samples_a_prompt_forks_into():
    h = Harness(num_blocks=12, max_num_seqs=4)
    h.add("a", prompt(1, 4), n=3)
    h.add("c", prompt(3, 4), n=5)  # can never run: rejected, not left blocking the queue
    h.add("b", prompt(2, 4), n=2)  # 3 + 2 sequences > 4: waits
    out = h.step()
    assert rows(out) == [("a", 4, 0, True)] and out.rejected == ("c",)
    assert [r.request_id for r in h.sched.waiting] == ["b"]
    assert rows(h.step()) == [("a", 1, 4, True)] * 3


def test_token_budget_chunks_a_prompt_and_fills_up_with_the_next_arrival():
    h = Harness(num_blocks=12, max_num_batched_tokens=8)
    h.add("a", prompt(1, 6))
    h.add("b", prompt(2, 6))
    h.add("c", prompt(3, 3))
    out = h.step()
    assert rows(out) == [("a", 6, 0, True), ("b", 2, 0, False)]  # budget spent: c waits
    assert out.scheduled[1].token_ids == tuple(prompt(2, 2))
    assert tables(out) == {0: (0, 1), 1: (2, 3)}  # the whole prompt's blocks come at admission
    assert [r.request_id for r in h.sched.waiting] == ["c"]
    out = h.step()
    assert rows(out) == [("a", 1, 6, True), ("b", 4, 2, True), ("c", 3, 0, True)]
    assert out.scheduled[1].token_ids == tuple(prompt(2, 6)[2:])
    assert tables(out)[2] == (4,)
    assert rows(h.step()) == [("a", 1, 7, True), ("b", 1, 6, True), ("c", 1, 3, True)]


def test_chunked_prefill_never_stalls_a_running_decode():
    h = Harness(num_blocks=12, max_num_batched_tokens=8)
    h.add("a", prompt(1, 3))
    assert rows(h.step()) == [("a", 3, 0, True)]
    h.add("b", prompt(2, 20))
    chunks = []
    for expected_b in [(7, 0, False), (7, 7, False), (6, 14, True), (1, 20, True)]:
        out = h.step()
        assert out.scheduled[0].request_id == "a" and len(out.scheduled[0].token_ids) == 1  # decode first
        assert rows(out)[1] == ("b", *expected_b)
        assert out.num_batched_tokens <= 8
        chunks.append(out.scheduled[1].token_ids)
    assert sum(chunks[:3], ()) == tuple(prompt(2, 20))


def test_waiting_head_is_not_overtaken_by_a_smaller_request():
    h = Harness(num_blocks=4)
    h.add("a", prompt(1, 8), max_tokens=3)  # 2 blocks, growing to 3
    h.step()
    h.add("b", prompt(2, 9))  # 3 blocks: only 2 free
    h.add("c", prompt(3, 2))  # would fit, but arrived after b
    assert rows(h.step()) == [("a", 1, 8, True)]
    assert [r.request_id for r in h.sched.waiting] == ["b", "c"]


# ----- prefix caching -----


def test_prefix_hit_sets_computed_tokens_and_shares_exact_blocks():
    h = Harness(num_blocks=12)
    shared = prompt(1, 10)
    h.add("a", shared)
    assert tables(h.step()) == {0: (0, 1, 2)}  # blocks 0 and 1 are full and now cached
    b = h.add("b", shared[:8] + [900, 901, 902])
    c = h.add("c", shared[:8])  # fully cached: its last block is recomputed for logits
    out = h.step()
    assert out.scheduled[1:] == (
        ScheduledSequence("b", 1, (900, 901, 902), 8, ((0, 1, 3),), True, ends_prompt=True, full_length=11 + 100),
        ScheduledSequence("c", 2, tuple(shared[4:8]), 4, ((0, 4),), True, ends_prompt=True, full_length=8 + 100),
    )
    assert (b.num_cached_prompt_tokens, c.num_cached_prompt_tokens) == (8, 4)
    assert [h.kv.pool.blocks[i].ref_count for i in range(5)] == [3, 2, 1, 1, 1]
    usage = h.kv.usage()
    assert (usage.prefix_query_tokens, usage.prefix_hit_tokens) == (10 + 11 + 8, 8 + 4)


def test_prefix_caching_off_recomputes_everything():
    h = Harness(num_blocks=12, enable_prefix_caching=False)
    h.add("a", prompt(1, 10))
    h.step()
    b = h.add("b", prompt(1, 10))
    assert rows(h.step())[1] == ("b", 10, 0, True)
    assert b.num_cached_prompt_tokens == 0


# ----- preemption -----


def _fill_two(h: Harness) -> tuple[Request, Request]:
    """a and b, 12-token prompts, decoded until both hold 4 full blocks of an 8-block cache."""
    a = h.add("a", prompt(1, 12), max_tokens=7)
    b = h.add("b", prompt(2, 12), max_tokens=7)
    outs = [h.step() for _ in range(5)]
    assert [rows(o) for o in outs[1:]] == [[("a", 1, n, True), ("b", 1, n, True)] for n in (12, 13, 14, 15)]
    assert tables(outs[-1]) == {0: (0, 1, 2, 6), 1: (3, 4, 5, 7)}
    assert used_blocks(h) == 8 and a.seqs[0].num_tokens == b.seqs[0].num_tokens == 17
    return a, b


def test_recompute_preempts_the_latest_arrival_and_later_recomputes_all_its_tokens():
    h = Harness(num_blocks=8, enable_prefix_caching=False)
    a, b = _fill_two(h)
    b_tokens = list(b.seqs[0].token_ids)
    h.add("c", prompt(3, 2))  # would fit once b's blocks are free, but not in a step that preempted
    out = h.step()
    assert rows(out) == [("a", 1, 16, True)]
    assert tables(out) == {0: (0, 1, 2, 6, 7)}  # a reuses b's freed tail block
    assert out.preempted == ("b",) and h.sched.num_preemptions == 1
    assert not out.blocks_to_swap_out
    assert b.status is RequestStatus.WAITING and [r.request_id for r in h.sched.waiting] == ["b", "c"]
    assert 1 not in h.kv and b.seqs[0].num_computed_tokens == 0
    assert h.kv.pool.free_block_ids() == [5, 4, 3]  # freed back to front
    assert b.seqs[0].token_ids == b_tokens  # generated tokens are kept, to be recomputed

    out = h.step()  # b needs 5 blocks, 3 are free: a alone decodes its last token and finishes
    assert rows(out) == [("a", 1, 17, True)] and h.finished == ["a"]
    out = h.step()
    expected = ScheduledSequence(
        "b", 1, tuple(b_tokens), 0, ((5, 4, 3, 7, 6),), True, ends_prompt=True, full_length=12 + 7
    )
    assert out.scheduled[0] == expected
    assert rows(out) == [("b", 17, 0, True), ("c", 2, 0, True)]
    h.run()
    assert h.finished == ["a", "b", "c"] and b.seqs[0].num_tokens == 12 + 7
    assert used_blocks(h) == 0


def test_recompute_with_prefix_caching_resumes_from_the_cached_prompt_blocks():
    h = Harness(num_blocks=8)
    a, b = _fill_two(h)
    h.step()  # preempts b; a takes b's block 7, evicting the hash of b's tokens 12..15
    h.step()  # a finishes
    b_tokens = list(b.seqs[0].token_ids)
    out = h.step()
    expected = ScheduledSequence(
        "b", 1, tuple(b_tokens[12:]), 12, ((3, 4, 5, 7, 6),), True, ends_prompt=True, full_length=12 + 7
    )
    assert out.scheduled[0] == expected
    assert b.num_cached_prompt_tokens == 0  # not a prompt hit: b had generated tokens already


def test_the_victim_is_the_latest_arrival_not_the_next_in_line():
    h = Harness(num_blocks=6)
    for i, rid in enumerate("abc"):
        h.add(rid, prompt(i, 8))
    h.step()  # 2 blocks each: the cache is full
    out = h.step()  # a needs a block first: c, the latest, goes, and b keeps running
    assert out.preempted == ("c",)
    assert rows(out) == [("a", 1, 8, True), ("b", 1, 8, True)]
    assert tables(out) == {0: (0, 1, 5), 1: (2, 3, 4)}  # c's blocks, freed back to front
    assert [r.request_id for r in h.sched.waiting] == ["c"]


def test_swap_preempts_to_host_and_swaps_back_when_blocks_free():
    h = Harness(num_blocks=8, num_host_blocks=8, preemption_mode="swap")
    a, b = _fill_two(h)
    h.add("c", prompt(3, 2))
    out = h.step()
    assert rows(out) == [("a", 1, 16, True)]
    assert out.blocks_to_swap_out == ((3, 0), (4, 1), (5, 2), (7, 3))
    assert out.preempted == ("b",) and h.sched.num_preemptions == 1
    assert b.status is RequestStatus.SWAPPED and list(h.sched.swapped) == [b]
    assert h.kv.is_swapped(1) and b.seqs[0].num_computed_tokens == 16  # nothing to recompute
    assert [r.request_id for r in h.sched.waiting] == ["c"]  # not admitted in a step that preempted
    assert h.kv.usage().host_used_blocks == 4

    out = h.step()  # b needs 4 blocks + 1 for its next token; 3 free. c arrived later: it waits too
    assert rows(out) == [("a", 1, 17, True)] and not out.blocks_to_swap_in
    out = h.step()
    assert out.blocks_to_swap_in == ((0, 5), (1, 4), (2, 3), (3, 7))
    expected = ScheduledSequence(
        "b", 1, (b.seqs[0].token_ids[16],), 16, ((5, 4, 3, 7, 6),), True, ends_prompt=True, full_length=12 + 7
    )
    assert out.scheduled[0] == expected
    assert rows(out) == [("b", 1, 16, True), ("c", 2, 0, True)]
    assert b.status is RequestStatus.RUNNING and h.kv.usage().host_used_blocks == 0
    h.run()
    assert h.finished == ["a", "b", "c"] and used_blocks(h) == 0


def test_swap_without_host_room_falls_back_to_recompute():
    h = Harness(num_blocks=8, num_host_blocks=3, preemption_mode="swap")
    a, b = _fill_two(h)
    out = h.step()
    assert out.preempted == ("b",) and not out.blocks_to_swap_out
    assert b.status is RequestStatus.WAITING and b.seqs[0].num_computed_tokens == 0


def test_a_request_that_outgrows_the_whole_cache_is_rejected_in_swap_mode_too():
    """Swapping out a request larger than the device pool would swap it back in and out forever."""
    for mode in ("recompute", "swap"):
        h = Harness(num_blocks=3, num_host_blocks=8, preemption_mode=mode)
        a = h.add("a", prompt(1, 10), max_tokens=10)  # 12 slots fit, the 13th token does not
        h.run(max_steps=20)
        assert h.rejected == ["a"] and h.finished == ["a"], mode
        assert a.seqs[0].num_tokens == 13
        assert used_blocks(h) == 0 and h.kv.usage().host_used_blocks == 0


def test_preempting_a_request_with_a_half_done_copy_on_write_swaps_out_the_source():
    """b's first sequence copies on write into the last free block, its second finds none: b
    preempts itself. The swap must not save the copy's target, which the runner copies only after
    the swap-out (the store check in the harness reads the swapped-back blocks)."""
    h = Harness(num_blocks=6, num_host_blocks=12, preemption_mode="swap")
    h.add("a", prompt(1, 8), max_tokens=3)  # 2 blocks, a third at its 9th slot
    b = h.add("b", prompt(2, 6), max_tokens=2, n=3)  # 2 blocks, the last one partial and shared
    h.step()
    assert len(b.seqs) == 3 and used_blocks(h) == 4
    out = h.step()
    assert rows(out) == [("a", 1, 8, True)]
    assert out.preempted == ("b",)
    assert all(dst != device for _, dst in out.blocks_to_copy for device, _ in out.blocks_to_swap_out)
    h.run()
    assert h.finished == ["a", "b"] and not h.rejected
    assert [s.num_tokens for s in b.seqs] == [8, 8, 8]


def test_swapped_forked_request_that_fits_only_shared_is_resumed_not_crashed():
    """Swapping copies each sequence's blocks on its own, so a forked request can take more device
    blocks after a swap than before it. It must come back (by recompute) rather than half swap in."""
    for mode in ("recompute", "swap"):
        h = Harness(num_blocks=10, num_host_blocks=16, preemption_mode=mode)
        h.add("a", prompt(1, 4), max_tokens=10)
        b = h.add("b", prompt(2, 12), max_tokens=10, n=2)  # 3 shared prompt blocks + 3 per sequence
        h.run(max_steps=100)
        assert h.sched.num_preemptions == 1, mode
        assert h.finished == ["a", "b"] and not h.rejected, mode
        assert [s.num_tokens for s in b.seqs] == [22, 22], mode
        assert used_blocks(h) == 0 and h.kv.usage().host_used_blocks == 0


# ----- rejection, copy-on-write, finishing -----


def test_request_larger_than_the_whole_cache_is_rejected_and_the_next_admitted():
    h = Harness(num_blocks=8)
    h.add("big", prompt(1, 33))  # 9 blocks of 4 > 8
    h.add("b", prompt(2, 4))
    out = h.step()
    assert out.rejected == ("big",)
    assert rows(out) == [("b", 4, 0, True)]
    assert not h.sched.waiting and used_blocks(h) == 1


def test_append_after_fork_copies_the_shared_partial_block():
    h = Harness(num_blocks=12)
    a = h.add("a", prompt(1, 6))
    h.step()
    seq0 = a.seqs[0]
    seq0.token_ids.pop()  # fork from the prompt, as the engine does before appending samples
    child = h.fork(a, seq0)
    seq0.token_ids.append(fake_token(seq0))
    child.token_ids.append(fake_token(child))
    assert h.kv.block_table(1) == [0, 1] and h.kv.pool.blocks[1].ref_count == 2
    out = h.step()
    assert out.blocks_to_copy == ((1, 2),)
    assert rows(out) == [("a", 1, 6, True), ("a", 1, 6, True)]
    assert tables(out) == {0: (0, 2), 1: (0, 1)}
    assert [h.kv.pool.blocks[i].ref_count for i in range(3)] == [2, 1, 1]
    assert h.step().blocks_to_copy == ()  # each sequence now writes its own last block


def test_finish_frees_blocks_from_every_queue():
    h = Harness(num_blocks=8, num_host_blocks=8, preemption_mode="swap")
    a, b = _fill_two(h)
    c = h.add("c", prompt(3, 2))
    h.step()  # b swapped out, c waiting
    assert used_blocks(h) == 5 and h.kv.usage().host_used_blocks == 4
    for request in (b, c, a):
        h.sched.finish(request)
        assert request.status is RequestStatus.FINISHED
        assert all(s.seq_id not in h.kv for s in request.seqs)
    assert used_blocks(h) == 0 and h.kv.usage().host_used_blocks == 0
    assert not h.sched.has_unfinished()
    assert h.sched.schedule().empty


# ----- stress -----


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_runs_to_completion(mode, seed):
    rng = random.Random(seed)
    num_blocks, max_tokens_budget, max_seqs = 16, 12, 6
    h = Harness(num_blocks, num_host_blocks=24, preemption_mode=mode,
                max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens_budget)  # fmt: skip
    wanted: dict[str, tuple[int, int]] = {}  # request -> (n, max_tokens)
    pending = []
    for i in range(30):
        n = rng.choice([1, 1, 1, 2, 3])
        length = rng.randint(2, BLOCK * (num_blocks // n))  # prompt + output: n unshared copies fit
        max_tokens = rng.randint(1, length - 1)
        shared = rng.random() < 0.3  # some prompts start with a common prefix: prefix hits
        tokens = (prompt(99, 8) if shared else []) + prompt(i, length - max_tokens)
        tokens = tokens[: length - max_tokens]
        pending.append((rng.randint(0, 40), f"r{i}", tokens, max_tokens, n))
        wanted[f"r{i}"] = (n, max_tokens)
    pending.sort(key=lambda p: p[0])
    step = 0
    while pending or h.sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, tokens, max_tokens, n = pending.pop(0)
            h.add(rid, tokens, max_tokens=max_tokens, n=n)
        out = h.step()
        step += 1
        assert step < 2000, "no progress"
        assert out.num_batched_tokens <= max_tokens_budget
        assert len(out.scheduled) <= max_seqs
        assert sum(len(r.live_seqs) for r in h.sched.running) <= max_seqs
        assert len({s.seq_id for s in out.scheduled}) == len(out.scheduled)
        assert not (out.preempted and set(out.preempted) & {s.request_id for s in out.scheduled})
    assert sorted(h.finished) == sorted(wanted) and len(h.finished) == len(wanted)
    assert not h.rejected
    for rid, (n, max_tokens) in wanted.items():
        request = h.requests[rid]
        assert len(request.seqs) == n
        assert [len(s.output_token_ids) for s in request.seqs] == [max_tokens] * n
    usage = h.kv.usage()
    assert (usage.free_blocks, usage.host_used_blocks, usage.num_sequences) == (num_blocks, 0, 0)
    if mode == "swap":
        assert h.sched.num_preemptions > 0
