"""KV tiers and transfers (kvserve/kv/tiers.py): host and disk tiers round-trip rows through a
TransferQueue in bfloat16 and uint8, the disk tier leaves no file behind, byte counters, in-order
copies, ``wait`` as the only thing standing between a slow copy and a reader (shown to matter, at the
queue and in the offloading engine), block copies and the double-buffered staging area."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.errors import KVTierError
from kvserve.kv import tiers
from kvserve.kv.tiers import KVTier, RowSpec, StagingBuffers, TransferQueue, gather_rows, scatter_rows
from kvserve.models import LoadedModel, load_model
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

LAYERS, SLOTS = 3, 16


@pytest.fixture
def queue():
    q = TransferQueue("cpu", inline=False)  # the worker thread (inline copies: their own test)
    yield q
    q.close()


def random_rows(count: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (count, *shape), generator=g, dtype=torch.uint8)
    return torch.randn((count, *shape), generator=g).to(dtype)


def make_tier(kind: str, dtype: torch.dtype, path: Path | None = None) -> KVTier:
    rows = {"k": RowSpec((2, 8), dtype), "v": RowSpec((2, 8), dtype)}
    return KVTier(kind, LAYERS, SLOTS, rows, path=path)


def store(queue: TransferQueue, tier: KVTier, name: str, layer: int, index: torch.Tensor, rows: torch.Tensor):
    array = tier.arrays[name][layer].view(SLOTS, -1)
    nbytes = rows.numel() * rows.element_size()
    return queue.store(lambda: scatter_rows(array, index, rows.reshape(index.numel(), -1)), nbytes)


def fetch(queue: TransferQueue, tier: KVTier, name: str, layer: int, index: torch.Tensor):
    spec = tier.rows[name]
    out = torch.full((index.numel(), *spec.shape), 7, dtype=spec.dtype)
    array = tier.arrays[name][layer].view(SLOTS, -1)
    transfer = queue.fetch(
        lambda: gather_rows(array, index, out.view(index.numel(), -1)), index.numel() * spec.row_bytes
    )
    return transfer, out


@pytest.mark.parametrize("kind", ["host", "disk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_tier_round_trips_rows(kind, dtype, queue, tmp_path) -> None:
    tier = make_tier(kind, dtype, tmp_path if kind == "disk" else None)
    assert tier.arrays["k"].shape == (LAYERS, SLOTS, 2, 8) and tier.arrays["k"].dtype == dtype
    assert not tier.arrays["k"].any() and not tier.arrays["v"].any()  # zero-filled
    index = torch.tensor([3, 7, 0, 15])
    keys, values = random_rows(4, (2, 8), dtype, 1), random_rows(4, (2, 8), dtype, 2)
    store(queue, tier, "k", 1, index, keys)
    store(queue, tier, "v", 1, index, values)
    (fk, got_k), (fv, got_v) = fetch(queue, tier, "k", 1, index.flip(0)), fetch(queue, tier, "v", 1, index)
    fk.wait(), fv.wait()
    assert torch.equal(got_k, keys.flip(0)) and torch.equal(got_v, values)
    # The rows sit where they were put, in that layer only: visible through the tier's tensor too.
    assert torch.equal(tier.arrays["k"][1, index], keys)
    assert not tier.arrays["k"][0].any() and not tier.arrays["k"][2].any()
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[index] = False
    assert not tier.arrays["k"][1, untouched].any()
    row_bytes = 2 * 8 * torch.empty((), dtype=dtype).element_size()
    assert tier.slot_bytes() == 2 * row_bytes and tier.slot_bytes(LAYERS) == 2 * row_bytes * LAYERS
    assert tier.nbytes == 2 * row_bytes * LAYERS * SLOTS


def test_disk_tier_leaves_no_file_and_maps_its_data(tmp_path) -> None:
    tier = make_tier("disk", torch.bfloat16, tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked as soon as mapped
    array = tier.arrays["v"]
    array[2, 5] = 1.5  # written through the tensor, read back through it
    assert array[2, 5].eq(1.5).all() and int(array.ne(0).sum()) == 16
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="nowhere"):
        make_tier("disk", torch.bfloat16, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="'ssd'"):
        KVTier("ssd", 1, 1, {"k": RowSpec((1,), torch.uint8)})


def test_bytes_counters_count_what_was_submitted(queue) -> None:
    tier = make_tier("host", torch.bfloat16)
    index = torch.tensor([1, 2, 3])
    store(queue, tier, "k", 0, index, random_rows(3, (2, 8), torch.bfloat16)).wait()
    transfers = [fetch(queue, tier, "k", 0, index)[0], fetch(queue, tier, "v", 2, index[:1])[0]]
    for t in transfers:
        t.wait()
    queue.fetch(lambda: None, 1000).wait()  # whatever the caller says the copy moves
    stats = queue.stats
    assert (stats.bytes_stored, stats.stores) == (3 * 32, 1)
    assert (stats.bytes_fetched, stats.fetches) == (3 * 32 + 32 + 1000, 3)


def test_copies_run_in_submission_order(queue) -> None:
    """A fetch queued right behind a (slow) store of the same rows reads what the store wrote."""
    tier = make_tier("host", torch.bfloat16)
    index = torch.tensor([4, 9])
    rows = random_rows(2, (2, 8), torch.bfloat16, 3)
    array = tier.arrays["k"][0].view(SLOTS, -1)

    def slow_store() -> None:
        time.sleep(0.1)
        scatter_rows(array, index, rows.view(2, -1))

    queue.store(slow_store, rows.numel() * 2)
    transfer, out = fetch(queue, tier, "k", 0, index)  # no wait on the store
    transfer.wait()
    assert torch.equal(out, rows)
    # A later store does not overtake an earlier fetch either.
    first, before = fetch(queue, tier, "k", 0, index)
    store(queue, tier, "k", 0, index, torch.zeros(2, 2, 8, dtype=torch.bfloat16))
    first.wait()
    queue.synchronize()
    assert torch.equal(before, rows) and not tier.arrays["k"][0, index].any()


def test_wait_returns_the_copy_result_and_raises_its_error(queue) -> None:
    assert queue.fetch(lambda: 42, 0).wait() == 42

    def broken() -> None:
        raise RuntimeError("copy failed")

    with pytest.raises(KVTierError, match="a KV tier transfer failed: RuntimeError.'copy failed'") as info:
        queue.store(broken, 0).wait()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert queue.fetch(lambda: "still serving", 0).wait() == "still serving"


def test_a_failed_store_is_raised_by_the_next_check_once(queue) -> None:
    """Nobody waits on a store: its failure waits for ``check`` (the offloaded cache's report of the step)."""

    def broken() -> None:
        raise OSError(5, "Input/output error")

    queue.store(broken, 0)
    queue.store(lambda: None, 0)  # a later store that works does not hide it
    queue.synchronize()
    with pytest.raises(KVTierError, match="Input/output error"):
        queue.check()
    queue.check()  # raised once
    queue.store(broken, 0)
    queue.drain()  # a given-up step forgets it
    queue.check()


def test_wait_is_what_makes_a_slow_copy_visible(queue) -> None:
    """The staging-buffer hazard: without ``wait`` a reader sees the old contents; after it, the new."""
    staging = torch.zeros(4, 8)
    source = torch.arange(32, dtype=torch.float32).view(4, 8)
    written = threading.Event()

    def slow_copy() -> None:
        time.sleep(0.2)
        gather_rows(source, torch.arange(4), staging)
        written.set()

    transfer = queue.fetch(slow_copy, staging.numel() * 4)
    early = staging.clone()  # what a reader that forgot to wait would get
    assert not written.is_set() and not early.any()  # the hazard is real: the copy has not landed yet
    transfer.wait()
    assert written.is_set() and torch.equal(staging, source)


def test_inline_copies_run_at_submission_where_compute_takes_every_core(monkeypatch) -> None:
    """With no core left for a worker, each copy runs when it is submitted (a store has landed before the next
    line runs, a fetch's rows are there before ``wait``), errors still surface at ``wait``, bytes are counted."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # one core, one compute thread (autouse)
    q = TransferQueue("cpu")
    assert q.inline and q._worker is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert not TransferQueue("cpu").inline  # a free core: the worker overlaps
    tier = make_tier("host", torch.float32)
    index, rows = torch.tensor([2, 5]), random_rows(2, (2, 8), torch.float32, 4)
    store(q, tier, "k", 1, index, rows)  # not waited on
    assert torch.equal(tier.arrays["k"][1, index], rows)
    transfer, out = fetch(q, tier, "k", 1, index.flip(0))
    assert torch.equal(out, rows.flip(0))
    transfer.wait()

    def broken() -> None:
        raise RuntimeError("copy failed")

    failed = q.store(broken, 0)
    with pytest.raises(KVTierError, match="copy failed"):
        failed.wait()
    assert q.fetch(lambda: "still serving", 0).wait() == "still serving"
    assert (q.stats.bytes_stored, q.stats.bytes_fetched) == (2 * 64, 2 * 64)
    q.close()


def test_staging_buffers_alternate_by_layer_and_grow() -> None:
    buffers = StagingBuffers({"k": RowSpec((2, 4), torch.float32), "v": RowSpec((3,), torch.uint8)}, "cpu")
    layer0, layer1, layer2 = (buffers.get("k", layer, 4) for layer in range(3))
    assert layer0.shape == (4, 2, 4) and layer0.dtype == torch.float32
    assert layer0.data_ptr() != layer1.data_ptr()  # consecutive layers never share a buffer
    assert layer2.data_ptr() == layer0.data_ptr()  # same parity: reused
    assert buffers.get("v", 0, 4).data_ptr() != layer0.data_ptr() and buffers.get("v", 0, 4).shape == (4, 3)
    assert buffers.get("k", 0, 2).data_ptr() == layer0.data_ptr()  # fewer rows: a view of the same buffer
    grown = buffers.get("k", 0, 6)  # more than it holds: replaced by one twice as large (at least as needed)
    assert grown.shape == (6, 2, 4) and grown.data_ptr() != layer0.data_ptr()
    assert buffers._buffers[("k", 0)].shape[0] == 8
    assert buffers.get("k", 1, 4).data_ptr() == layer1.data_ptr()  # the other parity is left alone
    assert buffers.get("k", 2, 20).shape == (20, 2, 4) and buffers._buffers[("k", 0)].shape[0] == 20


def test_tier_copy_blocks_copies_every_layer() -> None:
    tier = make_tier("host", torch.bfloat16)
    block = 4  # 16 slots: 4 blocks
    for name in ("k", "v"):
        tier.arrays[name].copy_(random_rows(LAYERS * SLOTS, (2, 8), torch.bfloat16, 5).view(LAYERS, SLOTS, 2, 8))
    before = {name: a.clone() for name, a in tier.arrays.items()}
    tier.copy_blocks([(0, 2), (3, 1)], block)
    for name, array in tier.arrays.items():
        old = before[name].view(LAYERS, 4, block, 2, 8)
        new = array.view(LAYERS, 4, block, 2, 8)
        assert torch.equal(new[:, 2], old[:, 0]) and torch.equal(new[:, 1], old[:, 3])
        assert torch.equal(new[:, 0], old[:, 0]) and torch.equal(new[:, 3], old[:, 3])


# ----- the offloading engine with slow copies -----

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=3, max_position_embeddings=256, seed=3)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    return load_model(write_tiny_model(tmp_path_factory.mktemp("tiers"), SPEC), dtype=torch.float32)


def generate(loaded: LoadedModel, **options) -> list[list[int]]:
    config = EngineConfig(
        model=str(loaded.path), dtype="float32", block_size=4, kv_cache_memory="2MiB", swap_space=0, **options
    )
    engine = LLMEngine(config, loaded)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 290, (n,), generator=g).tolist() for n in (21, 6, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.close()
    return [done[i].outputs[0].token_ids for i in ids]


def test_offloaded_engine_waits_for_slow_fetches(loaded, monkeypatch) -> None:
    """Every fetch takes 5 ms on the transfer thread: the tokens must not change (the compute thread
    waits for each fetch before attending), and equal the device-resident paged engine's."""
    paged = generate(loaded)
    offloaded = generate(loaded, kv_offload="host")
    calls = []

    def slow_gather(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        time.sleep(0.005)
        calls.append(threading.current_thread().name)
        tiers.gather_rows(src, index, out)

    monkeypatch.setattr("kvserve.attention.offload_fetch.gather_rows", slow_gather)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))  # a core free for the worker
    slow = generate(loaded, kv_offload="host")
    assert calls and set(calls) == {"kvserve-transfer"}  # the copies ran on the worker, and were slowed
    assert slow == offloaded == paged
