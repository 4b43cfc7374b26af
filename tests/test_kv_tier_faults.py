"""Faults in the KV tiers below the device, injected, on the real default model (SmolLM2-135M, float32).

At start: a full disk, a read-only folder and a host pool that cannot be allocated are each a ``KVTierError``
naming the folder (or swap_space) and the bytes, and leave no file behind. During a run: an I/O error in a
disk-tier fetch or store, or a failed swap copy, gives up that step only; its requests compute again from their
tokens and end token-identical to a run without the fault, every block back in its pool. A request that
faults twice ends with finish_reason "error" and the message, while the engine keeps serving the others.
"""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

import kvserve.attention.offload_fetch as offloaded  # where the offloaded cache runs its tier copies
import kvserve.kv.tiers as tiers
from kvserve import SamplingParams
from kvserve.attention.paged import PagedKVCache
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.errors import KVTierError
from kvserve.kv.sizing import kv_block_bytes
from kvserve.platform.faults import FAULT_MARK, faults
from kvserve.server.async_engine import AsyncEngine, EngineStepError

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TEXTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    return [default_model.tokenizer.encode(text) for text in TEXTS]


def _disk_engine(loaded, folder, **options) -> LLMEngine:
    config = EngineConfig(kv_offload="disk", kv_offload_path=str(folder), kv_cache_memory="4MiB", **options)
    return LLMEngine(config, loaded=loaded)


def _swap_engine(loaded, prompts) -> LLMEngine:
    """Room for the largest request and a block more: the others are swapped out and back in."""
    cfg = loaded.config
    block = kv_block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 16)
    largest = max(-(-(len(ids) + GREEDY.max_tokens) // 16) for ids in prompts)
    config = EngineConfig(kv_cache_memory=(largest + 1) * block, swap_space=16 * block, preemption_mode="swap")
    return LLMEngine(config, loaded=loaded)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, object]:
    for i, ids in enumerate(prompts):
        engine.add_request(ids, GREEDY, request_id=str(i))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def _tokens(outputs: dict) -> dict[str, list[int]]:
    return {request_id: output.outputs[0].token_ids for request_id, output in outputs.items()}


def _assert_all_blocks_free(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks
    if engine.kv.host_pool is not None:
        assert engine.kv.host_pool.num_free == engine.kv.host_pool.num_blocks


def _failing(real, calls_to_fail: set[int]):
    """``real``, except that the calls numbered in ``calls_to_fail`` (from 0) raise EIO."""
    count = [0]

    def copy(*args, **kwargs):
        count[0] += 1
        if count[0] - 1 in calls_to_fail:
            raise OSError(errno.EIO, "Input/output error")
        return real(*args, **kwargs)

    copy.calls = count
    return copy


# ----- at start -----


def test_full_disk_is_a_clear_error_at_start(default_model, tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiers.os, "posix_fallocate", no_space)
    with pytest.raises(KVTierError, match=r"needs [\d,]+ bytes in .*kv_offload_path.*ENOSPC.*bytes are free") as info:
        _disk_engine(default_model, tmp_path)
    assert str(tmp_path) in str(info.value)
    assert list(tmp_path.iterdir()) == []  # the file is gone again


def test_disk_tier_reserves_its_space(default_model, tmp_path, monkeypatch):
    reserved = []
    real = os.posix_fallocate
    monkeypatch.setattr(tiers.os, "posix_fallocate", lambda fd, off, n: reserved.append(n) or real(fd, off, n))
    engine = _disk_engine(default_model, tmp_path)
    assert sum(reserved) == engine.runner.cache.tier.nbytes  # every array's bytes, reserved up front
    engine.close()


def test_read_only_folder_is_a_clear_error_at_start(default_model, tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: inject what a read-only mount answers

        def read_only(**kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(tiers.tempfile, "mkstemp", read_only)
    else:
        folder.chmod(0o500)
    try:
        with pytest.raises(KVTierError, match=r"cannot create its file in .*(EROFS|EACCES)") as info:
            _disk_engine(default_model, folder)
        assert str(folder) in str(info.value)
    finally:
        folder.chmod(0o700)


def test_missing_folder_is_a_clear_error_at_start(default_model, tmp_path):
    with pytest.raises(ValueError, match="kv_offload_path .*missing.* is not a directory"):
        _disk_engine(default_model, tmp_path / "missing")


def test_swap_space_that_cannot_be_allocated_is_a_clear_error(default_model, prompts, monkeypatch):
    def out_of_memory(self, num_blocks=None):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(PagedKVCache, "make_host_cache", out_of_memory)
    with pytest.raises(KVTierError, match=r"host tier for swapping \(16 blocks, [\d,]+ bytes: swap_space\)"):
        _swap_engine(default_model, prompts)


# ----- during a run: the disk tier -----


@pytest.fixture(scope="module")
def disk_reference(default_model, prompts, tmp_path_factory) -> dict[str, list[int]]:
    engine = _disk_engine(default_model, tmp_path_factory.mktemp("reference"))
    outputs = _run(engine, prompts)
    engine.close()
    return _tokens(outputs)


@pytest.mark.parametrize("copy", ["gather_rows", "scatter_rows"])
def test_disk_io_error_recomputes_the_step_exactly(default_model, prompts, disk_reference, tmp_path, monkeypatch, copy):
    """An EIO in a fetch (read) or a store (write) of the disk tier: the step's requests compute again."""
    failing = _failing(getattr(offloaded, copy), {40})
    monkeypatch.setattr(offloaded, copy, failing)
    engine = _disk_engine(default_model, tmp_path)
    preemptions = engine.scheduler.num_preemptions
    outputs = _run(engine, prompts)
    assert failing.calls[0] > 40  # the fault did happen
    assert engine.scheduler.num_preemptions > preemptions  # and was recovered by recompute
    assert _tokens(outputs) == disk_reference
    assert all(output.error is None for output in outputs.values())
    _assert_all_blocks_free(engine)
    engine.close()


def test_request_that_faults_twice_errors_and_others_are_served(
    default_model, prompts, disk_reference, tmp_path, monkeypatch
):
    """One request at a time: every step of request 1 fails its fetches; requests 0 and 2 never notice."""
    engine = _disk_engine(default_model, tmp_path, max_num_seqs=1)
    victim = {}
    execute = engine.runner.execute

    def faulting_execute(out, rows_from=None):
        faulty = any(engine._seqs[s.seq_id][0].request_id == "1" for s in out.scheduled if s.seq_id in engine._seqs)
        victim["on"] = faulty
        return execute(out, rows_from)

    real = offloaded.gather_rows

    def gather(*args, **kwargs):
        if victim.get("on"):
            raise OSError(errno.EIO, "Input/output error")
        return real(*args, **kwargs)

    engine.runner.execute = faulting_execute
    monkeypatch.setattr(offloaded, "gather_rows", gather)
    outputs = _run(engine, prompts)
    monkeypatch.undo()
    failed = outputs["1"]
    assert failed.outputs[0].finish_reason == "error"
    assert "KV tier transfer failed" in failed.error and "Input/output error" in failed.error
    assert {k: v for k, v in _tokens(outputs).items() if k != "1"} == {k: disk_reference[k] for k in ("0", "2")}
    _assert_all_blocks_free(engine)
    # The engine keeps serving: the same prompt runs again, fault gone, to the fault-free answer.
    assert _tokens(_run(engine, prompts[1:2])) == {"0": disk_reference["1"]}
    engine.close()


def test_async_engine_fails_only_the_faulting_request(default_model, prompts, disk_reference, tmp_path, monkeypatch):
    engine = _disk_engine(default_model, tmp_path, max_num_seqs=1)
    execute = engine.runner.execute

    def faulting_execute(out, rows_from=None):
        if any(engine._seqs[s.seq_id][0].request_id == "victim" for s in out.scheduled if s.seq_id in engine._seqs):
            raise KVTierError("a KV tier transfer failed: OSError(5, 'Input/output error')")
        return execute(out, rows_from)

    engine.runner.execute = faulting_execute
    server = AsyncEngine(engine)
    server.start()

    async def main():
        victim = server.add_request("victim", prompts[1], GREEDY)
        other = server.add_request("other", prompts[0], GREEDY)
        await victim.wait_accepted()
        await other.wait_accepted()
        results = await asyncio.gather(victim.result(), other.result(), return_exceptions=True)
        return results

    try:
        victim_result, other_result = asyncio.run(main())
    finally:
        server.shutdown()
    assert isinstance(victim_result, EngineStepError) and "Input/output error" in str(victim_result)
    assert other_result.outputs[0].token_ids == disk_reference["0"]
    assert server.num_step_errors == 0  # no step failed everyone
    _assert_all_blocks_free(engine)


# ----- during a run: swap space -----


@pytest.fixture(scope="module")
def swap_reference(default_model, prompts) -> dict[str, list[int]]:
    engine = _swap_engine(default_model, prompts)
    outputs = _run(engine, prompts)
    assert engine.scheduler.num_preemptions > 0  # the swap path is taken
    return _tokens(outputs)


@pytest.mark.parametrize("direction", ["swap_out", "swap_in"])
def test_failed_swap_copy_falls_back_to_recompute(default_model, prompts, swap_reference, monkeypatch, direction):
    real = getattr(PagedKVCache, direction)
    calls = []

    def failing(self, pairs, host_cache=None):
        calls.append(len(pairs))
        if len(calls) == 1:
            raise RuntimeError("host copy failed")
        return real(self, pairs, host_cache)

    monkeypatch.setattr(PagedKVCache, direction, failing)
    engine = _swap_engine(default_model, prompts)
    outputs = _run(engine, prompts)
    assert calls  # a swap was attempted, and the first one failed
    assert _tokens(outputs) == swap_reference
    assert all(output.error is None for output in outputs.values())
    _assert_all_blocks_free(engine)


# ----- the named fault points (KVSERVE_FAULTS in a server; the chaos soak arms them) -----


@pytest.mark.parametrize("point", ["kv-disk", "swap"])
def test_armed_fault_points_end_each_request_once_right_or_with_the_fault(
    default_model, prompts, disk_reference, swap_reference, tmp_path, point
):
    engine = _disk_engine(default_model, tmp_path) if point == "kv-disk" else _swap_engine(default_model, prompts)
    reference = disk_reference if point == "kv-disk" else swap_reference
    with faults({point: 0.3}, seed=1) as injected:
        outputs = _run(engine, prompts)
    assert injected[point] > 0
    assert sorted(outputs) == ["0", "1", "2"]
    for request_id, output in outputs.items():
        if output.error is None:
            assert output.outputs[0].token_ids == reference[request_id]
        else:
            assert FAULT_MARK in output.error and output.outputs[0].finish_reason == "error"
    _assert_all_blocks_free(engine)
    assert engine.kv.leaked_blocks() == 0
    engine.close()
