"""Module KV: encoded once at schema positions, kept as ref-counted blocks of the paged pool, evicted LRU.

Each module's attention states are computed by a prefill of its own tokens at its schema positions,
into blocks of the engine's pool held by a *module sequence* of the KV manager (negative ids keep them
apart from requests). Prompt Cache's rule confines a module's attention to the module; a module given a
*context* (the schema's shared prefix: BOS, the system turn, text that precedes every module in every
prompt) also attends to it, as it does in the plain prompt. Models that park attention on BOS (Gemma)
need that: a module encoded without it has states the plain prompt never produces. (APE, Yang et al.,
ICLR'25, encodes its parallel contexts after a shared prefix for the same reason.) Such a module is
prefilled after its context in a scratch sequence, and its own slots are copied into its block-aligned
module sequence at the end, so requests share its blocks as they share any module's.

The store allocates the blocks and hands out an ``EncodeJob``; the engine queues it to the scheduler,
which admits and chunks it like any prefill (interleaved with other requests' decodes), and the store
takes the blocks back once it is done (``finish_encoding``). Requests that import a module share its
blocks through their block tables (``KVCacheManager.allocate(shared=)``), wait until it is encoded, and
*pin* the module until they finish, so a preempted request can share them again.

Tiers: ``device`` keeps the module sequence for as long as the module is stored. ``host`` keeps the
keys and values in CPU tensors (pinned on CUDA) and copies them into device blocks when a request
pins the module; the device copy goes back to the pool when the last pin is released. Either way the
module's full blocks are registered for prefix caching under the module's own key, so a device copy
freed a moment ago is found again instead of being encoded or copied anew. With a folder of module files
(``disk.py``), a module is loaded from its file instead of encoded when a valid one is there, and each
encoding is written to one.

Memory: the stored modules' bytes in their tier stay under ``budget_bytes``; past it the least
recently used module is evicted (a pinned one keeps its device blocks until its last pin goes).

Sliding-window KV groups (Gemma 3): a module sequence holds blocks in every group and keeps all of them, the
window groups' too (``KVCacheManager`` ``keep_window``). Which of them an importer's window still sees depends on
where the importer's queries sit (an argument inside a module sees the module around it), so the module keeps
them all and each importer releases its own references by position as it goes.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.errors import KVServeError
from kvserve.kv.block_pool import NoFreeBlocksError
from kvserve.kv.manager import KVCacheManager
from kvserve.prompt_cache.cached_module import CachedModule
from kvserve.prompt_cache.disk import ModuleFiles

TIERS = ("device", "host")


class PromptCacheError(KVServeError, ValueError):
    """The prompt cache cannot serve a module now: no free KV blocks, or the module was removed."""


class ModuleRoomError(PromptCacheError):
    """No free KV blocks to load or encode a module now (running requests hold them): a busy server, not a bad
    prompt; the server answers 503 with Retry-After."""


@dataclass(frozen=True)
class EncodeJob:
    """A module's prefill for the scheduler: ``token_ids`` at ``positions`` into sequence ``seq_id``'s blocks,
    from ``computed`` on (the tokens before it were prefix hits). Without a context that is the module itself in
    its module sequence; with one, the context's ``num_context`` tokens and then the module's, in a scratch
    sequence (allocated by the scheduler on admission) whose module slots ``finish_encoding`` copies into the module
    sequence."""

    module: CachedModule
    seq_id: int
    computed: int
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    num_context: int = 0
    found: int = 0  # with a context: the module sequence's first tokens that were prefix hits (kept, not copied)
    cache_salt: tuple = ()  # with a context: the scratch sequence's prefix-hash salt (the scheduler allocates it)


@dataclass(frozen=True)
class ModuleBlocks:
    """A pinned module's device blocks: its full blocks to share, and the slots of its partial last block.
    (With a KV group per layer, what each layer keeps is known once the module is encoded: the scheduler reads
    it from the module sequence when a request importing it is admitted.)"""

    module: CachedModule
    full_blocks: tuple[int, ...]
    tail_slots: tuple[int, ...]
    # With several KV groups of one table each (sliding-window groups): the same per group, group 0's first.
    group_blocks: tuple[tuple[int, ...], ...] = ()
    group_tails: tuple[tuple[int, ...], ...] = ()


@dataclass
class StoreStats:
    encoded_modules: int = 0  # prefills run to encode modules
    encoded_tokens: int = 0  # tokens prefilled, contexts included (a context job's scratch hits counted too)
    host_copies: int = 0  # host-tier modules copied into device blocks
    evictions: int = 0


class ModuleStore:
    def __init__(
        self,
        kv: KVCacheManager,
        cache: AttentionBackend,
        tier: str,
        budget_bytes: int,
        token_bytes: int,
        per_layer_groups: bool = False,
        files: ModuleFiles | None = None,
    ) -> None:
        """``token_bytes``: one token's slot in one block of the pool (every layer, or one with
        ``per_layer_groups``: a compressing policy's group per layer, each keeping its own slots of a module).
        ``files``: where modules are persisted (``prompt_cache_dir``), or None."""
        if tier not in TIERS:
            raise ValueError(f"prompt_cache_tier must be one of {TIERS}, got {tier!r}")
        self.kv, self.cache, self.tier = kv, cache, tier
        self.per_layer_groups, self.files = per_layer_groups, files
        self.budget_bytes, self.token_bytes = budget_bytes, token_bytes
        self.modules: OrderedDict[tuple[str, str], CachedModule] = OrderedDict()  # least recently used first
        self.stats = StoreStats()
        self._seq_ids = itertools.count(-1, -1)
        self._jobs: list[EncodeJob] = []  # encodings not yet handed to the engine
        kv.add_reclaimer(self.evict_unpinned)  # a request short of blocks takes them from unpinned modules

    def take_encode_jobs(self) -> list[EncodeJob]:
        """The encodings to queue to the scheduler, oldest first (each handed out once)."""
        jobs, self._jobs = self._jobs, []
        return jobs

    # ----- contents -----

    def add(
        self,
        key: tuple[str, str],
        token_ids: list[int],
        positions: list[int],
        encode: bool,
        context: tuple[list[int], list[int]] = ([], []),
    ) -> CachedModule:
        """Store a module (replacing none: keys are unique per schema); ``encode`` runs its prefill now, after
        ``context`` (token ids, positions) when one is given."""
        if context[0] and self.per_layer_groups:
            raise ValueError("a module with a context needs one KV group for every layer (its slots are copied)")
        context_ids, context_positions = tuple(context[0]), tuple(context[1])
        digest = hashlib.sha256(
            repr((key, tuple(token_ids), tuple(positions), context_ids, context_positions)).encode()
        ).hexdigest()
        module = CachedModule(
            key, tuple(token_ids), tuple(positions), hash_salt=("prompt-cache-module", digest),
            context_ids=context_ids, context_positions=context_positions,
        )  # fmt: skip
        self.modules[key] = module
        if encode and not (self.tier == "host" and self._load(module)):  # host tier: a loaded module stays there
            self._ensure_device(module)  # the host tier drops the device copy when the encoding's pin goes
            self._enforce_budget(keep=module)
        return module

    def remove(self, key: tuple[str, str]) -> None:
        module = self.modules.pop(key, None)
        if module is not None:
            module.stored = False
            module.host_kv = None
            if any(job.module is module for job in self._jobs):  # its encoding not handed out yet: never run
                self._jobs = [job for job in self._jobs if job.module is not module]
                module.encoding, module.pins = False, module.pins - 1
            if module.pins == 0:
                self._drop_device(module)

    def memory_bytes(self) -> int:
        """Bytes the stored modules take in their tier (device: whole blocks; host: token rows)."""
        return sum(self._bytes(m) for m in self.modules.values())

    def _bytes(self, module: CachedModule) -> int:
        if self.tier == "host":
            return module.num_tokens * self.token_bytes if module.host_kv is not None else 0
        block_bytes = self.token_bytes * self.kv.block_size  # one block of the pool (of one layer, per layer)
        return len(self.kv.held_blocks(module.seq_id)) * block_bytes if module.seq_id is not None else 0

    # ----- use by requests -----

    def pin(self, module: CachedModule) -> ModuleBlocks:
        """Make the module's KV resident in device blocks (encoding it first if it never was) and hold it
        there until ``unpin``."""
        if not module.stored:
            raise PromptCacheError(f"module {module.key[1]!r} of schema {module.key[0]!r} was removed")
        self._ensure_device(module)
        module.pins += 1
        if self.modules.get(module.key) is module:
            self.modules.move_to_end(module.key)
        self._enforce_budget(keep=module)
        if self.per_layer_groups:
            return ModuleBlocks(module, (), ())
        num_full, groups = module.num_tokens // self.kv.block_size, range(len(self.kv.groups))
        blocks = tuple(tuple(self.kv.block_table(module.seq_id, g)[:num_full]) for g in groups)
        tails = tuple(
            tuple(self.kv.slots(module.seq_id, num_full * self.kv.block_size, module.num_tokens, g)) for g in groups
        )
        if len(groups) == 1:
            return ModuleBlocks(module, blocks[0], tails[0])
        return ModuleBlocks(module, blocks[0], tails[0], blocks, tails)

    def unpin(self, module: CachedModule) -> None:
        module.pins -= 1
        if module.pins == 0 and (not module.stored or self.tier == "host"):
            self._drop_device(module)

    # ----- tiers -----

    def _ensure_device(self, module: CachedModule) -> None:
        if module.seq_id is not None:
            return
        seq_id = next(self._seq_ids)
        computed = self._allocate(seq_id, module, module.token_ids, module.hash_salt)
        module.seq_id = seq_id
        if module.host_kv is not None or self._load(module):
            self._copy_in(module, computed)
            if self.tier == "device":  # loaded from its file: the device blocks are its only copy
                module.host_kv = None
            return
        if module.context_ids:
            job = self._context_job(module, computed)
        else:
            job = EncodeJob(module, seq_id, computed, module.token_ids, module.positions)
        module.encoding, module.pins = True, module.pins + 1  # the encoding pins it until done
        self._jobs.append(job)

    def _context_job(self, module: CachedModule, found: int) -> EncodeJob:
        """The module's prefill after its context, in a scratch sequence that the scheduler admits like a prompt
        (blocks when the pool has room, so encodings never hold twice a schema's modules at once; hash salt of
        its own: a later encoding of the same module finds them while the pool keeps them). ``found``: the
        module sequence's first tokens found by prefix hash, which are not copied over."""
        token_ids = module.context_ids + module.token_ids
        scratch = self.kv.blocks_needed(len(token_ids), keep_window=True)  # every group keeps every block
        if scratch + len(self.kv.held_blocks(module.seq_id)) > self.kv.pool.num_blocks:
            self._drop_device(module)
            raise PromptCacheError(
                f"module {module.key[1]!r} ({module.num_tokens} tokens) is encoded after the schema's "
                f"{len(module.context_ids)} prefix tokens in blocks of its own and then copied: the KV pool "
                f"({self.kv.pool.num_blocks} blocks) cannot hold both; give the engine more kv_cache_memory"
            )
        module.encode_seq_id = next(self._seq_ids)
        positions = module.context_positions + module.positions
        salt = ("prompt-cache-context", *module.hash_salt)
        return EncodeJob(module, module.encode_seq_id, 0, token_ids, positions, len(module.context_ids), found, salt)

    def _allocate(self, seq_id: int, module: CachedModule, token_ids: tuple[int, ...], salt: tuple) -> int:
        """Device blocks for ``token_ids`` of a module sequence (or its encoding's scratch sequence), evicting
        unpinned modules if the pool is short. With a group per layer (a compressing policy) the scheduler
        reserves what each layer keeps as the encoding runs."""
        if self.per_layer_groups:
            self.kv.allocate_empty(seq_id)
            return 0
        while True:
            try:
                return self.kv.allocate(seq_id, token_ids, salt, keep_window=True)
            except NoFreeBlocksError as error:
                # Only device-tier modules hold blocks while unpinned; evicting host-tier ones frees none.
                if self.tier == "host" or not self._evict_one(keep=module, pinned_ok=False):
                    raise ModuleRoomError(
                        f"no room to load module {module.key[1]!r} ({module.num_tokens} tokens): {error}; "
                        "give the engine more kv_cache_memory or import fewer modules at once"
                    ) from None

    def finish_encoding(self, job: EncodeJob) -> None:
        """The scheduler ran ``job``: the module sequence's blocks hold the module's keys and values (copied there
        from the scratch sequence after a context; findable by prefix hash); the host tier keeps a copy of them."""
        module = job.module
        module.encoding = False
        if job.num_context:
            pairs = []
            for g in range(len(self.kv.groups)):  # each group's slots (a slot copy moves every row of its block)
                src = self.kv.slots(job.seq_id, job.num_context + job.found, len(job.token_ids), g)
                pairs += zip(src, self.kv.slots(module.seq_id, job.found, module.num_tokens, g), strict=True)
            self.cache.copy_slots(pairs)
            self.kv.free(job.seq_id)
            module.encode_seq_id = None
        self.kv.cache_full_blocks(module.seq_id, module.token_ids)
        self.stats.encoded_modules += 1
        self.stats.encoded_tokens += len(job.token_ids) - job.computed
        keep = self.tier == "host" and module.stored
        if keep or (self.files is not None and self.files.writable):
            k, v = self.cache.read_slots(self.kv.slots(module.seq_id, 0, module.num_tokens))
            k, v = _to_host(k), _to_host(v)
            if keep:
                module.host_kv = (k, v)
            if self.files is not None:
                self.files.save(module, k, v)
        self.unpin(module)
        self._enforce_budget(keep=module)

    def _load(self, module: CachedModule) -> bool:
        """Whether the module's keys and values were loaded from its file (now in ``host_kv``)."""
        kv = self.files.load(module) if self.files is not None and not self.per_layer_groups else None
        if kv is None:
            return False
        module.host_kv = (_to_host(kv[0]), _to_host(kv[1]))
        return True

    def _copy_in(self, module: CachedModule, computed: int) -> None:
        k, v = module.host_kv
        slots = self.kv.slots(module.seq_id, computed, module.num_tokens)
        self.cache.write_slots(slots, k[:, computed:], v[:, computed:])
        self.kv.cache_full_blocks(module.seq_id, module.token_ids)
        self.stats.host_copies += 1

    def _drop_device(self, module: CachedModule) -> None:
        if module.encode_seq_id is not None:  # an encoding that will not run now
            if module.encode_seq_id in self.kv:
                self.kv.free(module.encode_seq_id)
            module.encode_seq_id = None
        if module.seq_id is not None:
            self.kv.free(module.seq_id)  # full blocks stay findable by hash until the pool reuses them
            module.seq_id = None

    # ----- eviction -----

    def evict_unpinned(self) -> bool:
        """Evict the least recently used module no request pins that holds device blocks (they go back to the
        pool, still findable by prefix hash); False if none. The KV manager calls it when a request is short of
        blocks: a stored module is a cache, and is encoded again (or found by hash) when next used."""
        for key, module in self.modules.items():
            if module.pins == 0 and not module.encoding and module.seq_id is not None:
                self.remove(key)
                self.stats.evictions += 1
                return True
        return False

    def _enforce_budget(self, keep: CachedModule) -> None:
        while self.memory_bytes() > self.budget_bytes and self._evict_one(keep):
            pass

    def _evict_one(self, keep: CachedModule, pinned_ok: bool = True) -> bool:
        """Evict the least recently used stored module holding memory (not ``keep``, not one being encoded); False
        if none. A pinned module leaves the store but keeps its device blocks until its last pin goes, so evicting
        one frees nothing now (``pinned_ok=False`` when blocks are needed now)."""
        for key, module in self.modules.items():
            # A module being encoded stays: its blocks are in use until then (the budget is enforced again after).
            if module.encoding:
                continue
            if module is not keep and self._bytes(module) > 0 and (pinned_ok or module.pins == 0):
                self.remove(key)
                self.stats.evictions += 1
                return True
        return False


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` (pinned when it comes from CUDA, for fast copies back); a CPU tensor as it is."""
    return t.to("cpu").pin_memory() if t.is_cuda else t
