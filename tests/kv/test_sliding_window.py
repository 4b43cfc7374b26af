"""Sliding-window KV groups, exactly: released blocks, lazy chunks, admission, the window prefix-hit rule.

Tiny specs: blocks of 4 tokens, group 0 global (layer 0), group 1 a window of 6 tokens (layer 1), one
pool. A query at position p of group 1 sees tokens p-5..p, so at ``num_computed_tokens`` c every block
ending before c-5 can go; a prefix hit there needs the two blocks before the hit's end
(ceil((6 - 1) / 4) = 2) cached.
"""

from __future__ import annotations

import random

import pytest

from kvserve.kv import AllocationStatus, KVCacheError, KVCacheManager, KVGroupSpec

OK, LATER, NEVER = AllocationStatus.OK, AllocationStatus.LATER, AllocationStatus.NEVER
PROMPT = list(range(10))  # two full blocks and a partial one


def _groups(window: int = 6) -> tuple[KVGroupSpec, KVGroupSpec]:
    return KVGroupSpec((0,)), KVGroupSpec((1,), sliding_window=window)


def _manager(num_blocks: int = 12, window: int = 6, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=4, groups=_groups(window), **kwargs)


def _tables(m: KVCacheManager, seq_id: int) -> tuple[list[int], list[int]]:
    return m.block_table(seq_id, 0), m.block_table(seq_id, 1)


def _refs(m: KVCacheManager, ids: list[int]) -> list[int]:
    return [m.pool.blocks[i].ref_count for i in ids]


def _decode_to(m: KVCacheManager, seq_id: int, start: int, end: int) -> None:
    """Steps of one token from ``start`` computed tokens to ``end``, as the scheduler runs them."""
    for c in range(start, end):
        m.release_out_of_window(seq_id, c)
        assert m.reserve(seq_id, [c + 1, c + 1])


def _prefilled(m: KVCacheManager, seq_id: int, tokens: list[int]) -> None:
    """A prompt allocated, computed in one step and registered; its window then released."""
    m.allocate(seq_id, tokens)
    m.cache_full_blocks(seq_id, tokens)
    m.release_out_of_window(seq_id, len(tokens))


# ----- the group spec -----


@pytest.mark.parametrize("window", [0, -4, 2.5, True])
def test_sliding_window_must_be_a_positive_integer(window):
    with pytest.raises(ValueError, match=f"sliding_window must be an integer >= 1 or None, got {window!r}"):
        KVGroupSpec((0,), sliding_window=window)


# ----- releasing as a sequence grows -----


def test_window_blocks_are_released_as_the_sequence_decodes():
    m = _manager()
    assert m.allocate(0, PROMPT) == 0  # no step_tokens: every group gets the whole prompt
    assert _tables(m, 0) == ([0, 1, 2], [3, 4, 5])
    m.cache_full_blocks(0, PROMPT)
    assert m.release_out_of_window(0, 8) == 0  # the query at 8 sees 3..8
    assert m.release_out_of_window(0, 10) == 1  # the query at 10 sees 5..10: block 3 (tokens 0-3) is done
    assert m.release_out_of_window(0, 10) == 0  # idempotent
    assert _tables(m, 0) == ([0, 1, 2], [0, 4, 5])  # position-indexed: released entries read 0
    assert m.pool.free_block_ids() == [6, 7, 8, 9, 10, 11, 3]
    assert m.pool.blocks[3].block_hash is not None  # freed, still findable until evicted
    assert (m.num_slots(0, 0), m.num_slots(0, 1)) == (10, 10)
    _decode_to(m, 0, 10, 13)  # token 12 opens a block in each group; at 13 block 4 (tokens 4-7) goes
    m.release_out_of_window(0, 13)
    assert _tables(m, 0) == ([0, 1, 2, 6], [0, 0, 5, 7])
    assert m.pool.free_block_ids() == [8, 9, 10, 11, 3, 4]
    assert _refs(m, [3, 4, 5, 7]) == [0, 0, 1, 1]
    assert m.held_blocks(0) == [0, 1, 2, 6, 5, 7]
    assert m.block_tables(0) == ((0, 1, 2, 6), (0, 0, 5, 7))  # every group at once, as block_table gives them
    m.free(0)
    assert m.pool.num_free == 12 and m.usage().used_blocks == 0


def test_slots_of_released_tokens_are_refused():
    m = _manager()
    m.allocate(0, PROMPT)
    m.release_out_of_window(0, 10)
    assert m.slots(0, 4, 6, group=1) == [16, 17]  # block 4
    assert m.slots(0, 0, 2, group=0) == [0, 1]
    with pytest.raises(KVCacheError, match="token 3 is out of the sliding window; tokens before 4 were released"):
        m.slots(0, 3, 6, group=1)


def test_global_groups_keep_everything_and_a_window_of_one_keeps_no_full_block():
    m = _manager(window=1)
    m.allocate(0, list(range(8)))
    assert m.release_out_of_window(0, 8) == 2
    assert _tables(m, 0) == ([0, 1], [0, 0]) and m.held_blocks(0) == [0, 1]
    assert m.reserve(0, [9, 9]) and _tables(m, 0) == ([0, 1, 4], [0, 0, 5])
    with pytest.raises(ValueError, match="num_computed_tokens must be an integer >= 0, got -1"):
        m.release_out_of_window(0, -1)


# ----- lazy allocation: a window group holds a chunk, not the prompt -----


def test_chunked_prefill_holds_the_window_and_one_chunk():
    m = _manager(num_blocks=16)
    prompt = list(range(40))
    assert m.allocate(0, prompt, step_tokens=8) == 0
    assert _tables(m, 0) == (list(range(10)), [10, 11])  # the window group: the first chunk only
    assert (m.num_slots(0, 0), m.num_slots(0, 1)) == (40, 8)
    held, window_tables = [], []
    for c in range(0, 40, 8):
        m.release_out_of_window(0, c)
        assert m.reserve(0, [c + 8, c + 8])
        m.cache_full_blocks(0, prompt[: c + 8])
        window_tables.append(m.block_table(0, 1))
        held.append(len(m.held_blocks(0)) - 10)
    assert window_tables == [
        [10, 11],
        [10, 11, 12, 13],
        [0, 0, 12, 13, 14, 15],  # the chunk's first query (16) sees 11..16: blocks of tokens 0-7 go
        [0, 0, 0, 0, 14, 15, 11, 10],  # the freed blocks serve the next chunk
        [0, 0, 0, 0, 0, 0, 11, 10, 13, 12],
    ]
    assert held == [2, 4, 4, 4, 4]
    assert m.blocks_needed(40, step_tokens=8) == 10 + 4  # the peak: (window - 1 + chunk) tokens span 4 blocks


def test_an_8k_prompt_in_2k_chunks_holds_the_window_and_one_chunk():
    m = KVCacheManager(2000, 16, groups=[KVGroupSpec((5,)), KVGroupSpec((0,), sliding_window=512)])
    prompt = list(range(8192))
    m.allocate(0, prompt, step_tokens=2048)
    peak = 0
    for c in range(0, 8192, 2048):
        m.release_out_of_window(0, c)
        assert m.reserve(0, [c + 2048] * 2)
        m.cache_full_blocks(0, prompt[: c + 2048])
        peak = max(peak, len(m.held_blocks(0)) - 512)
    assert peak == 512 // 16 + 2048 // 16  # the window before the chunk, and the chunk
    assert m.blocks_needed(8192, step_tokens=2048) == 512 + 161  # the bound, for any alignment


def test_blocks_needed_per_group():
    m = _manager(num_blocks=64)
    assert m.blocks_needed(40) == 10 + 10  # all at once: the window group holds the whole prompt
    assert m.blocks_needed(40, step_tokens=1) == 10 + 3  # decoding: 6 tokens may straddle 3 blocks
    assert m.blocks_needed(40, step_tokens=8) == 10 + 4
    assert m.blocks_needed(6, step_tokens=8) == 2 + 2
    assert m.blocks_needed(40, step_tokens=8, num_shared=3) == 7 + 4  # shared blocks: global groups only
    assert KVCacheManager(64, 4).blocks_needed(40, step_tokens=8) == 10
    with pytest.raises(ValueError, match="step_tokens must be an integer >= 1 or None, got 0"):
        m.blocks_needed(40, step_tokens=0)


def test_admission_counts_each_groups_real_need():
    m = _manager(num_blocks=8)
    assert m.can_allocate(20, step_tokens=4) is OK  # first step: 5 global + 1 window block
    assert m.can_allocate(24, step_tokens=4) is NEVER  # its life: 6 global + 3 window > 8
    assert m.can_allocate(20) is NEVER  # in one step the window group needs the whole prompt too
    full = KVCacheManager(8, 4, groups=[KVGroupSpec((0,)), KVGroupSpec((1,))])
    assert full.can_allocate(20, step_tokens=4) is NEVER  # 2 x 5 blocks
    m.allocate(0, list(range(100, 106)), step_tokens=4)  # 2 global blocks + 1 window block
    assert m.pool.num_free == 5
    assert m.can_allocate(16, step_tokens=4) is OK  # 4 + 1
    assert m.can_allocate(20, step_tokens=4) is LATER  # 5 + 1
    assert m.can_allocate(17, step_tokens=4) is LATER  # 5 + 1: the lifetime (5 + 3) still fits the pool


def test_window_only_manager_and_errors():
    m = KVCacheManager(8, 4, groups=[KVGroupSpec(sliding_window=8)])
    assert m.can_allocate(400, step_tokens=4) is OK  # (8 - 1 + 4) tokens span at most 4 blocks
    m.allocate(-1, list(range(8)))
    with pytest.raises(KVCacheError, match="sliding window .* need keep_window=True"):
        m.allocate(1, list(range(10)), shared=m.block_table(-1)[:1])
    with pytest.raises(KVCacheError, match="KV group 0 has a sliding window; only groups without one can shrink"):
        m.shrink(-1, 0, 4)


# ----- prefix caching: vLLM's window hit rule -----


def test_hit_takes_only_the_window_blocks_of_the_cached_prefix():
    m = _manager()
    prompt = list(range(24))  # 6 full blocks per group
    m.allocate(0, prompt, step_tokens=24)
    assert _tables(m, 0) == ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])
    m.cache_full_blocks(0, prompt)
    m.release_out_of_window(0, 24)  # the query at 24 sees 19..24: window blocks 6-9 go, back to front
    assert m.block_table(0, 1) == [0, 0, 0, 0, 10, 11] and m.pool.free_block_ids() == [9, 8, 7, 6]
    follow_up = prompt + [90, 91]
    assert m.cached_prefix_tokens(follow_up) == 24
    assert m.can_allocate(26, follow_up, step_tokens=4) is OK  # 1 new block per group
    assert m.allocate(1, follow_up, step_tokens=4) == 24
    # The window group takes blocks 10, 11 (tokens 16-23, seen by the query at 24); 6-9 stay free and cached.
    assert _tables(m, 1) == ([0, 1, 2, 3, 4, 5, 9], [0, 0, 0, 0, 10, 11, 8])
    assert _refs(m, [0, 5, 6, 7, 10, 11]) == [2, 2, 0, 0, 2, 2]
    assert m.pool.free_block_ids() == [7, 6]
    assert all(m.pool.blocks[b].block_hash is not None for b in (6, 7))
    assert (m.usage().prefix_query_tokens, m.usage().prefix_hit_tokens) == (24 + 26, 24)


def test_hit_is_cut_by_evicted_window_blocks_though_the_global_chain_is_held():
    m = _manager(num_blocks=16)
    prompt = list(range(24))
    _prefilled(m, 0, prompt)  # sequence 0 keeps running: it holds global blocks 0-5
    assert m.pool.free_block_ids() == [12, 13, 14, 15, 9, 8, 7, 6]  # window entries 3..0, released
    query = prompt[:12] + [1]  # a hit of at most 3 blocks
    assert m.cached_prefix_tokens(query) == 12  # the query at 12 sees 7..12: window entries 1, 2 (blocks 7, 8)
    m.allocate(5, [5])  # takes 12 and 13
    assert m.reserve(5, [13, 1])  # sequence 5's global group takes 14, 15 and evicts 9 (entry 3)
    assert m.cached_prefix_tokens(query) == 12  # entry 3 is past the hit: no matter
    assert m.reserve(5, [17, 1]) and m.pool.lookup(m._seqs[0].tables[1].hashes[2]) is None  # evicts 8
    assert m.cached_prefix_tokens(query) == 8  # at 12 entry 2 is gone; at 8 the window needs entries 0, 1
    assert m.reserve(5, [21, 1])  # evicts 7
    assert m.cached_prefix_tokens(query) == 4  # at 4 the window needs entry 0 only
    assert m.reserve(5, [25, 1])  # evicts 6
    assert m.cached_prefix_tokens(query) == 0
    m.free(5)
    assert m.allocate(1, query, step_tokens=4) == 0 and _refs(m, [0, 1, 2]) == [1, 1, 1]


# ----- fork, copy-on-write, swapping, usage -----


def test_fork_shares_held_blocks_and_copies_the_partial_window_block_on_write():
    m = _manager()
    m.allocate(0, PROMPT)
    m.release_out_of_window(0, 10)
    m.fork(0, 1)
    assert _tables(m, 1) == ([0, 1, 2], [0, 4, 5])
    assert _refs(m, [0, 1, 2, 3, 4, 5]) == [2, 2, 2, 0, 2, 2]  # the released block is nobody's
    assert m.reserve(1, [11, 11])
    assert m.take_pending_copies() == [(2, 6), (5, 7)]
    assert _tables(m, 1) == ([0, 1, 6], [0, 4, 7]) and _tables(m, 0) == ([0, 1, 2], [0, 4, 5])
    _decode_to(m, 1, 11, 13)  # at 13 the child's window drops block 4; the parent still holds it
    m.release_out_of_window(1, 13)
    assert _tables(m, 1) == ([0, 1, 6, 8], [0, 0, 7, 9]) and _refs(m, [4, 5]) == [1, 1]
    m.free(0)
    m.free(1)
    assert m.pool.num_free == 12


def test_swap_plans_move_only_held_blocks():
    m = _manager(num_host_blocks=6)
    m.allocate(0, PROMPT)
    m.cache_full_blocks(0, PROMPT)
    m.release_out_of_window(0, 10)
    assert m.can_swap_out(0) is OK
    assert m.swap_out(0) == [(0, 0), (1, 1), (2, 2), (4, 3), (5, 4)]
    assert m.usage().host_used_blocks == 5
    assert m.pool.free_block_ids() == [6, 7, 8, 9, 10, 11, 3, 2, 1, 0, 5, 4]
    assert m.swap_in(0) == [(0, 6), (1, 7), (2, 8), (3, 9), (4, 10)]
    assert _tables(m, 0) == ([6, 7, 8], [0, 9, 10]) and m.usage().host_used_blocks == 0


def test_usage_does_not_count_released_blocks():
    m = _manager(num_host_blocks=6)
    m.allocate(0, PROMPT)
    m.release_out_of_window(0, 10)
    usage = m.usage()
    assert (usage.used_blocks, usage.free_blocks, usage.waste_slots) == (5, 7, (12 - 10) + (12 - 10))
    m.swap_out(0)
    assert (m.usage().used_blocks, m.usage().host_used_blocks, m.usage().waste_slots) == (0, 5, 0)


# ----- seeded random operations -----


def _window_reads_back(m: KVCacheManager, device: dict, seq_id: int, tokens: list[int], window: int) -> None:
    for g, spec in enumerate(m.groups):
        table = m.block_table(seq_id, g)
        first = 0 if spec.sliding_window is None else max(0, len(tokens) - window + 1)  # the next query's view
        seen = [device[table[p // 4]][p % 4] for p in range(first, len(tokens))]
        assert seen == [(g, t) for t in tokens[first:]]


@pytest.mark.parametrize("window", [1, 5, 8])
@pytest.mark.parametrize("seed", range(4))
def test_random_chunks_forks_and_swaps_read_back_their_window(seed, window):
    """Sequences grow in chunks (prompt tokens first, then new ones), fork, swap and free at random; the
    test plays the runner, and every table must read back its tokens where its window sees them."""
    rng = random.Random(seed)
    m = _manager(num_blocks=24, window=window, num_host_blocks=16)
    device: dict[int, list] = {}
    host: dict[int, list] = {}
    seqs: dict[int, tuple[list[int], int]] = {}  # seq id -> (its tokens, how many are computed)
    next_id = 0

    def compute(seq_id: int, n: int) -> None:
        tokens, done = seqs[seq_id]
        m.release_out_of_window(seq_id, done)
        tokens += [rng.randrange(4) for _ in range(done + n - len(tokens))]
        if not m.reserve(seq_id, [done + n] * 2):
            return
        for src, dst in m.take_pending_copies():
            device[dst] = list(device[src])
        for g in range(2):
            table = m.block_table(seq_id, g)
            for p in range(done, done + n):
                device.setdefault(table[p // 4], [None] * 4)[p % 4] = (g, tokens[p])
        m.cache_full_blocks(seq_id, tokens[: done + n])
        seqs[seq_id] = (tokens, done + n)

    for _ in range(300):
        resident = [s for s in seqs if not m.is_swapped(s)]
        op = rng.choice(["allocate"] * 2 + ["compute"] * 3 + ["fork", "free", "free", "swap_out", "swap_in"])
        if op == "allocate":
            prompt = [rng.randrange(2)] * rng.randrange(0, 13) + [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
            step = rng.randint(1, 8)
            if m.can_allocate(len(prompt), prompt, step_tokens=step) is OK:
                seqs[next_id] = (prompt, m.allocate(next_id, prompt, step_tokens=step))
                compute(next_id, min(step, len(prompt) - seqs[next_id][1]))  # within what allocate gave
                assert seqs[next_id][1] > 0
                next_id += 1
        elif op == "compute" and resident:
            compute(rng.choice(resident), rng.randint(1, 6))
        elif op == "fork" and resident:
            parent = rng.choice(resident)
            m.fork(parent, next_id)
            seqs[next_id] = (list(seqs[parent][0]), seqs[parent][1])
            next_id += 1
        elif op == "free" and seqs:
            seq_id = rng.choice(list(seqs))
            m.free(seq_id)
            del seqs[seq_id]
        elif op == "swap_out" and resident:
            seq_id = rng.choice(resident)
            if m.can_swap_out(seq_id) is OK:
                for dev, slot in m.swap_out(seq_id):
                    host[slot] = list(device.get(dev, [None] * 4))  # a chunk's blocks may be unwritten
        elif op == "swap_in" and len(resident) < len(seqs):
            seq_id = rng.choice([s for s in seqs if m.is_swapped(s)])
            if m.can_swap_in(seq_id) is OK:
                for slot, dev in m.swap_in(seq_id):
                    device[dev] = list(host.get(slot, [None] * 4))
        held = [0] * 24
        for seq_id, (tokens, done) in seqs.items():
            if not m.is_swapped(seq_id):
                _window_reads_back(m, device, seq_id, tokens[:done], window)
                for block in m.held_blocks(seq_id):
                    held[block] += 1
        assert [b.ref_count for b in m.pool.blocks] == held
        assert sorted(m.pool.free_block_ids()) == [i for i, r in enumerate(held) if r == 0]
    assert m.usage().prefix_hit_tokens > 0
