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
  every block the sequence holds exactly once.

Sliding-window groups (``KVGroupSpec(sliding_window=W)``, vLLM's hybrid KV cache manager): a query at
position p sees keys p-W+1..p only, so such a group gives back, from the front, the blocks no later query
sees (``release_out_of_window``). Its table stays position-indexed: released entries read as block 0,
which attention masks. Freed, they keep their hash like any freed cached block.

- Lazy allocation: ``allocate(step_tokens=n)`` gives a window group blocks only for its first step (the
  hit's window and ``n`` tokens past it), and the caller grows each group to a target token count
  (``reserve``) as chunks are computed. A window group of an 8k prompt prefilled in 2k chunks holds
  about (W + 2k) / block_size blocks, not 8k / block_size. Global groups still get the whole prompt.
- A prefix hit of L blocks holds for a window group when the blocks the first uncomputed token sees
  (positions L*bs-W+1 .. L*bs-1) are cached; the group takes only those. The hit is the longest L that
  holds for every group (vLLM v1's ``SlidingWindowManager.find_longest_cache_hit``).
- ``keep_window=True`` (Prompt Cache): a sequence whose positions are not its slot indices, or a module that
  importers read from any position. Its window groups are allocated as global groups are (every hit block, a
  hit needing the whole chain; blocks for the whole prompt at once) and count as global groups in
  ``blocks_needed``; what they release is the caller's to say (``release_out_of_window(unseen=)``: by
  position), or nothing (a module's encoding keeps every block: allocating it whole means it never runs dry
  half way, where it could only preempt itself).

A second pool (``KVCacheManager(num_side_blocks=N)``, ``KVGroupSpec(pool=1)``): groups whose layers keep their KV
elsewhere than the main pool's (an offloading engine keeps a sliding-window model's window layers on the device
and its global layers in the tier). Block ids are unique across pools (the side pool's start at ``num_blocks``);
a released entry reads as its pool's first id. Free-block checks are per pool, and an allocation waits if either
pool lacks; ``blocks_needed`` counts the main pool (``pool``), which ``usage`` and ``device_status`` describe.
No host pool with a side pool: an engine that offloads preempts by recompute.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Sequence
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
    sliding_window: int | None = None  # keys a query sees, itself included; None = all before it
    pool: int = 0  # where its blocks come from: 0 = the main pool, 1 = the side pool

    def __post_init__(self) -> None:
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"sliding_window must be an integer >= 1 or None, got {w!r}")
        if not isinstance(self.pool, int) or isinstance(self.pool, bool) or self.pool not in (0, 1):
            raise ValueError(f"pool must be 0 (the main pool) or 1 (the side pool), got {self.pool!r}")


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
    side_total_blocks: int = 0  # the side pool (KVGroupSpec(pool=1)); 0 without one
    side_used_blocks: int = 0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass
class _GroupTable:
    """Entries are position-indexed (entry j holds tokens j*bs ..): the first ``released`` entries were
    given back (a sliding window no longer sees them), ``blocks`` holds the rest."""

    blocks: list[Block]
    num_slots: int  # token slots the entries cover, released ones included
    hashes: list[int | None] = field(default_factory=list)  # chained hashes of full blocks, as far as known
    num_cached: int = 0  # leading entries already offered to the pool's hash map
    released: int = 0

    @property
    def num_entries(self) -> int:
        return self.released + len(self.blocks)

    def copy(self) -> _GroupTable:
        return _GroupTable(list(self.blocks), self.num_slots, list(self.hashes), self.num_cached, self.released)


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
        num_side_blocks: int = 0,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an integer >= 0, got {num_host_blocks!r}")
        if not isinstance(num_side_blocks, int) or isinstance(num_side_blocks, bool) or num_side_blocks < 0:
            raise ValueError(f"num_side_blocks must be an integer >= 0, got {num_side_blocks!r}")
        if num_side_blocks and num_host_blocks:
            raise ValueError(
                f"num_host_blocks={num_host_blocks} with num_side_blocks={num_side_blocks}: swapping is not supported "
                "with a side pool (an engine that offloads preempts by recompute)"
            )
        self.groups = tuple(groups) if groups is not None else (KVGroupSpec(),)
        if not self.groups:
            raise ValueError("a KV cache manager needs at least one KV group")
        side = [g for g, spec in enumerate(self.groups) if spec.pool == 1]
        if side and not num_side_blocks:
            raise ValueError(f"KV groups {side} draw from the side pool (pool=1), but num_side_blocks=0")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)  # the main pool
        self.side_pool = BlockPool(num_side_blocks, first_id=self.pool.num_blocks) if num_side_blocks else None
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        self._pools = (self.pool,) if self.side_pool is None else (self.pool, self.side_pool)
        self._group_pools = tuple(self._pools[spec.pool] for spec in self.groups)  # each group's pool
        self._seqs: dict[int, _Sequence] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._query_tokens = 0
        self._hit_tokens = 0
        self._reclaimers: list[Callable[[], bool]] = []

    # ----- blocks held only as a cache -----

    def add_reclaimer(self, reclaim: Callable[[], bool]) -> None:
        """Register ``reclaim()``: it frees device blocks a holder keeps only as a cache (a Prompt Cache module no
        request pins), returning False when it has none left to free. Without it, such blocks would be given back
        only to make room for that holder's own next entries, and a request needing them could wait forever."""
        self._reclaimers.append(reclaim)

    def reclaim(self) -> bool:
        """Free one cache entry's device blocks (the scheduler calls it before a request waits or is preempted for
        blocks); False if no holder has any left."""
        return any(reclaim() for reclaim in self._reclaimers)

    # ----- new sequences -----

    def can_allocate(
        self,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        extra: tuple = (),
        shared: Sequence = (),
        step_tokens: int | None = None,
        keep_window: bool = False,
    ) -> AllocationStatus:
        """Whether a new sequence of ``num_tokens`` fits; pass its ``token_ids`` to count cached prefix blocks
        (and its ``shared`` leading blocks, see ``allocate``). ``step_tokens``: the most tokens one step
        computes for it (the scheduler's token budget; None: all at once). OK/LATER counts what ``allocate``
        takes for the first step; NEVER, the most blocks the sequence ever holds (``blocks_needed``; with a side
        pool, also its side-pool groups' peak), in either pool."""
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an integer >= 1, got {num_tokens!r}")
        for pool in range(len(self._pools)):
            if self._pool_peak(pool, num_tokens, step_tokens, 0, keep_window) > self._pools[pool].num_blocks:
                return AllocationStatus.NEVER
        num_lead = self._num_lead(shared)
        found = self._lookup(token_ids, extra, num_lead, keep_window)[1:] if token_ids else (0, self._no_hits())
        num_hit, hits = found
        covers = self._covers(num_tokens, (num_lead + num_hit) * self.block_size, None if keep_window else step_tokens)
        return self._pools_status(self._free_needed(covers, num_lead, num_hit, hits))

    def blocks_needed(
        self, num_tokens: int, step_tokens: int | None = None, num_shared: int = 0, keep_window: bool = False
    ) -> int:
        """The most device blocks a sequence of ``num_tokens`` holds at once, summed over groups, while it
        is computed in steps of at most ``step_tokens`` (None: all at once). A window group holds what
        its window sees plus one step's tokens; a global group every block, less ``num_shared`` leading
        blocks another sequence holds already (in every group with ``keep_window``, which makes window groups
        count as global ones: an upper bound whatever the caller releases). Main-pool groups only: a side-pool
        group's blocks are not the main pool's (``can_allocate`` checks them against the side pool)."""
        return self._pool_peak(0, num_tokens, step_tokens, num_shared, keep_window)

    def _pool_peak(
        self, pool: int, num_tokens: int, step_tokens: int | None, num_shared: int, keep_window: bool
    ) -> int:
        """``blocks_needed`` summed over the groups drawing from pool ``pool`` (0: main, 1: side)."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
        step = num_tokens if step_tokens is None else min(self._check_step(step_tokens), num_tokens)
        return sum(
            self._group_peak(spec, num_tokens, step, num_shared, keep_window)
            for spec in self.groups
            if spec.pool == pool
        )

    def _group_peak(self, spec: KVGroupSpec, num_tokens: int, step: int, num_shared: int, keep_window: bool) -> int:
        if spec.sliding_window is None or keep_window:
            return self.blocks_for(num_tokens) - num_shared
        span = spec.sliding_window - 1 + step  # tokens a step's queries see, from the first one's window start
        return min(self.blocks_for(num_tokens), (span + self.block_size - 2) // self.block_size + 1)

    def cached_prefix_tokens(self, token_ids: Sequence[int], extra: tuple = ()) -> int:
        """Prompt tokens ``allocate`` would find cached now (no side effects)."""
        return self._lookup(token_ids, extra)[1] * self.block_size

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        extra: tuple = (),
        shared: Sequence = (),
        step_tokens: int | None = None,
        keep_window: bool = False,
    ) -> int:
        """Blocks for a new sequence's prompt, reusing cached prefix blocks; returns the prompt tokens
        already computed (whole blocks, never the last token). ``extra`` salts the hashes (LoRA, modules).

        Global groups get blocks for the whole prompt. A window group gets the cached blocks its window
        still sees and blocks for ``step_tokens`` tokens past the hit (None: the whole prompt); the caller
        grows it with ``reserve`` as the prompt is computed.

        ``shared``: full device blocks another holder keeps (Prompt Cache modules) that become this
        sequence's first blocks as they are; they count as computed and are not hashed: the hash chain
        starts after them, so ``extra`` must identify what they hold. With several KV groups, one sequence of
        block ids per group (each group's blocks of the same tokens). A group with a window shares them only with
        ``keep_window`` (see the module docstring)."""
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id} already has KV blocks; free it before allocating again")
        if not token_ids:
            raise ValueError(f"sequence {seq_id}: cannot allocate KV blocks for an empty prompt")
        leads = self._leads(shared, len(token_ids), keep_window)
        num_lead = len(leads[0])
        hashes, num_hit, hits = self._lookup(token_ids, extra, num_lead, keep_window)
        computed = (num_lead + num_hit) * self.block_size
        covers = self._covers(len(token_ids), computed, None if keep_window else step_tokens)
        self._check_free(self._free_needed(covers, num_lead, num_hit, hits), f"sequence {seq_id}")
        for pool, lead in zip(self._group_pools, leads, strict=True):
            pool.touch(lead)
        for pool, group_hits in zip(self._group_pools, hits, strict=True):  # every hit before any allocation,
            pool.touch(group_hits)  # so allocating cannot evict one
        tables = []
        for pool, lead, group_hashes, group_hits, cover in zip(
            self._group_pools, leads, hashes, hits, covers, strict=True
        ):
            new = pool.allocate(self.blocks_for(cover) - num_lead - num_hit)
            released = num_hit - len(group_hits)  # hit blocks out of a window group's sight (none with a lead)
            cached = num_lead + num_hit
            tables.append(_GroupTable(lead + group_hits + new, cover, group_hashes, cached, released))
        self._seqs[seq_id] = _Sequence(tables, tuple(extra))
        self._query_tokens += len(token_ids) - num_lead * self.block_size
        self._hit_tokens += num_hit * self.block_size
        return computed

    def _covers(self, num_tokens: int, computed: int, step_tokens: int | None) -> list[int]:
        """Token slots each group gets at allocation: a window group only up to the first step's end."""
        if step_tokens is None:
            return [num_tokens] * len(self.groups)
        step = self._check_step(step_tokens)
        return [num_tokens if g.sliding_window is None else min(num_tokens, computed + step) for g in self.groups]

    def _free_needed(self, covers: list[int], num_lead: int, num_hit: int, hits: list[list[Block]]) -> list[int]:
        """Free blocks an allocation takes in each pool: new blocks, and hit blocks no sequence holds."""
        needed = [0] * len(self._pools)
        for spec, cover, group_hits in zip(self.groups, covers, hits, strict=True):
            unheld = sum(1 for block in group_hits if block.ref_count == 0)
            needed[spec.pool] += self.blocks_for(cover) - num_lead - num_hit + unheld
        return needed

    def _pools_status(self, needed: Sequence[int]) -> AllocationStatus:
        """``_status`` over the pools: the worst of each pool's."""
        statuses = [self._status(n, pool) for n, pool in zip(needed, self._pools, strict=True)]
        for status in (AllocationStatus.NEVER, AllocationStatus.LATER):
            if status in statuses:
                return status
        return AllocationStatus.OK

    def _has_free(self, needed: Sequence[int]) -> bool:
        return all(n <= pool.num_free for n, pool in zip(needed, self._pools, strict=True))

    def _check_free(self, needed: Sequence[int], what: str) -> None:
        """NoFreeBlocksError naming the first pool with fewer free blocks than ``needed`` says."""
        for n, pool, name in zip(needed, self._pools, ("", "side-pool "), strict=False):
            if n > pool.num_free:
                raise NoFreeBlocksError(
                    f"{what} needs {n} free {name}blocks; {pool.num_free} of {pool.num_blocks} are free"
                )

    @staticmethod
    def _check_step(step_tokens: int) -> int:
        if not isinstance(step_tokens, int) or step_tokens < 1:
            raise ValueError(f"step_tokens must be an integer >= 1 or None, got {step_tokens!r}")
        return step_tokens

    def _num_lead(self, shared: Sequence) -> int:
        """How many leading blocks ``shared`` (one group's ids, or one sequence of ids per group) names per group."""
        return len(shared) if len(self.groups) == 1 or not shared else len(shared[0])

    def _leads(self, shared: Sequence, num_tokens: int, keep_window: bool) -> list[list[Block]]:
        """Per group, the shared leading blocks (see ``allocate``)."""
        if not shared:
            return [[] for _ in self.groups]
        per_group = [shared] if len(self.groups) == 1 else list(shared)
        if len(per_group) != len(self.groups) or len({len(s) for s in per_group}) != 1:
            raise KVCacheError(
                f"shared leading blocks need one sequence of block ids per KV group ({len(self.groups)}), "
                "each as long as the others"
            )
        windows = [g.sliding_window for g in self.groups if g.sliding_window is not None]
        if windows and not keep_window:
            raise KVCacheError(
                f"shared leading blocks in a KV group with a sliding window (sliding_window={windows[0]}) need "
                "keep_window=True: the caller releases what the window no longer sees, by position"
            )
        return [self._shared_blocks(s, num_tokens, pool) for s, pool in zip(per_group, self._group_pools, strict=True)]

    def _shared_blocks(self, shared: Sequence[int], num_tokens: int, pool: BlockPool) -> list[Block]:
        """The blocks ``shared`` names in a group's ``pool``."""
        if not shared:
            return []
        if len(shared) * self.block_size > num_tokens:
            raise KVCacheError(f"{len(shared)} shared blocks hold more than the sequence's {num_tokens} tokens")
        blocks = [pool.block(b) for b in shared]
        unheld = [b.block_id for b in blocks if b.ref_count < 1]
        if unheld:
            raise KVCacheError(f"shared blocks {unheld} are free; their holder must keep them while they are shared")
        return blocks

    def _no_hits(self) -> list[list[Block]]:
        return [[] for _ in self.groups]

    def _lookup(
        self, token_ids: Sequence[int], extra: tuple, skip: int = 0, keep_window: bool = False
    ) -> tuple[list[list[int | None]], int, list[list[Block]]]:
        """Per group, the hashes of all full prompt blocks; the longest hit (in blocks after ``skip``) valid
        for every group; per group, the hit blocks it takes (a window group only those its window sees, unless
        ``keep_window``: then every group is looked up as a global one). The first ``skip`` blocks (shared as
        they are) get no hash (None); the chain starts after them."""
        if not self.enable_prefix_caching:
            return self._no_hits(), 0, self._no_hits()
        specs = [KVGroupSpec() for _ in self.groups] if keep_window else self.groups
        rest = token_ids[skip * self.block_size :]
        hashes = [
            [None] * skip + hash_prompt_blocks(rest, self.block_size, (g, *extra)) for g in range(len(self.groups))
        ]
        bound = max(0, (len(token_ids) - 1) // self.block_size - skip)
        found: list[list[Block | None]] = [[] for _ in self.groups]
        for g in sorted(range(len(self.groups)), key=lambda g: specs[g].sliding_window is not None):
            found[g] = self._find_cached(hashes[g][skip : skip + bound], specs[g], self._group_pools[g])
            if specs[g].sliding_window is None:  # global groups first: a hit needs their whole chain
                bound = len(found[g])
        num_hit = self._longest_hit(found, bound, specs)
        hits = [
            blocks[:num_hit] if spec.sliding_window is None else blocks[num_hit - self._seen(spec, num_hit) : num_hit]
            for blocks, spec in zip(found, specs, strict=True)
        ]
        return hashes, num_hit, hits

    def _find_cached(self, group_hashes: list[int | None], spec: KVGroupSpec, pool: BlockPool) -> list[Block | None]:
        """A global group's cached blocks in its ``pool`` up to its first miss; a window group's per block (None:
        missing)."""
        blocks: list[Block | None] = []
        for block_hash in group_hashes:
            block = pool.lookup(block_hash)
            if block is None and spec.sliding_window is None:
                break
            blocks.append(block)
        return blocks

    def _longest_hit(self, found: list[list[Block | None]], bound: int, specs: Sequence[KVGroupSpec]) -> int:
        """The longest hit, at most ``bound`` blocks, each window group can take: one whose next query
        sees only cached blocks."""
        windows = [(spec, blocks) for spec, blocks in zip(specs, found, strict=True) if spec.sliding_window]
        runs = [(spec, _cached_runs(blocks)) for spec, blocks in windows]
        for num_hit in range(bound, 0, -1):
            if all(run[num_hit - 1] >= self._seen(spec, num_hit) for spec, run in runs):
                return num_hit
        return 0

    def _seen(self, spec: KVGroupSpec, num_hit: int) -> int:
        """Of ``num_hit`` computed blocks, the trailing ones a window group's next query still sees."""
        return min(num_hit, -(-(spec.sliding_window - 1) // self.block_size))

    def allocate_empty(self, seq_id: int) -> None:
        """A new sequence holding no slot yet in any group: a compressing policy then reserves per group."""
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id} already has KV blocks; free it before allocating again")
        self._seqs[seq_id] = _Sequence([_GroupTable([], 0) for _ in self.groups], ())

    def allocate_shared_groups(self, seq_id: int, shared: Sequence[Sequence[int]]) -> None:
        """A new sequence whose group g starts with the full blocks ``shared[g]`` another holder keeps (a Prompt
        Cache module stored per layer by a compressing policy), held as they are; it grows per group with
        ``reserve`` like ``allocate_empty``'s."""
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id} already has KV blocks; free it before allocating again")
        if len(shared) != len(self.groups):
            raise ValueError(f"need shared blocks per KV group ({len(self.groups)}), got {len(shared)}")
        leads = [  # every group's resolved before any is touched: a bad id takes nothing
            self._shared_blocks(group_shared, len(group_shared) * self.block_size, pool)
            for group_shared, pool in zip(shared, self._group_pools, strict=True)
        ]
        tables = []
        for lead, pool in zip(leads, self._group_pools, strict=True):
            pool.touch(lead)
            tables.append(_GroupTable(lead, len(lead) * self.block_size, num_cached=len(lead)))
        self._seqs[seq_id] = _Sequence(tables, ())

    # ----- growing, shrinking, caching, sharing -----

    def reserve(self, seq_id: int, group_slots: Sequence[int]) -> bool:
        """Grow each group to at least ``group_slots[g]`` slots; False, changing nothing, if the free
        blocks do not suffice. Groups already holding more keep what they hold (see ``shrink``).
        With window groups, call ``release_out_of_window`` first, so the blocks it frees count."""
        tables = self._resident(seq_id).tables
        grow = [max(0, n - t.num_slots) for t, n in zip(tables, self._check_group_slots(group_slots), strict=True)]
        if not self._has_free(self._grow_needed(range(len(tables)), tables, grow)):
            return False
        for table, n, pool in zip(tables, grow, self._group_pools, strict=True):
            self._grow(table, n, pool)
        return True

    def _grow_needed(self, groups: Sequence[int], tables: list[_GroupTable], grow: Sequence[int]) -> list[int]:
        """Free blocks, per pool, that growing group ``groups[i]`` by ``grow[i]`` slots takes."""
        needed = [0] * len(self._pools)
        for g, n in zip(groups, grow, strict=True):
            needed[self.groups[g].pool] += self._blocks_needed(tables[g], n)
        return needed

    def shrink(self, seq_id: int, group: int, num_slots: int) -> None:
        """Keep only the first ``num_slots`` slots of a group (a policy compacted the ones it keeps there)
        and return the blocks past them to the pool."""
        table = self._resident(seq_id).tables[self._group_index(group)]
        if self.groups[group].sliding_window is not None:
            raise KVCacheError(f"KV group {group} has a sliding window; only groups without one can shrink")
        if not isinstance(num_slots, int) or not 0 <= num_slots <= table.num_slots:
            raise ValueError(
                f"sequence {seq_id} group {group} holds {table.num_slots} slots; cannot shrink to {num_slots!r}"
            )
        if num_slots == table.num_slots and not table.hashes and not table.num_cached:
            return  # nothing to give back, nothing hashed: most groups of a compressed decode step
        keep = self.blocks_for(num_slots)
        self._group_pools[group].free(reversed(table.blocks[keep:]))
        del table.blocks[keep:]
        table.num_slots = num_slots
        table.hashes, table.num_cached = table.hashes[:0], 0  # slots no longer match token blocks

    def _check_group_slots(self, group_slots: Sequence[int]) -> list[int]:
        slots = list(group_slots)
        if len(slots) != len(self.groups) or any(not isinstance(n, int) or n < 0 for n in slots):
            raise ValueError(f"need one slot count >= 0 per KV group ({len(self.groups)}), got {slots!r}")
        return slots

    def append_slots(self, seq_id: int, num_new_tokens: int, group: int | None = None) -> bool:
        """Room for ``num_new_tokens`` more slots in every group (or one ``group``), each past its own
        count; False, changing nothing, if the free blocks do not suffice. Shared partial last blocks
        are copied on write. (Window groups allocated lazily lag behind: grow them with ``reserve``.)"""
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0, got {num_new_tokens!r}")
        tables = self._resident(seq_id).tables
        chosen = range(len(tables)) if group is None else [self._group_index(group)]
        if not self._has_free(self._grow_needed(chosen, tables, [num_new_tokens] * len(chosen))):
            return False
        for g in chosen:
            self._grow(tables[g], num_new_tokens, self._group_pools[g])
        return True

    def _blocks_needed(self, table: _GroupTable, num_new: int) -> int:
        grow = self.blocks_for(table.num_slots + num_new) - table.num_entries
        return grow + self._must_copy(table, num_new)

    def _must_copy(self, table: _GroupTable, num_new: int) -> bool:
        return num_new > 0 and table.num_slots % self.block_size != 0 and table.blocks[-1].ref_count > 1

    def _grow(self, table: _GroupTable, num_new: int, pool: BlockPool) -> None:
        """Grow a table by ``num_new`` slots from its group's ``pool`` (copy-on-write included)."""
        if self._must_copy(table, num_new):
            src = table.blocks[-1]
            dst = pool.allocate(1)[0]
            pool.free([src])
            table.blocks[-1] = dst
            self._pending_copies.append((src.block_id, dst.block_id))
        table.num_slots += num_new
        table.blocks += pool.allocate(self.blocks_for(table.num_slots) - table.num_entries)

    def release_out_of_window(
        self, seq_id: int, num_computed_tokens: int, unseen: Callable[[int], int] | None = None
    ) -> int:
        """Give back, in each window group, the blocks no query at a position >= ``num_computed_tokens``
        sees (their last token is before ``num_computed_tokens - W + 1``); returns the table entries
        released. Freed blocks keep their hash. Idempotent; groups without a window keep everything.

        ``unseen(W)``: for a sequence whose positions are not its slot indices (a Prompt Cache prompt), how many
        of its leading slots no query still to come sees in a window of W positions; the full blocks among them
        go. A block shared with another holder (a module) only loses this sequence's reference."""
        if not isinstance(num_computed_tokens, int) or num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be an integer >= 0, got {num_computed_tokens!r}")
        released = 0
        tables = self._resident(seq_id).tables
        for spec, table, pool in zip(self.groups, tables, self._group_pools, strict=True):
            window = spec.sliding_window
            if window is not None:
                before = (
                    num_computed_tokens - window + 1 if unseen is None else min(unseen(window), num_computed_tokens)
                )
                released += self._release(
                    table, min(max(0, before) // self.block_size, table.num_slots // self.block_size), pool
                )
        return released

    def _release(self, table: _GroupTable, num_released: int, pool: BlockPool) -> int:
        """Release the table's entries up to ``num_released`` (full blocks only) to its group's ``pool``, each
        batch back to front."""
        n = num_released - table.released
        if n <= 0:
            return 0
        pool.free(reversed(table.blocks[:n]))
        del table.blocks[:n]
        table.released = num_released
        return n

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
            self._register(table, num_full, self._group_pools[g])

    def _extend_hashes(self, table: _GroupTable, token_ids: Sequence[int], num_full: int, extra: tuple) -> None:
        bs = self.block_size
        for i in range(len(table.hashes), num_full):
            parent = table.hashes[-1] if table.hashes else None
            table.hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], extra))

    def _register(self, table: _GroupTable, num_full: int, pool: BlockPool) -> None:
        for i in range(max(table.num_cached, table.released), num_full):  # released blocks are not held
            if table.hashes[i] is not None:  # shared leading blocks have none
                pool.cache(table.blocks[i - table.released], table.hashes[i])
        table.num_cached = max(table.num_cached, num_full)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (parallel samples, beam search)."""
        parent = self._resident(parent_seq_id)
        if child_seq_id in self._seqs:
            raise KVCacheError(f"cannot fork sequence {parent_seq_id} into {child_seq_id}: {child_seq_id} exists")
        child = _Sequence([table.copy() for table in parent.tables], parent.extra)
        for table, pool in zip(child.tables, self._group_pools, strict=True):
            pool.touch(table.blocks)
        self._seqs[child_seq_id] = child

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (device or host), each table back to front."""
        seq = self._get(seq_id)
        pools = [self._host()] * len(seq.tables) if seq.swapped else self._group_pools
        for table, pool in zip(seq.tables, pools, strict=True):
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
        for table in seq.tables:  # every group is the main pool's: a manager with a side pool has no host pool
            written, table.num_cached = table.num_cached, 0
            self._register(table, min(written, len(table.hashes)), self.pool)
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
        """Block ids by position (entry j holds tokens j*block_size ..); released window entries read 0 (the
        first id of the group's pool: ``num_blocks`` in a side-pool group)."""
        table = self._resident(seq_id).tables[self._group_index(group)]
        return [self._group_pools[group].first_id] * table.released + [block.block_id for block in table.blocks]

    def block_tables(self, seq_id: int) -> tuple[tuple[int, ...], ...]:
        """``block_table`` of every group, in group order (what a step hands the runner)."""
        return tuple(
            (pool.first_id,) * table.released + tuple(block.block_id for block in table.blocks)
            for table, pool in zip(self._resident(seq_id).tables, self._group_pools, strict=True)
        )

    def held_blocks(self, seq_id: int) -> list[int]:
        """Device blocks a resident sequence holds, group after group (released window entries are not held)."""
        return [block.block_id for table in self._resident(seq_id).tables for block in table.blocks]

    def slots(self, seq_id: int, start: int, end: int, group: int = 0) -> list[int]:
        """Device slots (``block * block_size + offset``) of the sequence's tokens ``start .. end - 1``."""
        table, bs = self.block_table(seq_id, group), self.block_size
        first_held = self._resident(seq_id).tables[group].released * bs
        if start < first_held and start < end:
            raise KVCacheError(
                f"sequence {seq_id} group {group}: token {start} is out of the sliding window; "
                f"tokens before {first_held} were released"
            )
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    def num_slots(self, seq_id: int, group: int = 0) -> int:
        """Token slots a group's table covers, released window entries included."""
        return self._get(seq_id).tables[self._group_index(group)].num_slots

    def is_swapped(self, seq_id: int) -> bool:
        return self._get(seq_id).swapped

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def usage(self) -> KVUsage:
        resident = [seq for seq in self._seqs.values() if not seq.swapped]
        host, side = self.host_pool, self.side_pool
        return KVUsage(
            total_blocks=self.pool.num_blocks,
            used_blocks=self.pool.num_blocks - self.pool.num_free,
            free_blocks=self.pool.num_free,
            cached_blocks=self.pool.num_cached_free,
            host_total_blocks=host.num_blocks if host else 0,
            host_used_blocks=host.num_blocks - host.num_free if host else 0,
            num_sequences=len(self._seqs),
            waste_slots=sum(t.num_entries * self.block_size - t.num_slots for seq in resident for t in seq.tables),
            prefix_query_tokens=self._query_tokens,
            prefix_hit_tokens=self._hit_tokens,
            side_total_blocks=side.num_blocks if side else 0,
            side_used_blocks=side.num_blocks - side.num_free if side else 0,
        )

    def leaked_blocks(self) -> int:
        """Blocks (both device pools and host) whose reference count differs from the block tables that hold them:
        0 unless a block was lost or freed twice. A walk over every table: for audits (an idle server, tests), not
        steps."""
        held: Counter[tuple[bool, int]] = Counter()
        for seq in self._seqs.values():
            for table in seq.tables:
                held.update((seq.swapped, block.block_id) for block in table.blocks)
        pools = [(False, pool) for pool in self._pools] + ([(True, self.host_pool)] if self.host_pool else [])
        return sum(block.ref_count != held[host, block.block_id] for host, pool in pools for block in pool.blocks)

    def num_request_sequences(self) -> int:
        """Sequences of requests (ids >= 0; Prompt Cache module sequences have negative ids)."""
        return sum(seq_id >= 0 for seq_id in self._seqs)

    def device_status(self, num_blocks: int) -> AllocationStatus:
        """Whether ``num_blocks`` blocks of the main pool are free now, may be later, or never can be."""
        return self._status(num_blocks, self.pool)

    def forget_free(self) -> None:
        """Free blocks of every pool stop serving prefix hits (``BlockPool.forget_free``): a tier failed a transfer."""
        for pool in self._pools:
            pool.forget_free()

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
        if self.side_pool is not None:
            raise KVCacheError(
                "swapping is not supported with a side pool (num_side_blocks > 0): there is no host pool; "
                "preempt by recompute"
            )
        if self.host_pool is None:
            raise KVCacheError("swapping needs a host pool; this manager was built with num_host_blocks=0")
        return self.host_pool


def _cached_runs(blocks: list[Block | None]) -> list[int]:
    """For each block, how many consecutive cached blocks end with it."""
    runs, run = [], 0
    for block in blocks:
        run = run + 1 if block is not None else 0
        runs.append(run)
    return runs
