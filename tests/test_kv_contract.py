"""The KV cache contract without a model: ``Scheduler.update`` applies a ``StepReport`` exactly (counters, the
blocks each compacted group gives back), a module's encoding is admitted, chunked and handed back without
sampling or preemption, and an operation a kind of cache cannot do is refused naming why."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.backend import UnsupportedKVOperation
from kvserve.attention.compressed import CompressedKVCache
from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.attention.offloaded import OffloadedKVCache
from kvserve.core.request import Request, Sequence
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.core.step import SchedulerOutput, StepReport
from kvserve.kv import KVCacheManager
from kvserve.kv.manager import KVGroupSpec
from kvserve.policies import HeavyHitters, make_policy
from kvserve.sampling.sampling_params import SamplingParams

BLOCK = 4


def _request(request_id: str, seq_id: int, tokens: list[int], **fields) -> Request:
    seq = Sequence(seq_id, list(tokens), len(tokens), None, None)
    return Request(request_id, None, list(tokens), SamplingParams(max_tokens=4), [seq], **fields)


def test_update_counts_tokens_and_shrinks_each_compacted_group_to_what_it_kept() -> None:
    kv = KVCacheManager(16, BLOCK, groups=[KVGroupSpec((0,)), KVGroupSpec((1,))], enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(per_layer_groups=True), kv)
    request = _request("a", 0, list(range(10)), kv_policy=HeavyHitters(budget=0.5, min_tokens=1))
    scheduler.add(request)
    out = scheduler.schedule()
    (scheduled,) = out.scheduled
    assert [len(t) for t in scheduled.block_tables] == [2, 2]  # 5 slots kept of 10 in each layer: 2 blocks
    free = kv.pool.num_free
    encoded = scheduler.update(out, StepReport(group_slots={0: (5, 3)}, output_rows=(10,)))
    seq = request.seqs[0]
    assert encoded == [] and seq.num_computed_tokens == 10 and seq.group_slots == [5, 3]
    assert [len(kv.block_table(0, g)) for g in (0, 1)] == [2, 1] and kv.pool.num_free == free + 1


def test_a_module_encoding_is_chunked_never_samples_and_hands_its_blocks_back() -> None:
    kv = KVCacheManager(16, BLOCK, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8), kv)
    module_tokens = list(range(20))
    kv.allocate(-1, module_tokens)  # the store allocates a module's blocks before its encoding runs
    encoding = _request("prompt-cache:s/m", -1, module_tokens, encodes_module=True)
    scheduler.add(encoding)
    assert scheduler.encoding == {-1}
    chunks = []
    while scheduler.encoding:
        out = scheduler.schedule()
        (s,) = out.scheduled
        chunks.append((len(s.token_ids), s.samples, s.ends_prompt))
        done = scheduler.update(out, StepReport(output_rows=(len(s.token_ids),)))
    assert chunks == [(8, False, False), (8, False, False), (4, False, True)]
    assert done == [-1] and not scheduler.has_unfinished()
    assert kv.block_table(-1) and -1 in kv  # the blocks stay with the module sequence


def test_a_cache_refuses_what_its_kind_cannot_do_naming_why() -> None:
    compressed = CompressedKVCache(2, 4, BLOCK, 1, 8, torch.float32, tier="host")
    with pytest.raises(UnsupportedKVOperation, match="in the host tier already"):
        compressed.swap_out([(0, 1)])
    with pytest.raises(UnsupportedKVOperation, match="cannot read slots"):
        compressed.read_slots([0])
    offloaded = OffloadedKVCache(make_policy("full"), "host", 2, 4, BLOCK, 1, 8, torch.float32)
    try:
        with pytest.raises(UnsupportedKVOperation, match="already off the device"):
            offloaded.swap_out([(0, 1)])
    finally:
        offloaded.close()
    reference = ContiguousKVCache(2, 1, 1, 8, 16, torch.float32)
    with pytest.raises(UnsupportedKVOperation, match="reference backend"):
        reference.build_metadata(SchedulerOutput(), {})
