"""A second block pool: KV groups (``KVGroupSpec(pool=1)``) whose blocks come from a side pool.

Specs: blocks of 16 tokens, group 0 global (layer 0) in the main pool, group 1 a window of 32 tokens (layer 1)
in the side pool, whose ids start at the main pool's size. A window query sees 32 tokens, so a prefix hit
needs ceil(31 / 16) = 2 window blocks cached, and at ``num_computed_tokens`` c the blocks ending before c - 31 go.
"""

from __future__ import annotations

import pytest

from kvserve.kv import AllocationStatus, BlockPool, KVCacheError, KVCacheManager, KVGroupSpec, NoFreeBlocksError

OK, LATER, NEVER = AllocationStatus.OK, AllocationStatus.LATER, AllocationStatus.NEVER
BS = 16
GROUPS = (KVGroupSpec((0,)), KVGroupSpec((1,), sliding_window=32, pool=1))


def _manager(num_blocks: int = 20, num_side_blocks: int = 8, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=BS, groups=GROUPS, num_side_blocks=num_side_blocks, **kwargs)


def _in_main(m: KVCacheManager, ids) -> bool:
    return all(0 <= b < m.pool.num_blocks for b in ids)


def _in_side(m: KVCacheManager, ids) -> bool:
    first = m.pool.num_blocks
    return all(first <= b < first + m.side_pool.num_blocks for b in ids)


def _all_free(m: KVCacheManager) -> bool:
    return m.pool.num_free == m.pool.num_blocks and m.side_pool.num_free == m.side_pool.num_blocks


# ----- the pools -----


def test_block_pool_ids_start_at_first_id():
    pool = BlockPool(3, first_id=10)
    assert [b.block_id for b in pool.blocks] == [10, 11, 12] and pool.free_block_ids() == [10, 11, 12]
    assert pool.owns(10) and pool.owns(12) and not pool.owns(9) and not pool.owns(13)
    assert pool.block(11) is pool.blocks[1]
    with pytest.raises(KVCacheError, match="block 0 is not in this pool"):
        pool.block(0)
    assert [b.block_id for b in pool.allocate(2)] == [10, 11]


def test_each_group_draws_from_its_pool():
    m = _manager()
    assert m.side_pool.first_id == 20 and m.pool.first_id == 0
    m.allocate(1, list(range(40)))  # 3 blocks per group
    assert m.block_table(1, 0) == [0, 1, 2]
    assert m.block_table(1, 1) == [20, 21, 22]
    assert m.block_tables(1) == ((0, 1, 2), (20, 21, 22))
    assert m.pool.num_free == 17 and m.side_pool.num_free == 5
    assert m.slots(1, 0, 2, group=1) == [20 * BS, 20 * BS + 1]
    usage = m.usage()
    assert (usage.total_blocks, usage.used_blocks, usage.side_total_blocks, usage.side_used_blocks) == (20, 3, 8, 3)
    m.free(1)
    assert _all_free(m) and m.leaked_blocks() == 0


def test_without_a_side_pool_usage_has_no_side_figures():
    m = KVCacheManager(4, block_size=BS)
    assert m.side_pool is None
    assert (m.usage().side_total_blocks, m.usage().side_used_blocks) == (0, 0)


# ----- per-pool free-block checks -----


def test_side_pool_exhausted_main_has_room():
    m = _manager(num_blocks=20, num_side_blocks=4)
    m.allocate(1, list(range(64)))  # 4 blocks per group: the side pool is full
    assert m.pool.num_free == 16 and m.side_pool.num_free == 0
    assert m.can_allocate(20, list(range(100, 120))) == LATER
    with pytest.raises(NoFreeBlocksError, match="needs 2 free side-pool blocks; 0 of 4 are free"):
        m.allocate(2, list(range(100, 120)))
    assert 2 not in m and m.pool.num_free == 16  # nothing taken
    assert not m.append_slots(1, 1)  # a fifth block in each group: the side pool has none
    assert not m.reserve(1, [65, 65])
    assert m.append_slots(1, 1, group=0)  # the main pool alone has room
    assert m.pool.num_free == 15 and m.side_pool.num_free == 0
    assert m.device_status(15) == OK and m.device_status(16) == LATER  # the main pool's figures
    m.free(1)
    assert _all_free(m) and m.leaked_blocks() == 0


def test_main_pool_exhausted_side_has_room():
    m = _manager(num_blocks=4, num_side_blocks=20)
    m.allocate(1, list(range(64)))
    assert m.pool.num_free == 0 and m.side_pool.num_free == 16
    assert m.can_allocate(20, list(range(100, 120))) == LATER
    with pytest.raises(NoFreeBlocksError, match="needs 2 free blocks; 0 of 4 are free"):
        m.allocate(2, list(range(100, 120)))
    assert 2 not in m and m.side_pool.num_free == 16
    assert not m.append_slots(1, 1)
    assert m.append_slots(1, 1, group=1)
    assert m.side_pool.num_free == 15


def test_lazy_window_grows_from_the_side_pool():
    m = _manager(num_blocks=20, num_side_blocks=3)
    assert m.allocate(1, list(range(80)), step_tokens=BS) == 0
    assert len(m.block_table(1, 0)) == 5 and m.block_table(1, 1) == [20]  # the window: one step's block
    assert m.reserve(1, [80, 48])
    assert m.block_table(1, 1) == [20, 21, 22] and m.side_pool.num_free == 0
    assert not m.reserve(1, [80, 64])  # a fourth window block: none free until the window moves on
    assert m.release_out_of_window(1, 48) == 1  # tokens 0..15 are out of sight from 48 on
    assert m.reserve(1, [80, 64])
    assert m.block_table(1, 1) == [20, 21, 22, 20]  # the released entry reads as the side pool's first id
    assert m.pool.num_free == 15


# ----- releasing, freeing -----


def test_release_out_of_window_returns_side_blocks_to_the_side_pool():
    m = _manager()
    m.allocate(1, list(range(80)))  # 5 blocks per group
    window = m.block_table(1, 1)
    assert m.release_out_of_window(1, 80) == 3  # blocks before token 80 - 31 = 49: entries 0..2
    assert m.side_pool.num_free == 3 + 3 and m.pool.num_free == 15
    assert m.block_table(1, 1) == [20, 20, 20, *window[3:]]
    assert m.held_blocks(1) == m.block_table(1, 0) + window[3:]
    assert m.side_pool.free_block_ids()[-3:] == window[2::-1]  # given back back to front
    assert m.leaked_blocks() == 0
    m.free(1)
    assert _all_free(m) and m.leaked_blocks() == 0


def test_leaked_blocks_counts_the_side_pool():
    m = _manager()
    m.allocate(1, list(range(40)))
    m.side_pool.block(25).ref_count += 1
    assert m.leaked_blocks() == 1
    m.side_pool.block(25).ref_count -= 1
    assert m.leaked_blocks() == 0


# ----- prefix caching -----


def test_prefix_hits_in_both_pools():
    m = _manager()
    prompt = list(range(80))
    m.allocate(1, prompt)
    glob, window = m.block_table(1, 0), m.block_table(1, 1)
    m.cache_full_blocks(1, prompt)
    m.release_out_of_window(1, 80)  # window entries 0..2 freed, still findable
    assert m.cached_prefix_tokens(prompt) == 64  # 4 whole blocks, never the last token's
    assert m.allocate(2, prompt) == 64
    assert m.block_table(2, 0)[:4] == glob[:4]  # the global group shares every hit block
    assert m.block_table(2, 1)[:4] == [20, 20, *window[2:4]]  # the window group only what its next query sees
    assert _in_main(m, m.block_table(2, 0)) and _in_side(m, m.block_table(2, 1))
    assert [m.pool.block(b).ref_count for b in glob[:4]] == [2, 2, 2, 2]
    assert [m.side_pool.block(b).ref_count for b in window[2:4]] == [1, 2]  # entry 2: taken back from the free queue
    assert m.usage().prefix_hit_tokens == 64
    m.free(1)
    m.free(2)
    assert _all_free(m) and m.leaked_blocks() == 0


def test_forget_free_forgets_both_pools():
    m = _manager()
    prompt = list(range(80))
    m.allocate(1, prompt)
    m.cache_full_blocks(1, prompt)
    m.free(1)
    assert m.pool.num_cached_free == 5 and m.side_pool.num_cached_free == 5
    m.forget_free()
    assert m.pool.num_cached_free == 0 and m.side_pool.num_cached_free == 0
    assert m.cached_prefix_tokens(prompt) == 0


# ----- sharing -----


def test_fork_copy_on_write_in_the_side_group():
    m = _manager()
    m.allocate(1, list(range(40)))  # a partial last block in each group
    m.fork(1, 2)
    last_main, last_side = m.block_table(1, 0)[-1], m.block_table(1, 1)[-1]
    assert m.side_pool.block(last_side).ref_count == 2
    assert m.append_slots(2, 1)
    copies = m.take_pending_copies()
    assert len(copies) == 2
    (src0, dst0), (src1, dst1) = copies
    assert (src0, src1) == (last_main, last_side)
    assert _in_main(m, (src0, dst0)) and _in_side(m, (src1, dst1))
    assert m.block_table(2, 1)[-1] == dst1 and m.block_table(1, 1)[-1] == last_side
    assert m.side_pool.block(last_side).ref_count == 1 and m.side_pool.block(dst1).ref_count == 1
    m.free(1)
    m.free(2)
    assert _all_free(m) and m.leaked_blocks() == 0


def test_shared_leading_blocks_resolve_in_each_groups_pool():
    m = _manager()
    m.allocate(-1, list(range(32)), keep_window=True)  # a module: two full blocks per group
    lead = (m.block_table(-1, 0), m.block_table(-1, 1))
    m.allocate_shared_groups(2, lead)
    assert m.block_tables(2) == (tuple(lead[0]), tuple(lead[1]))
    assert [m.side_pool.block(b).ref_count for b in lead[1]] == [2, 2]
    with pytest.raises(KVCacheError, match="not in this pool"):
        m.allocate_shared_groups(3, (lead[0], lead[0]))  # main-pool ids for the side group
    m.free(2)
    m.free(-1)
    assert _all_free(m) and m.leaked_blocks() == 0


# ----- admission -----


def test_can_allocate_never_when_the_side_pool_cannot_hold_one_window():
    m = _manager(num_blocks=100, num_side_blocks=3)
    # a step of 16 tokens sees 31 + 16 tokens from its first query's window start: 4 blocks
    assert m.can_allocate(200, step_tokens=BS) == NEVER
    assert m.blocks_needed(200, BS) == 13  # the main pool's share only
    assert m.can_allocate(200) == NEVER  # all at once: 13 window blocks
    assert _manager(num_blocks=100, num_side_blocks=4).can_allocate(200, step_tokens=BS) == OK
    assert _manager(num_blocks=12, num_side_blocks=4).can_allocate(200, step_tokens=BS) == NEVER  # 13 main blocks


# ----- configuration -----


def test_side_group_without_side_blocks_is_refused():
    with pytest.raises(ValueError, match=r"KV groups \[1\] draw from the side pool \(pool=1\), but num_side_blocks=0"):
        KVCacheManager(20, block_size=BS, groups=GROUPS)


def test_side_pool_with_host_blocks_is_refused():
    with pytest.raises(ValueError, match="swapping is not supported with a side pool"):
        _manager(num_host_blocks=8)


@pytest.mark.parametrize("pool", [2, -1, True, 1.0])
def test_group_pool_must_be_0_or_1(pool):
    with pytest.raises(ValueError, match="pool must be 0 \\(the main pool\\) or 1"):
        KVGroupSpec((0,), pool=pool)


def test_swapping_with_a_side_pool_says_why_not():
    m = _manager()
    m.allocate(1, list(range(40)))
    assert m.can_swap_out(1) == NEVER
    with pytest.raises(KVCacheError, match="swapping is not supported with a side pool"):
        m.swap_out(1)
    assert not m.is_swapped(1) and m.leaked_blocks() == 0
