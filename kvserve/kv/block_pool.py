"""Fixed-size KV blocks: reference counts, a free queue in LRU eviction order, and a hash -> block map.

Pure bookkeeping after vLLM v1's ``BlockPool`` and ``FreeKVCacheBlockQueue``: a block id names one
range of ``block_size`` token slots in the KV tensors of a group's layers; the runner owns the tensors.
When the last holder frees a block it joins the *tail* of the free queue but keeps its hash, so a
later request with the same prefix can take it back (``touch``). ``allocate`` pops from the *head*
(least recently freed first) and only then evicts the hash: cached prefixes live as long as possible.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.errors import KVServeError


class KVCacheError(KVServeError):
    """A KV cache request that cannot be met: unknown or duplicate sequence, no swap space, bad group."""


class NoFreeBlocksError(KVCacheError):
    """More blocks were asked for than are free; ``can_allocate`` / ``can_swap_in`` say so beforehand."""


@dataclass(eq=False)
class Block:
    """One block of token slots. ``block_hash`` is set once the block is full and registered for reuse."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockPool:
    """``num_blocks`` blocks, initially all free in id order ``first_id`` .. ``first_id + num_blocks - 1``.

    ``first_id`` keeps ids unique across pools (a second pool starts past the first one's last id); ``blocks``
    is indexed by ``block_id - first_id`` (``block(block_id)`` does it).
    """

    def __init__(self, num_blocks: int, first_id: int = 0) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1, got {num_blocks!r}")
        if not isinstance(first_id, int) or isinstance(first_id, bool) or first_id < 0:
            raise ValueError(f"a block pool's first_id must be an integer >= 0, got {first_id!r}")
        self.first_id = first_id
        self.blocks = [Block(first_id + i) for i in range(num_blocks)]
        # Head = next to reuse. An OrderedDict removes from the middle in O(1) (a touched cached block),
        # which is what vLLM's hand-made doubly linked list is for.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Free blocks, including cached ones: those are evicted on demand."""
        return len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a findable prefix."""
        return sum(1 for block in self._free.values() if block.block_hash is not None)

    def owns(self, block_id: int) -> bool:
        """Whether ``block_id`` is one of this pool's ids."""
        return self.first_id <= block_id < self.first_id + len(self.blocks)

    def block(self, block_id: int) -> Block:
        """The block named ``block_id``; KVCacheError if this pool has no such id."""
        if not self.owns(block_id):
            raise KVCacheError(
                f"block {block_id} is not in this pool (ids {self.first_id}..{self.first_id + len(self.blocks) - 1})"
            )
        return self.blocks[block_id - self.first_id]

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (the first is reused first)."""
        return list(self._free)

    def lookup(self, block_hash: int) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, num: int) -> list[Block]:
        """Take ``num`` blocks from the head of the free queue, evicting their cached hashes."""
        if num > len(self._free):
            raise NoFreeBlocksError(f"asked for {num} blocks; {len(self._free)} of {self.num_blocks} are free")
        taken = []
        for _ in range(num):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference to each block; a free cached block leaves the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in order; unheld blocks join the tail, so the first is evicted first."""
        for block in blocks:
            if block.ref_count < 1:
                raise KVCacheError(f"block {block.block_id} was freed more often than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache(self, block: Block, block_hash: int) -> bool:
        """Make a full block findable by ``block_hash``; False if the block or the hash is taken already.

        Two sequences can compute the same block at once (neither hit the other); the first one
        registered serves later hits and the duplicate stays unhashed, to be freed as usual.
        """
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def forget_free(self) -> None:
        """Free blocks stop serving prefix hits: a tier failed a transfer, so what they hold is not to be trusted."""
        for block in self._free.values():
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
