"""Seeded random operations against a simulated KV store: every table must read back its own tokens.

The test plays the runner: it writes each new token into the slot its table names, runs the pending
copy-on-write copies and the swap plans, and never clears a freed block. A wrong prefix hit, a missed
copy or a bad swap plan then shows up as a sequence reading another sequence's token.
"""

from __future__ import annotations

import random

import pytest

from kvserve.kv import AllocationStatus, KVCacheManager, KVGroupSpec

BLOCK = 4


class _Runner:
    """Slot contents per (tier, block id), and the tokens each sequence should read back."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.m = manager
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.tokens: dict[int, list[int]] = {}

    def write(self, seq_id: int, start: int) -> None:
        """Write tokens[start:] of every group through the block tables, after the pending copies."""
        for src, dst in self.m.take_pending_copies():
            self.device[dst] = list(self.device[src])
        for g in range(len(self.m.groups)):
            table = self.m.block_table(seq_id, g)
            for pos in range(start, len(self.tokens[seq_id])):
                slots = self.device.setdefault(table[pos // BLOCK], [None] * BLOCK)
                slots[pos % BLOCK] = (g, self.tokens[seq_id][pos])
        self.m.cache_full_blocks(seq_id, self.tokens[seq_id])

    def read(self, seq_id: int, g: int) -> list[int]:
        table = self.m.block_table(seq_id, g)
        slots = [self.device[table[pos // BLOCK]][pos % BLOCK] for pos in range(self.m.num_slots(seq_id, g))]
        assert all(slot[0] == g for slot in slots)
        return [slot[1] for slot in slots]


def _check_invariants(m: KVCacheManager, runner: _Runner) -> None:
    for pool, swapped in [(m.pool, False), (m.host_pool, True)]:
        refs = [0] * pool.num_blocks
        for seq_id in runner.tokens:
            if m.is_swapped(seq_id) == swapped:
                for table in m._seqs[seq_id].tables:
                    for block in table.blocks:
                        refs[block.block_id] += 1
        assert [b.ref_count for b in pool.blocks] == refs
        assert sorted(pool.free_block_ids()) == [i for i, r in enumerate(refs) if r == 0]
        assert all(pool.lookup(b.block_hash) is b for b in pool.blocks if b.block_hash is not None)
    for seq_id, tokens in runner.tokens.items():
        for g in range(len(m.groups)):
            assert m.num_slots(seq_id, g) == len(tokens)
            if not m.is_swapped(seq_id):
                assert len(m.block_table(seq_id, g)) == -(-len(tokens) // BLOCK)
                assert runner.read(seq_id, g) == tokens
    usage = m.usage()
    assert usage.used_blocks + usage.free_blocks == usage.total_blocks


def _step(m: KVCacheManager, runner: _Runner, rng: random.Random, next_id: list[int]) -> None:
    live = [s for s in runner.tokens if not m.is_swapped(s)]
    swapped = [s for s in runner.tokens if m.is_swapped(s)]
    op = rng.choice(["allocate", "allocate", "append", "append", "fork", "free", "swap_out", "swap_in"])
    if op == "allocate":
        # Prompts from a few shared stems, so prefix hits, partial hits and evictions all happen.
        prompt = [rng.randrange(3)] * rng.randrange(0, 9) + [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
        status = m.can_allocate(len(prompt), prompt)
        if status is AllocationStatus.OK:
            seq_id = next_id[0]
            next_id[0] += 1
            hit = m.allocate(seq_id, prompt)
            assert hit % BLOCK == 0 and hit < len(prompt)
            runner.tokens[seq_id] = prompt
            runner.write(seq_id, hit)
    elif op == "append" and live:
        seq_id, n = rng.choice(live), rng.randrange(1, 6)
        if m.append_slots(seq_id, n):
            start = len(runner.tokens[seq_id])
            runner.tokens[seq_id] += [rng.randrange(5) for _ in range(n)]
            runner.write(seq_id, start)
    elif op == "fork" and live:
        parent = rng.choice(live)
        m.fork(parent, next_id[0])
        runner.tokens[next_id[0]] = list(runner.tokens[parent])
        next_id[0] += 1
    elif op == "free" and runner.tokens:
        seq_id = rng.choice(list(runner.tokens))
        m.free(seq_id)
        del runner.tokens[seq_id]
    elif op == "swap_out" and live:
        seq_id = rng.choice(live)
        if m.can_swap_out(seq_id) is AllocationStatus.OK:
            for dev, host in m.swap_out(seq_id):
                runner.host[host] = list(runner.device[dev])
    elif op == "swap_in" and swapped:
        seq_id = rng.choice(swapped)
        if m.can_swap_in(seq_id) is AllocationStatus.OK:
            for host, dev in m.swap_in(seq_id):
                runner.device[dev] = list(runner.host[host])


@pytest.mark.parametrize("num_groups", [1, 2])
@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_invariants_and_contents(seed, num_groups):
    groups = [KVGroupSpec(layer_ids=(g,)) for g in range(num_groups)]
    m = KVCacheManager(24, block_size=BLOCK, groups=groups, num_host_blocks=12)
    runner = _Runner(m)
    rng = random.Random(seed)
    next_id = [0]
    for _ in range(400):
        _step(m, runner, rng, next_id)
        _check_invariants(m, runner)
    assert m.usage().prefix_hit_tokens > 0
