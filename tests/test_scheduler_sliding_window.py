"""Scheduler with a sliding-window KV group, exactly: released blocks, chunked prefill, admission by real need.

The harness of ``test_scheduler.py`` with two KV groups over one pool of 4-token blocks: group 0 global,
group 1 a window of 8 tokens (a query at p sees p-7..p). The simulated runner writes every group through
its own table and checks that each scheduled sequence reads back its context where each group sees it:
all of it in group 0, the window of the step's first query in group 1.
"""

from __future__ import annotations

import random

import pytest

from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.core.step import SchedulerOutput
from kvserve.kv import KVCacheManager, KVGroupSpec
from tests.test_scheduler import BLOCK, Harness, prompt, rows

WINDOW = 8


class WindowHarness(Harness):
    def __init__(self, num_blocks: int, window: int | None = WINDOW, num_host_blocks: int = 0, **config: object):
        super().__init__(num_blocks, num_host_blocks, **config)
        groups = (KVGroupSpec((0,)), KVGroupSpec((1,), sliding_window=window))
        self.kv = KVCacheManager(num_blocks, BLOCK, groups, num_host_blocks=num_host_blocks)
        self.sched = Scheduler(SchedulerConfig(**config), self.kv)
        self.window = window

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.store.move(out)
        for s in out.scheduled:
            seq = self.seqs[s.seq_id][1]
            start = s.num_computed_tokens
            for g, table in enumerate(s.block_tables):
                first = max(0, start - self.window + 1) if g == 1 and self.window else 0
                self.kv.slots(s.seq_id, first, start + len(s.token_ids), g)  # raises for a released entry
                seen = [
                    self.store.device.get(table[p // BLOCK], [None] * BLOCK)[p % BLOCK] for p in range(first, start)
                ]
                assert seen == [(g, t) for t in seq.token_ids[first:start]], (s.request_id, g)
                self.store.write(table, start, tuple((g, t) for t in s.token_ids))
            seq.num_computed_tokens += len(s.token_ids)
            self.kv.cache_full_blocks(seq.seq_id, seq.token_ids[: seq.num_computed_tokens])
        for s in out.scheduled:
            if s.samples:
                self._sample(*self.seqs[s.seq_id])
        for request_id in out.rejected:
            self.rejected.append(request_id)
            self._finish(self.requests[request_id])
        return out


def window_tables(out: SchedulerOutput) -> dict[str, tuple[int, ...]]:
    return {s.request_id: s.block_tables[1] for s in out.scheduled}


def global_tables(out: SchedulerOutput) -> dict[str, tuple[int, ...]]:
    return {s.request_id: s.block_tables[0] for s in out.scheduled}


def held(h: WindowHarness, seq_id: int) -> int:
    return len(h.kv.held_blocks(seq_id))


# ----- releasing and chunking -----


def test_a_decoding_request_holds_only_the_window_blocks_it_still_sees():
    h = WindowHarness(16)
    h.add("a", prompt(1, 8), max_tokens=20)
    out = h.step()
    assert (global_tables(out), window_tables(out)) == ({"a": (0, 1)}, {"a": (2, 3)})
    tables = []
    for _ in range(18):
        out = h.step()
        tables.append((out.scheduled[0].num_computed_tokens, window_tables(out)["a"]))
    assert tables[2:5] == [(10, (2, 3, 5)), (11, (0, 3, 5)), (12, (0, 3, 5, 7))]  # the query at 11 sees 4..11
    assert tables[-1] == (25, (0, 0, 0, 0, 9, 11, 13))
    assert global_tables(out)["a"] == (0, 1, 4, 6, 8, 10, 12)
    assert h.kv.pool.free_block_ids() == [14, 15, 2, 3, 5, 7]  # released window blocks went back to the pool
    h.run()
    assert h.finished == ["a"] and used_blocks_of(h) == 0


def used_blocks_of(h: WindowHarness) -> int:
    return h.kv.usage().used_blocks


def test_chunked_prefill_holds_the_window_and_one_chunk():
    h = WindowHarness(24, max_num_batched_tokens=8)
    h.add("a", prompt(1, 40), max_tokens=2)
    steps = []
    for _ in range(5):
        out = h.step()
        steps.append((rows(out)[0][1:3], window_tables(out)["a"], held(h, 0)))
    assert global_tables(out)["a"] == tuple(range(10))  # the global group got the whole prompt at admission
    assert steps == [
        ((8, 0), (10, 11), 10 + 2),  # the window group gets only the first chunk's blocks
        ((8, 8), (10, 11, 12, 13), 10 + 4),
        ((8, 16), (0, 0, 12, 13, 14, 15), 10 + 4),  # the query at 16 sees 9..16
        ((8, 24), (0, 0, 0, 0, 14, 15, 16, 17), 10 + 4),
        ((8, 32), (0, 0, 0, 0, 0, 0, 16, 17, 18, 19), 10 + 4),
    ]
    h.run()
    assert h.finished == ["a"] and used_blocks_of(h) == 0


# ----- admission -----


def test_admission_counts_each_groups_real_need():
    """16 blocks, 8-token steps: a 40-token prompt needs 10 global blocks and at most 5 in its window
    group; with two global groups it would need 20 and is rejected."""
    for window, rejected in [(WINDOW, ["big"]), (None, ["big", "long"])]:
        h = WindowHarness(16, window=window, max_num_batched_tokens=8)
        h.add("big", prompt(1, 48), max_tokens=1)  # 12 + 5 > 16: never
        h.add("long", prompt(2, 40), max_tokens=1)
        h.add("c", prompt(3, 20), max_tokens=1)  # its first step needs 5 + 2 blocks
        out = h.step()
        assert out.rejected == tuple(rejected)
        if window:
            assert rows(out) == [("long", 8, 0, False)] and used_blocks_of(h) == 10 + 2
            assert [r.request_id for r in h.sched.waiting] == ["c"]  # 4 free blocks: later
            outs = [h.step() for _ in range(5)]
            assert [rows(o)[0][0] for o in outs] == ["long"] * 4 + ["c"]
        h.run()
        assert h.finished == ["big", "long", "c"] and h.rejected == rejected


def test_many_long_sequences_fit_concurrently_with_a_window_group():
    """Ten requests growing to 40 tokens in 130 blocks: with two global groups each needs 2 x 10 blocks,
    so 6 run to the end together and 4 are preempted; with a window group each needs 10 + 3."""
    together = {}
    for window in (None, WINDOW):
        h = WindowHarness(130, window=window)
        for i in range(10):
            h.add(f"r{i}", prompt(i, 8), max_tokens=32)
        finishing = []
        while h.sched.has_unfinished():
            before = len(h.finished)
            h.step()
            finishing.append(len(h.finished) - before)
        together[window] = (next(n for n in finishing if n), h.sched.num_preemptions)
    assert together == {None: (6, 4), WINDOW: (10, 0)}


def test_blocks_a_later_sequence_no_longer_sees_serve_an_earlier_one_in_the_same_step():
    """Window of 4: a needs two blocks (one per group) for token 8 with one free; b's window releases
    block 3 at this step. Released before anyone grows, it serves a, and nobody is preempted."""
    h = WindowHarness(8, window=4)
    h.add("a", prompt(1, 4), max_tokens=6)
    h.add("b", prompt(2, 3), max_tokens=6)
    for _ in range(5):
        h.step()
    assert h.kv.pool.free_block_ids() == [1]
    out = h.step()
    assert rows(out) == [("a", 1, 8, True), ("b", 1, 7, True)] and not out.preempted
    assert global_tables(out) == {"a": (0, 4, 1), "b": (2, 6)}
    assert window_tables(out) == {"a": (0, 5, 3), "b": (0, 7)}
    assert h.finished == ["a", "b"] and h.sched.num_preemptions == 0


# ----- preemption -----


def test_recompute_resumes_from_a_hit_whose_out_of_window_block_was_evicted():
    h = WindowHarness(12)
    h.add("a", prompt(1, 12), max_tokens=2)
    b = h.add("b", prompt(2, 12), max_tokens=3)
    out = h.step()
    assert (global_tables(out), window_tables(out)) == (
        {"a": (0, 1, 2), "b": (6, 7, 8)},
        {"a": (3, 4, 5), "b": (9, 10, 11)},
    )
    out = h.step()  # both need a block per group; the window released one each (blocks 3, 9): a takes them
    assert out.preempted == ("b",) and rows(out) == [("a", 1, 12, True)]
    assert (global_tables(out), window_tables(out)) == ({"a": (0, 1, 2, 3)}, {"a": (0, 4, 5, 9)})
    assert h.finished == ["a"] and b.seqs[0].num_computed_tokens == 0
    # b's window block 9 (tokens 0-3) was reused; the query at 12 sees tokens 5..12 only (blocks 10, 11).
    out = h.step()
    assert rows(out) == [("b", 1, 12, True)]
    assert (global_tables(out), window_tables(out)) == ({"b": (6, 7, 8, 3)}, {"b": (0, 10, 11, 2)})
    h.run()
    assert h.finished == ["a", "b"] and used_blocks_of(h) == 0


def test_swap_moves_only_the_window_blocks_still_seen():
    h = WindowHarness(12, num_host_blocks=16, preemption_mode="swap")
    h.add("a", prompt(1, 12), max_tokens=10)
    b = h.add("b", prompt(2, 12), max_tokens=10)
    h.step()
    out = h.step()
    assert out.preempted == ("b",) and h.kv.is_swapped(1)
    assert out.blocks_to_swap_out == ((6, 0), (7, 1), (8, 2), (10, 3), (11, 4))  # not window block 9
    assert h.kv.usage().host_used_blocks == 5
    outs = [h.step() for _ in range(9)]
    assert h.finished == ["a"] and outs[-1].blocks_to_swap_in == ((0, 10), (1, 4), (2, 5), (3, 6), (4, 8))
    assert rows(outs[-1]) == [("b", 1, 12, True)] and b.seqs[0].num_computed_tokens == 13
    assert (global_tables(outs[-1]), window_tables(outs[-1])) == ({"b": (10, 4, 5, 3)}, {"b": (0, 6, 8, 2)})
    h.run()
    assert h.finished == ["a", "b"] and used_blocks_of(h) == 0 and h.kv.usage().host_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("window", [1, 5, WINDOW])
@pytest.mark.parametrize("seed", range(3))
def test_random_workload_with_a_window_group_runs_to_completion(mode, window, seed):
    """Chunked prompts, shared prefixes, best_of forks, preemption: every step's reads are checked."""
    rng = random.Random(seed)
    num_blocks, budget = 24, 12
    h = WindowHarness(num_blocks, window=window, num_host_blocks=32, preemption_mode=mode,
                      max_num_seqs=6, max_num_batched_tokens=budget)  # fmt: skip
    wanted = {}
    pending = []
    for i in range(30):
        n = rng.choice([1, 1, 1, 2, 3])
        length = rng.randint(2, BLOCK * (num_blocks // n) // 2)  # n unshared copies fit even in two global groups
        max_tokens = rng.randint(1, length - 1)
        tokens = ((prompt(99, 8) if rng.random() < 0.3 else []) + prompt(i, length))[: length - max_tokens]
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
        assert out.num_batched_tokens <= budget
    assert sorted(h.finished) == sorted(wanted) and not h.rejected
    for rid, (n, max_tokens) in wanted.items():
        assert [len(s.output_token_ids) for s in h.requests[rid].seqs] == [max_tokens] * n
    usage = h.kv.usage()
    assert (usage.free_blocks, usage.host_used_blocks, usage.num_sequences) == (num_blocks, 0, 0)
