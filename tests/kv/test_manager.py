"""KVCacheManager, exactly: block ids, ref counts, free-queue order, prefix hits, copy-on-write, swaps.

Tiny specs after vLLM's CPU-only ``tests/v1/core/test_prefix_caching.py``: 10 blocks of 4 tokens.
"""

from __future__ import annotations

import pytest

from kvserve.kv import AllocationStatus, KVCacheError, KVCacheManager, KVGroupSpec, NoFreeBlocksError

OK, LATER, NEVER = AllocationStatus.OK, AllocationStatus.LATER, AllocationStatus.NEVER
PROMPT = list(range(10))  # two full blocks and a partial one


def _manager(num_blocks: int = 10, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=4, **kwargs)


def _refs(m: KVCacheManager, ids: list[int]) -> list[int]:
    return [m.pool.blocks[i].ref_count for i in ids]


def _cached(m: KVCacheManager, seq_id: int, tokens: list[int]) -> None:
    """Allocate a prompt and register its full blocks, as the scheduler does once the prefill ran."""
    m.allocate(seq_id, tokens)
    m.cache_full_blocks(seq_id, tokens)


# ----- allocation and prefix caching -----


def test_allocate_fresh_prompt():
    m = _manager()
    assert m.allocate(0, PROMPT) == 0
    assert m.block_table(0) == [0, 1, 2] and m.num_slots(0) == 10
    assert _refs(m, [0, 1, 2]) == [1, 1, 1]
    assert m.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9]


def test_second_request_hits_the_shared_prefix_blocks():
    m = _manager()
    _cached(m, 0, PROMPT)
    assert m.cached_prefix_tokens(PROMPT[:8] + [100, 101, 102]) == 8
    assert m.allocate(1, PROMPT[:8] + [100, 101, 102]) == 8
    assert m.block_table(1) == [0, 1, 3]
    assert _refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]


def test_fully_cached_prompt_recomputes_its_last_block():
    m = _manager()
    prompt = list(range(8))
    _cached(m, 0, prompt)
    assert m.allocate(1, prompt) == 4  # block 1 is cached too, but the last token needs logits
    assert m.block_table(1) == [0, 2]
    m.cache_full_blocks(1, prompt)
    assert m.pool.blocks[2].block_hash is None  # a duplicate of block 1: block 1 keeps serving hits
    assert m.allocate(2, prompt + [8]) == 8
    assert m.block_table(2) == [0, 1, 3]


def test_same_block_tokens_after_a_different_parent_do_not_hit():
    m = _manager()
    _cached(m, 0, [1, 2, 3, 4, 5, 6, 7, 8])
    assert m.allocate(1, [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    assert m.block_table(1) == [2, 3, 4]


def test_extra_salts_the_prefix():
    m = _manager()
    m.allocate(0, PROMPT, extra=("lora-a",))
    m.cache_full_blocks(0, PROMPT)
    assert m.cached_prefix_tokens(PROMPT) == 0
    assert m.cached_prefix_tokens(PROMPT, extra=("lora-a",)) == 8


def test_only_written_blocks_are_hashed():
    m = _manager()
    m.allocate(0, PROMPT)
    assert m.cached_prefix_tokens(PROMPT) == 0  # the prefill has not run yet
    m.cache_full_blocks(0, PROMPT[:5])  # first chunk of a chunked prefill
    assert m.cached_prefix_tokens(PROMPT) == 4
    m.cache_full_blocks(0, PROMPT)
    assert m.cached_prefix_tokens(PROMPT) == 8


def test_freed_blocks_stay_cached_and_tail_blocks_are_evicted_first():
    m = _manager()
    _cached(m, 0, PROMPT)
    m.free(0)
    assert m.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]  # back to front
    assert (m.usage().used_blocks, m.usage().cached_blocks) == (0, 2)
    assert m.allocate(1, PROMPT[:8] + [50]) == 8
    assert m.block_table(1) == [0, 1, 3]
    assert m.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]


def test_lru_eviction_drops_the_last_prefix_block_first():
    m = _manager()
    _cached(m, 0, PROMPT)
    m.free(0)
    m.allocate(1, list(range(100, 132)))  # 8 blocks: every uncached free block, then block 2
    assert m.block_table(1) == [3, 4, 5, 6, 7, 8, 9, 2]
    assert m.pool.free_block_ids() == [1, 0] and m.usage().cached_blocks == 2
    m.allocate(2, [200])
    assert m.block_table(2) == [1]
    assert m.cached_prefix_tokens(PROMPT) == 4 and m.usage().cached_blocks == 1


def test_can_allocate_statuses():
    m = _manager()
    assert m.can_allocate(41) is NEVER  # 11 blocks > 10
    assert m.can_allocate(40) is OK
    prompt = list(range(36))
    _cached(m, 0, prompt)  # 9 blocks, 1 free
    assert m.can_allocate(8) is LATER
    assert m.can_allocate(4) is OK
    shared = prompt[:8] + [7, 7, 7, 7]
    assert m.can_allocate(12) is LATER
    assert m.can_allocate(12, shared) is OK  # 2 of its 3 blocks are held by sequence 0 already
    with pytest.raises(NoFreeBlocksError, match="sequence 1 needs 2 free blocks; 1 of 10 are free"):
        m.allocate(1, [1] * 8)
    assert 1 not in m and m.pool.num_free == 1
    m.free(0)
    assert m.can_allocate(40, prompt + [1, 2, 3, 4]) is OK  # cached free blocks count as free


def test_usage_numbers():
    m = _manager(num_host_blocks=4)
    _cached(m, 0, PROMPT)
    assert m.allocate(1, PROMPT[:8] + [7]) == 8
    usage = m.usage()
    assert (usage.total_blocks, usage.used_blocks, usage.free_blocks, usage.cached_blocks) == (10, 4, 6, 0)
    assert (usage.host_total_blocks, usage.host_used_blocks, usage.num_sequences) == (4, 0, 2)
    assert usage.waste_slots == (12 - 10) + (12 - 9)
    assert (usage.prefix_query_tokens, usage.prefix_hit_tokens) == (19, 8)
    assert usage.usage == 0.4 and usage.prefix_hit_rate == 8 / 19
    m.free(0)
    assert (m.usage().used_blocks, m.usage().cached_blocks) == (3, 0)  # block 2 was partial: not cached
    m.free(1)
    assert (m.usage().used_blocks, m.usage().cached_blocks, m.usage().waste_slots) == (0, 2, 0)


# ----- append, fork, copy-on-write, free -----


def test_append_slots_grows_and_refuses_without_changing_anything():
    m = _manager(num_blocks=3)
    m.allocate(0, [1, 2, 3, 4])
    assert m.append_slots(0, 1) and m.block_table(0) == [0, 1]
    assert m.append_slots(0, 3) and m.block_table(0) == [0, 1] and m.num_slots(0) == 8
    assert not m.append_slots(0, 5)  # needs 2 blocks, 1 free
    assert m.block_table(0) == [0, 1] and m.num_slots(0) == 8
    assert m.append_slots(0, 4) and m.block_table(0) == [0, 1, 2] and m.num_slots(0) == 12
    assert m.append_slots(0, 0)
    with pytest.raises(ValueError, match="num_new_tokens must be an integer >= 0, got -1"):
        m.append_slots(0, -1)


def test_fork_then_append_copies_the_shared_partial_block_on_write():
    m = _manager()
    m.allocate(0, [1, 2, 3, 4, 5, 6])
    m.fork(0, 1)
    assert m.block_table(1) == [0, 1] and _refs(m, [0, 1]) == [2, 2]
    assert m.append_slots(1, 1)
    assert m.block_table(1) == [0, 2] and m.block_table(0) == [0, 1]
    assert m.take_pending_copies() == [(1, 2)]
    assert m.take_pending_copies() == []
    assert _refs(m, [0, 1, 2]) == [2, 1, 1]
    assert m.append_slots(0, 1)  # the parent now owns block 1 alone: writes in place
    assert m.block_table(0) == [0, 1] and m.take_pending_copies() == []
    assert m.append_slots(1, 2) and m.block_table(1) == [0, 2, 3] and m.take_pending_copies() == []
    assert (m.num_slots(0), m.num_slots(1)) == (7, 9)


def test_fork_with_a_full_last_block_needs_no_copy():
    m = _manager()
    m.allocate(0, list(range(8)))
    m.fork(0, 1)
    assert m.append_slots(1, 1) and m.block_table(1) == [0, 1, 2]
    assert m.take_pending_copies() == []


def test_copy_on_write_counts_the_copy_against_free_blocks():
    m = _manager(num_blocks=2)
    m.allocate(0, [1, 2, 3, 4, 5, 6])
    m.fork(0, 1)
    assert not m.append_slots(1, 1)
    assert m.block_table(1) == [0, 1] and m.take_pending_copies() == []


def test_free_releases_only_unshared_blocks_back_to_front():
    m = _manager()
    m.allocate(0, PROMPT)
    m.fork(0, 1)
    m.append_slots(1, 1)
    assert m.block_table(1) == [0, 1, 3] and m.take_pending_copies() == [(2, 3)]
    m.free(0)
    assert m.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]
    assert _refs(m, [0, 1]) == [1, 1]
    m.free(1)
    assert m.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]


# ----- swapping -----


def test_swap_out_and_in_round_trip():
    m = _manager(num_host_blocks=6)
    _cached(m, 0, PROMPT)
    assert m.can_swap_out(0) is OK
    assert m.swap_out(0) == [(0, 0), (1, 1), (2, 2)]
    assert m.is_swapped(0) and m.num_slots(0) == 10
    assert m.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    usage = m.usage()
    assert (usage.used_blocks, usage.cached_blocks, usage.host_used_blocks, usage.waste_slots) == (0, 2, 3, 0)
    with pytest.raises(KVCacheError, match="sequence 0 is swapped out; swap it in first"):
        m.block_table(0)
    with pytest.raises(KVCacheError, match="sequence 0 is swapped out"):
        m.append_slots(0, 1)
    assert m.can_swap_in(0) is OK
    assert m.swap_in(0) == [(0, 3), (1, 4), (2, 5)]
    assert m.block_table(0) == [3, 4, 5] and not m.is_swapped(0)
    assert m.usage().host_used_blocks == 0 and m.host_pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    with pytest.raises(KVCacheError, match="sequence 0 is not swapped out"):
        m.swap_in(0)


def test_swap_in_waits_for_room_and_rehashes_its_blocks():
    m = _manager(num_host_blocks=6)
    _cached(m, 0, PROMPT)
    m.swap_out(0)
    m.allocate(1, list(range(100, 132)))  # blocks 3..9, 2
    m.allocate(2, list(range(200, 208)))  # blocks 1, 0: the cached prefix is evicted
    assert m.block_table(2) == [1, 0] and m.cached_prefix_tokens(PROMPT) == 0
    m.free(2)
    assert m.can_swap_in(0) is LATER
    with pytest.raises(NoFreeBlocksError, match="moving sequence 0 needs 3 free blocks; 2 of 10 are free"):
        m.swap_in(0)
    m.free(1)
    assert m.swap_in(0) == [(0, 0), (1, 1), (2, 2)]
    assert m.cached_prefix_tokens(PROMPT) == 8


def test_swapping_a_shared_sequence_copies_its_blocks_for_it_alone():
    m = _manager(num_host_blocks=6)
    m.allocate(0, [1, 2, 3, 4, 5, 6])
    m.fork(0, 1)
    assert m.swap_out(1) == [(0, 0), (1, 1)]
    assert _refs(m, [0, 1]) == [1, 1] and m.pool.num_free == 8  # sequence 0 still holds them
    assert m.block_table(0) == [0, 1]
    assert m.swap_out(0) == [(0, 2), (1, 3)]
    assert m.pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    assert m.swap_in(1) == [(0, 2), (1, 3)]
    m.free(0)  # frees its host blocks
    assert m.usage().host_used_blocks == 0


def test_swap_statuses_and_missing_host_pool():
    m = _manager()
    m.allocate(0, [1])
    assert m.can_swap_out(0) is NEVER
    with pytest.raises(KVCacheError, match="num_host_blocks=0"):
        m.swap_out(0)
    m = _manager(num_host_blocks=4)
    m.allocate(0, PROMPT)
    m.allocate(1, [1] * 8)
    m.allocate(2, [2] * 20)
    assert m.can_swap_out(2) is NEVER  # 5 blocks > 4 host blocks
    m.swap_out(0)
    assert m.can_swap_out(1) is LATER
    with pytest.raises(NoFreeBlocksError, match="moving sequence 1 needs 2 free blocks; 1 of 4 are free"):
        m.swap_out(1)


# ----- KV groups -----

TWO_LAYERS = (KVGroupSpec(layer_ids=(0,)), KVGroupSpec(layer_ids=(1,)))


def test_groups_have_independent_tables_and_slot_counts():
    m = _manager(groups=TWO_LAYERS)
    m.allocate(0, list(range(6)))
    assert (m.block_table(0, 0), m.block_table(0, 1)) == ([0, 1], [2, 3])
    assert m.append_slots(0, 4, group=0)
    assert (m.num_slots(0, 0), m.num_slots(0, 1)) == (10, 6)
    assert (m.block_table(0, 0), m.block_table(0, 1)) == ([0, 1, 4], [2, 3])
    assert m.append_slots(0, 3)
    assert (m.block_table(0, 0), m.block_table(0, 1)) == ([0, 1, 4, 5], [2, 3, 6])
    assert m.usage().waste_slots == (16 - 13) + (12 - 9)
    assert m.can_allocate(20) is LATER and m.can_allocate(21) is NEVER  # 2 groups x 5 or 6 blocks
    m.free(0)
    assert m.pool.free_block_ids() == [7, 8, 9, 5, 4, 1, 0, 6, 3, 2]
    m.allocate(1, [1])
    with pytest.raises(KVCacheError, match=r"KV group 2 does not exist; this manager has groups 0\.\.1"):
        m.block_table(1, group=2)


def test_groups_hit_their_own_blocks():
    m = _manager(groups=TWO_LAYERS)
    _cached(m, 0, PROMPT)
    assert (m.block_table(0, 0), m.block_table(0, 1)) == ([0, 1, 2], [3, 4, 5])
    assert m.pool.blocks[0].block_hash != m.pool.blocks[3].block_hash
    assert m.allocate(1, PROMPT[:8] + [9]) == 8
    assert (m.block_table(1, 0), m.block_table(1, 1)) == ([0, 1, 6], [3, 4, 7])


def test_decoded_blocks_are_hit_by_a_follow_up_prompt():
    m = _manager(groups=TWO_LAYERS)
    prompt, output = [1, 2, 3, 4, 5, 6], [7, 8, 9]
    _cached(m, 0, prompt)
    assert m.append_slots(0, 3)
    m.cache_full_blocks(0, prompt + output)  # the decoded tokens complete block 1 of each group
    assert (m.block_table(0, 0), m.block_table(0, 1)) == ([0, 1, 4], [2, 3, 5])
    assert m.allocate(1, prompt + output + [10, 11]) == 8  # the next chat turn
    assert (m.block_table(1, 0), m.block_table(1, 1)) == ([0, 1, 6], [2, 3, 7])


def test_prefix_caching_off_hashes_nothing():
    m = _manager(groups=TWO_LAYERS, enable_prefix_caching=False)
    _cached(m, 0, PROMPT[:8])
    assert all(block.block_hash is None for block in m.pool.blocks)
    assert m.allocate(1, PROMPT) == 0 and m.usage().prefix_hit_tokens == 0


# ----- errors -----


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.block_table(42),
        lambda m: m.num_slots(42),
        lambda m: m.append_slots(42, 1),
        lambda m: m.cache_full_blocks(42, [1]),
        lambda m: m.fork(42, 43),
        lambda m: m.free(42),
        lambda m: m.swap_out(42),
        lambda m: m.swap_in(42),
        lambda m: m.can_swap_in(42),
    ],
)
def test_unknown_sequence(call):
    with pytest.raises(KVCacheError, match="sequence 42 has no KV blocks"):
        call(_manager(num_host_blocks=2))


def test_caller_errors_name_the_value():
    m = _manager()
    m.allocate(0, [1, 2])
    with pytest.raises(KVCacheError, match="sequence 0 already has KV blocks"):
        m.allocate(0, [1, 2])
    m.allocate(1, [3])
    with pytest.raises(KVCacheError, match="cannot fork sequence 0 into 1: 1 exists"):
        m.fork(0, 1)
    with pytest.raises(ValueError, match="sequence 2: cannot allocate KV blocks for an empty prompt"):
        m.allocate(2, [])
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 1, got 0"):
        m.can_allocate(0)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        KVCacheManager(10, block_size=0)
    with pytest.raises(ValueError, match="num_host_blocks must be an integer >= 0, got -1"):
        KVCacheManager(10, num_host_blocks=-1)
    with pytest.raises(ValueError, match="at least one KV group"):
        KVCacheManager(10, groups=[])


def test_per_group_reserve_and_shrink_return_blocks() -> None:
    kv = KVCacheManager(
        num_blocks=20, block_size=4, groups=[KVGroupSpec((0,)), KVGroupSpec((1,))], enable_prefix_caching=False
    )
    kv.allocate_empty(7)
    assert kv.reserve(7, [10, 6])
    assert [len(kv.block_table(7, g)) for g in (0, 1)] == [3, 2] and kv.pool.num_free == 15
    assert not kv.reserve(7, [10, 200]) and kv.pool.num_free == 15  # all or nothing
    kv.shrink(7, 0, 4)
    assert len(kv.block_table(7, 0)) == 1 and kv.num_slots(7, 0) == 4 and kv.pool.num_free == 17
    with pytest.raises(ValueError, match="cannot shrink to 5"):
        kv.shrink(7, 0, 5)
    kv.free(7)
    assert kv.pool.num_free == 20


def test_shared_leading_blocks_are_taken_as_they_are_and_hits_follow_them():
    m = _manager()
    m.allocate(-1, list(range(8)))  # a holder of two full blocks (a Prompt Cache module)
    module = m.block_table(-1)
    prompt = list(range(8)) + [50, 51, 52, 53, 54]
    assert m.can_allocate(len(prompt), prompt, ("p",), shared=module) == AllocationStatus.OK
    assert m.allocate(1, prompt, ("p",), shared=module) == 8  # the shared blocks count as computed
    table = m.block_table(1)
    assert table[:2] == module and _refs(m, module) == [2, 2] and len(table) == 4
    m.cache_full_blocks(1, prompt)
    m.free(1)
    assert _refs(m, module) == [1, 1]  # the holder keeps them
    # The same prompt again: the blocks after the shared ones hit (hashes chain from the salt, not the module).
    assert m.allocate(2, prompt + [55, 56], ("p",), shared=module) == 12
    assert m.block_table(2)[2] == table[2]
    assert m.allocate(3, prompt + [55, 56], ("q",), shared=module) == 8  # another salt: no hit


def test_shared_blocks_must_be_held_and_fit_the_sequence():
    m = _manager()
    with pytest.raises(KVCacheError, match=r"shared blocks \[0\] are free"):
        m.allocate(1, list(range(6)), shared=[0])
    m.allocate(-1, list(range(8)))
    with pytest.raises(KVCacheError, match="hold more than the sequence's 6 tokens"):
        m.allocate(1, list(range(6)), shared=m.block_table(-1))
    grouped = _manager(groups=[KVGroupSpec((0,)), KVGroupSpec((1,))])
    grouped.allocate(-1, list(range(4)))
    with pytest.raises(KVCacheError, match=r"one sequence of block ids per KV group \(2\)"):
        grouped.allocate(1, list(range(6)), shared=grouped.block_table(-1)[:1])
    # One sequence of block ids per group: each group's own blocks of the same tokens.
    shared = [grouped.block_table(-1, g)[:1] for g in range(2)]
    assert grouped.allocate(1, list(range(4)) + [9, 9], shared=shared) == 4
    assert [grouped.block_table(1, g)[0] for g in range(2)] == [s[0] for s in shared]


def test_slots_follow_the_block_table():
    m = _manager()
    m.allocate(-1, list(range(4)))  # takes block 0, so the next sequence's table starts at block 1
    m.allocate(1, list(range(6)))
    assert m.block_table(1) == [1, 2]
    assert m.slots(1, 2, 6) == [6, 7, 8, 9]  # block 1 offsets 2-3, then block 2 offsets 0-1


def test_swap_in_rehashes_only_the_blocks_written_before_the_swap():
    """A prefill swapped out between chunks: its later prompt blocks hold nothing yet, so a hit on them
    after the swap-in would read garbage."""
    m = _manager(num_host_blocks=6)
    m.allocate(0, PROMPT)
    m.cache_full_blocks(0, PROMPT[:5])  # the first chunk wrote block 0 only
    m.swap_out(0)
    m.allocate(1, list(range(100, 140)))  # every device block: the cached copy of block 0 is evicted
    m.free(1)
    assert m.cached_prefix_tokens(PROMPT) == 0
    m.swap_in(0)
    assert m.cached_prefix_tokens(PROMPT) == 4


def test_the_audit_counts_blocks_whose_references_disagree_with_the_tables():
    m = _manager(num_host_blocks=6)
    _cached(m, 0, PROMPT)
    m.fork(0, 1)
    _cached(m, -1, [7] * 8)  # a Prompt Cache module sequence: not a request's
    assert m.leaked_blocks() == 0 and m.num_request_sequences() == 2
    m.free(1)
    m.swap_out(0)
    assert m.leaked_blocks() == 0 and m.num_request_sequences() == 1
    m.host_pool.blocks[0].ref_count += 1  # a block nobody holds that the pool counts as used: lost
    m.pool.blocks[9].ref_count += 1
    assert m.leaked_blocks() == 2
    m.host_pool.blocks[0].ref_count -= 1
    m.pool.blocks[9].ref_count -= 1
    m.free(0)
    m.free(-1)
    assert m.leaked_blocks() == 0 and m.num_request_sequences() == 0
