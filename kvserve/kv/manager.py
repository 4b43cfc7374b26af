"""Block tables per sequence and KV group: allocate, append, fork with copy-on-write, free, swap plans.

PagedAttention's bookkeeping (Kwon et al., SOSP'23, https://arxiv.org/abs/2309.06180) with vLLM v1's
automatic prefix caching. Pure data in and out: the scheduler asks, the runner executes the copies and
swaps it is handed. A *KV group* is a set of layers that hold the same token slots and so share one
block table; each group of a sequence has its own table and slot count, so a compressing policy
(PyramidInfer) can keep fewer slots in deeper groups.

Choices, each following vLLM:

- Prefix hits count whole blocks and stop before the prompt's last token: a prompt whose every
  block is cached still recomputes its last block, so the step has logits to sample from. Hits are the
  same count in every group (the computed-token count is per sequence).
- Blocks are hashed only when the caller registers them (``cache_full_blocks``). The scheduler registers
  the full blocks a step is about to compute (vLLM v1 does the same): every layer writes the step's keys
  and values before any sequence attends, so a request admitted in that same step may already share them.
- ``free`` releases each table back to front: a sequence's tail blocks, the least likely to be shared
  by another prompt, are evicted first.
- Copy-on-write happens on append: writing into a partly filled last block that is shared (after
  ``fork``) gives the writer a fresh block and queues ``(src, dst)`` for the runner to copy.
- Swapping copies each sequence's blocks on its own: a block shared with a sequence that stays resident
  keeps its device copy for that sequence and gets a host copy for the swapped one, so a swap plan lists
  every block of the sequence exactly once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.kv.block_pool import Block, BlockPool, KVCacheError, NoFreeBlocksError
from kvserve.kv.prefix_cache import hash_block_tokens, hash_prompt_blocks


class AllocationStatus(enum.Enum):
    OK = "ok"
    LATER = "later"  # not enough free blocks now; others finishing will free them
    NEVER = "never"  # needs more blocks than the whole pool holds


@dataclass(frozen=True)
class KVGroupSpec:
    """Layers that hold the same token slots and so share one block table."""

    layer_ids: tuple[int, ...] = ()  # () = every layer


@dataclass(frozen=True)
class KVUsage:
    """A snapshot a metrics exporter can read: block counts, waste, prefix-cache counters."""

    total_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int  # free, but still findable by hash until evicted
    host_total_blocks: int
    host_used_blocks: int
    num_sequences: int
    waste_slots: int  # allocated device slots holding no token, summed over sequences and groups
    prefix_query_tokens: int  # prompt tokens looked up by allocate
    prefix_hit_tokens: int  # of those, tokens found cached

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass
class _GroupTable:
    blocks: list[Block]
    num_slots: int
    hashes: list[int | None] = field(default_factory=list)  # chained hashes of full blocks, as far as known
    num_cached: int = 0  # leading blocks already offered to the pool's hash map

    def copy(self) -> _GroupTable:
        return _GroupTable(list(self.blocks), self.num_slots, list(self.hashes), self.num_cached)


@dataclass
class _Sequence:
    tables: list[_GroupTable]
    extra: tuple
    swapped: bool = False


class KVCacheManager:
    """Block tables over one device pool (and an optional host pool for swapping).

    ``enable_prefix_caching=False`` when slots may stop matching the token sequence (a compressing
    policy drops slots): a hit must hold for every group, so one such group rules hits out for all.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        groups: Sequence[KVGroupSpec] | None = None,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an integer >= 0, got {num_host_blocks!r}")
        self.groups = tuple(groups) if groups is not None else (KVGroupSpec(),)
        if not self.groups:
            raise ValueError("a KV cache manager needs at least one KV group")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        self._seqs: dict[int, _Sequence] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._query_tokens = 0
        self._hit_tokens = 0

    # ----- new sequences -----

    def can_allocate(
        self, num_tokens: int, token_ids: Sequence[int] | None = None, extra: tuple = (), shared: Sequence[int] = ()
    ) -> AllocationStatus:
        """Whether a new sequence of ``num_tokens`` fits; pass its ``token_ids`` to count cached prefix blocks
        (and its ``shared`` leading blocks, see ``allocate``)."""
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an integer >= 1, got {num_tokens!r}")
        total = len(self.groups) * self.blocks_for(num_tokens)
        if total > self.pool.num_blocks:
            return AllocationStatus.NEVER
        hits = self._lookup(token_ids, extra, len(shared))[1] if token_ids else [[] for _ in self.groups]
        return self._status(total - len(shared) - _count_held(hits), self.pool)

    def cached_prefix_tokens(self, token_ids: Sequence[int], extra: tuple = ()) -> int:
        """Prompt tokens ``allocate`` would find cached now (no side effects)."""
        return len(self._lookup(token_ids, extra)[1][0]) * self.block_size

    def allocate(self, seq_id: int, token_ids: Sequence[int], extra: tuple = (), shared: Sequence[int] = ()) -> int:
        """Blocks for a new sequence's prompt, reusing cached prefix blocks; returns the prompt tokens
        already computed (whole blocks, never the last token). ``extra`` salts the hashes (LoRA, modules).

        ``shared``: full device blocks another holder keeps (Prompt Cache modules) that become this
        sequence's first blocks as they are; they count as computed and are not hashed: the hash chain
        starts after them, so ``extra`` must identify what they hold. One KV group only."""
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id} already has KV blocks; free it before allocating again")
        if not token_ids:
            raise ValueError(f"sequence {seq_id}: cannot allocate KV blocks for an empty prompt")
        lead = self._shared_blocks(shared, len(token_ids))
        hashes, hits = self._lookup(token_ids, extra, len(lead))
        num_blocks = self.blocks_for(len(token_ids))
        needed = len(self.groups) * num_blocks - len(lead) - _count_held(hits)
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(
                f"sequence {seq_id} needs {needed} free blocks; {self.pool.num_free} of {self.pool.num_blocks} are free"
            )
        self.pool.touch(lead)
        for group_hits in hits:  # take every hit before allocating, so allocation cannot evict one
            self.pool.touch(group_hits)
        tables = []
        for group_hashes, group_hits in zip(hashes, hits, strict=True):
            blocks = lead + group_hits + self.pool.allocate(num_blocks - len(lead) - len(group_hits))
            cached = len(lead) + len(group_hits)
            tables.append(_GroupTable(blocks, len(token_ids), group_hashes, num_cached=cached))
        self._seqs[seq_id] = _Sequence(tables, tuple(extra))
        hit_tokens = len(hits[0]) * self.block_size
        self._query_tokens += len(token_ids) - len(lead) * self.block_size
        self._hit_tokens += hit_tokens
        return (len(lead) + len(hits[0])) * self.block_size

    def _shared_blocks(self, shared: Sequence[int], num_tokens: int) -> list[Block]:
        if not shared:
            return []
        if len(self.groups) != 1:
            raise KVCacheError(f"shared leading blocks need a single KV group; this manager has {len(self.groups)}")
        if len(shared) * self.block_size > num_tokens:
            raise KVCacheError(f"{len(shared)} shared blocks hold more than the sequence's {num_tokens} tokens")
        blocks = [self.pool.blocks[b] for b in shared]
        unheld = [b.block_id for b in blocks if b.ref_count < 1]
        if unheld:
            raise KVCacheError(f"shared blocks {unheld} are free; their holder must keep them while they are shared")
        return blocks

    def _lookup(
        self, token_ids: Sequence[int], extra: tuple, skip: int = 0
    ) -> tuple[list[list[int]], list[list[Block]]]:
        """Per group: the hashes of all full prompt blocks, and the cached blocks of the longest hit.
        The first ``skip`` blocks (shared as they are) get no hash (None); the chain starts after them."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups], [[] for _ in self.groups]
        max_hit = (len(token_ids) - 1) // self.block_size
        rest = token_ids[skip * self.block_size :]
        hashes = [
            [None] * skip + hash_prompt_blocks(rest, self.block_size, (g, *extra)) for g in range(len(self.groups))
        ]
        hits = []
        for group_hashes in hashes:
            blocks = []
            for block_hash in group_hashes[skip:max_hit]:
                block = self.pool.lookup(block_hash)
                if block is None:
                    break
                blocks.append(block)
            hits.append(blocks)
        num_hit = min(len(blocks) for blocks in hits)
        return hashes, [blocks[:num_hit] for blocks in hits]

    def allocate_empty(self, seq_id: int) -> None:
        """A new sequence holding no slot yet in any group: a compressing policy then reserves per group."""
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id} already has KV blocks; free it before allocating again")
        self._seqs[seq_id] = _Sequence([_GroupTable([], 0) for _ in self.groups], ())

    # ----- growing, shrinking, caching, sharing -----

    def reserve(self, seq_id: int, group_slots: Sequence[int]) -> bool:
        """Grow each group to at least ``group_slots[g]`` slots; False, changing nothing, if the free
        blocks do not suffice. Groups already holding more keep what they hold (see ``shrink``)."""
        tables = self._resident(seq_id).tables
        grow = [max(0, n - t.num_slots) for t, n in zip(tables, self._check_group_slots(group_slots), strict=True)]
        if sum(self._blocks_needed(t, n) for t, n in zip(tables, grow, strict=True)) > self.pool.num_free:
            return False
        for table, n in zip(tables, grow, strict=True):
            self._grow(table, n)
        return True

    def shrink(self, seq_id: int, group: int, num_slots: int) -> None:
        """Keep only the first ``num_slots`` slots of a group (a policy compacted the ones it keeps there)
        and return the blocks past them to the pool."""
        table = self._resident(seq_id).tables[self._group_index(group)]
        if not isinstance(num_slots, int) or not 0 <= num_slots <= table.num_slots:
            raise ValueError(
                f"sequence {seq_id} group {group} holds {table.num_slots} slots; cannot shrink to {num_slots!r}"
            )
        keep = self.blocks_for(num_slots)
        self.pool.free(reversed(table.blocks[keep:]))
        del table.blocks[keep:]
        table.num_slots = num_slots
        table.hashes, table.num_cached = table.hashes[:0], 0  # slots no longer match token blocks

    def _check_group_slots(self, group_slots: Sequence[int]) -> list[int]:
        slots = list(group_slots)
        if len(slots) != len(self.groups) or any(not isinstance(n, int) or n < 0 for n in slots):
            raise ValueError(f"need one slot count >= 0 per KV group ({len(self.groups)}), got {slots!r}")
        return slots

    def append_slots(self, seq_id: int, num_new_tokens: int, group: int | None = None) -> bool:
        """Room for ``num_new_tokens`` more slots in every group (or one ``group``); False, changing
        nothing, if the free blocks do not suffice. Shared partial last blocks are copied on write."""
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0, got {num_new_tokens!r}")
        tables = self._resident(seq_id).tables
        chosen = tables if group is None else [tables[self._group_index(group)]]
        needed = sum(self._blocks_needed(table, num_new_tokens) for table in chosen)
        if needed > self.pool.num_free:
            return False
        for table in chosen:
            self._grow(table, num_new_tokens)
        return True

    def _blocks_needed(self, table: _GroupTable, num_new: int) -> int:
        grow = self.blocks_for(table.num_slots + num_new) - len(table.blocks)
        return grow + self._must_copy(table, num_new)

    def _must_copy(self, table: _GroupTable, num_new: int) -> bool:
        return num_new > 0 and table.num_slots % self.block_size != 0 and table.blocks[-1].ref_count > 1

    def _grow(self, table: _GroupTable, num_new: int) -> None:
        if self._must_copy(table, num_new):
            src = table.blocks[-1]
            dst = self.pool.allocate(1)[0]
            self.pool.free([src])
            table.blocks[-1] = dst
            self._pending_copies.append((src.block_id, dst.block_id))
        table.num_slots += num_new
        table.blocks += self.pool.allocate(self.blocks_for(table.num_slots) - len(table.blocks))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write copies ``(src_block, dst_block)`` the runner must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Register the full blocks covered by ``token_ids`` (the sequence's tokens whose KV is now
        written) so later prompts can hit them. Blocks hashed earlier are not re-checked."""
        seq = self._resident(seq_id)
        if not self.enable_prefix_caching:
            return
        for g, table in enumerate(seq.tables):
            num_full = min(len(token_ids), table.num_slots) // self.block_size
            self._extend_hashes(table, token_ids, num_full, (g, *seq.extra))
            self._register(table, num_full)

    def _extend_hashes(self, table: _GroupTable, token_ids: Sequence[int], num_full: int, extra: tuple) -> None:
        bs = self.block_size
        for i in range(len(table.hashes), num_full):
            parent = table.hashes[-1] if table.hashes else None
            table.hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], extra))

    def _register(self, table: _GroupTable, num_full: int) -> None:
        for i in range(table.num_cached, num_full):
            if table.hashes[i] is not None:  # shared leading blocks have none
                self.pool.cache(table.blocks[i], table.hashes[i])
        table.num_cached = max(table.num_cached, num_full)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (parallel samples, beam search)."""
        parent = self._resident(parent_seq_id)
        if child_seq_id in self._seqs:
            raise KVCacheError(f"cannot fork sequence {parent_seq_id} into {child_seq_id}: {child_seq_id} exists")
        child = _Sequence([table.copy() for table in parent.tables], parent.extra)
        for table in child.tables:
            self.pool.touch(table.blocks)
        self._seqs[child_seq_id] = child

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (device or host), each table back to front."""
        seq = self._get(seq_id)
        pool = self._host() if seq.swapped else self.pool
        for table in seq.tables:
            pool.free(reversed(table.blocks))
        del self._seqs[seq_id]

    # ----- swapping (preemption) -----

    def can_swap_out(self, seq_id: int) -> AllocationStatus:
        """NEVER when there is no host pool or the sequence is larger than it: recompute instead."""
        if self.host_pool is None:
            return AllocationStatus.NEVER
        return self._status(self._num_blocks_of(self._resident(seq_id)), self.host_pool)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move a sequence to host blocks; returns ``(device_block, host_block)`` copies for the runner,
        which must run them before any freed device block is written again."""
        host = self._host()
        seq = self._resident(seq_id)
        plan = self._move(seq, self.pool, host, seq_id)
        seq.swapped = True  # each table's num_cached still counts its written blocks, for swap_in
        return plan

    def can_swap_in(self, seq_id: int) -> AllocationStatus:
        return self._status(self._num_blocks_of(self._swapped(seq_id)), self.pool)

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Move a swapped sequence back; returns ``(host_block, device_block)`` copies. Its blocks that
        were registered before the swap are hashed again, since their contents arrive before the next
        forward (not every full block of the prompt: a prefill swapped out between chunks has not
        written the rest)."""
        seq = self._swapped(seq_id)
        plan = self._move(seq, self._host(), self.pool, seq_id)
        for table in seq.tables:
            written, table.num_cached = table.num_cached, 0
            self._register(table, min(written, len(table.hashes)))
        seq.swapped = False
        return plan

    def _move(self, seq: _Sequence, src: BlockPool, dst: BlockPool, seq_id: int) -> list[tuple[int, int]]:
        needed = self._num_blocks_of(seq)
        if needed > dst.num_free:
            raise NoFreeBlocksError(
                f"moving sequence {seq_id} needs {needed} free blocks; {dst.num_free} of {dst.num_blocks} are free"
            )
        plan = []
        for table in seq.tables:
            new_blocks = dst.allocate(len(table.blocks))
            plan += [(old.block_id, new.block_id) for old, new in zip(table.blocks, new_blocks, strict=True)]
            src.free(reversed(table.blocks))
            table.blocks = new_blocks
        return plan

    # ----- queries -----

    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        return [block.block_id for block in self._resident(seq_id).tables[self._group_index(group)].blocks]

    def slots(self, seq_id: int, start: int, end: int, group: int = 0) -> list[int]:
        """Device slots (``block * block_size + offset``) of the sequence's tokens ``start .. end - 1``."""
        table, bs = self.block_table(seq_id, group), self.block_size
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    def num_slots(self, seq_id: int, group: int = 0) -> int:
        return self._get(seq_id).tables[self._group_index(group)].num_slots

    def is_swapped(self, seq_id: int) -> bool:
        return self._get(seq_id).swapped

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def usage(self) -> KVUsage:
        resident = [seq for seq in self._seqs.values() if not seq.swapped]
        host = self.host_pool
        return KVUsage(
            total_blocks=self.pool.num_blocks,
            used_blocks=self.pool.num_blocks - self.pool.num_free,
            free_blocks=self.pool.num_free,
            cached_blocks=self.pool.num_cached_free,
            host_total_blocks=host.num_blocks if host else 0,
            host_used_blocks=host.num_blocks - host.num_free if host else 0,
            num_sequences=len(self._seqs),
            waste_slots=sum(len(t.blocks) * self.block_size - t.num_slots for seq in resident for t in seq.tables),
            prefix_query_tokens=self._query_tokens,
            prefix_hit_tokens=self._hit_tokens,
        )

    def device_status(self, num_blocks: int) -> AllocationStatus:
        """Whether ``num_blocks`` device blocks are free now, may be later, or never can be."""
        return self._status(num_blocks, self.pool)

    def blocks_for(self, num_slots: int) -> int:
        """Blocks that hold ``num_slots`` token slots."""
        return -(-num_slots // self.block_size)

    # ----- helpers -----

    def _num_blocks_of(self, seq: _Sequence) -> int:
        return sum(len(table.blocks) for table in seq.tables)

    @staticmethod
    def _status(needed: int, pool: BlockPool) -> AllocationStatus:
        if needed > pool.num_blocks:
            return AllocationStatus.NEVER
        return AllocationStatus.OK if needed <= pool.num_free else AllocationStatus.LATER

    def _group_index(self, group: int) -> int:
        if not isinstance(group, int) or not 0 <= group < len(self.groups):
            raise KVCacheError(f"KV group {group!r} does not exist; this manager has groups 0..{len(self.groups) - 1}")
        return group

    def _get(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KVCacheError(f"sequence {seq_id!r} has no KV blocks (never allocated, or freed)")
        return seq

    def _resident(self, seq_id: int) -> _Sequence:
        seq = self._get(seq_id)
        if seq.swapped:
            raise KVCacheError(f"sequence {seq_id} is swapped out; swap it in first")
        return seq

    def _swapped(self, seq_id: int) -> _Sequence:
        seq = self._get(seq_id)
        if not seq.swapped:
            raise KVCacheError(f"sequence {seq_id} is not swapped out")
        return seq

    def _host(self) -> BlockPool:
        if self.host_pool is None:
            raise KVCacheError("swapping needs a host pool; this manager was built with num_host_blocks=0")
        return self.host_pool


def _count_held(hits: list[list[Block]]) -> int:
    """Hit blocks some sequence already holds: sharing them takes no free block."""
    return sum(1 for group_hits in hits for block in group_hits if block.ref_count > 0)
