"""BlockPool: free-queue order, reference counts, cached blocks that stay findable until evicted (LRU)."""

from __future__ import annotations

import pytest

from kvserve.kv import BlockPool, KVCacheError, NoFreeBlocksError


def _ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def test_initial_free_order_is_ascending_ids():
    pool = BlockPool(5)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    assert (pool.num_blocks, pool.num_free, pool.num_cached_free) == (5, 5, 0)


def test_allocate_takes_from_head_and_free_appends_to_tail_in_order():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert _ids(blocks) == [0, 1, 2]
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert pool.free_block_ids() == [3, 4]
    pool.free([blocks[2], blocks[0]])
    assert pool.free_block_ids() == [3, 4, 2, 0]
    assert _ids(pool.allocate(3)) == [3, 4, 2]  # least recently freed first


def test_freed_cached_block_stays_findable_until_evicted():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache(a, 111) and pool.cache(b, 222)
    pool.free([b, a])
    assert pool.free_block_ids() == [2, 1, 0]
    assert pool.num_cached_free == 2
    assert pool.lookup(111) is a and pool.lookup(222) is b
    assert _ids(pool.allocate(2)) == [2, 1]  # evicts block 1's hash, never block 0's
    assert pool.lookup(222) is None and b.block_hash is None
    assert pool.lookup(111) is a and pool.num_cached_free == 1


def test_touch_takes_a_cached_free_block_out_of_the_free_queue():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache(a, 7)
    pool.free([a])
    assert pool.free_block_ids() == [1, 2, 3, 0]
    pool.touch([a])
    assert a.ref_count == 1 and pool.free_block_ids() == [1, 2, 3]
    pool.touch([a])
    assert a.ref_count == 2 and pool.free_block_ids() == [1, 2, 3]
    pool.free([a])
    assert a.ref_count == 1 and pool.free_block_ids() == [1, 2, 3]


def test_cache_keeps_the_first_block_for_a_hash():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache(a, 5)
    assert not pool.cache(b, 5)  # duplicate content: stays unhashed
    assert not pool.cache(a, 6)  # already hashed
    assert (a.block_hash, b.block_hash, pool.lookup(5)) == (5, None, a)


def test_errors_name_the_values():
    with pytest.raises(ValueError, match="num_blocks >= 1, got 0"):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 3 blocks; 2 of 2 are free"):
        pool.allocate(3)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(KVCacheError, match="block 0 was freed more often"):
        pool.free([a])
