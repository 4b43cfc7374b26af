"""The offloading engine over the direct-I/O disk tier (kv_offload="disk", kv_disk_io="direct"), a tiny random
checkpoint in float32: fetch-everything read through O_DIRECT generates exactly what fetch-everything from the
host tier does (batched prompts of different lengths, chunked prefill beside decodes, forks, prefix hits), and
reads it from the device; InfiniGen choosing blocks with a budget that covers every block is fetch-everything,
and with a small alpha reads fewer blocks past layer 0; bad options and an unwritable folder are clear errors; I/O
errors recompute the step or end the request with the fault."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.errors import KVTierError
from kvserve.kv import direct_tier
from kvserve.models import LoadedModel, load_model
from kvserve.platform.faults import FAULT_MARK, faults
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import (  # noqa: F401 - autouse fixtures
    TinySpec,
    skewing_in_tmp,
    torch_single_thread,
    write_tiny_model,
)

# head_dim 64, 2 KV heads, float32: a block of 4 rows is 2 KiB of K and 2 KiB of V, one 4 KiB extent.
SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=4, head_dim=64, max_position_embeddings=512, seed=5)
BLOCK = 4
LENGTHS = (30, 57, 9, 2)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    return load_model(write_tiny_model(tmp_path_factory.mktemp("direct"), SPEC), dtype=torch.float32)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    probe = tmp_path / "probe"
    probe.touch()
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_DIRECT))
    except OSError:
        pytest.skip(f"the file system of {tmp_path} does not support O_DIRECT: nothing to test the tier on")
    finally:
        probe.unlink()
    return tmp_path


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt_ids(n, seed=n) for n in LENGTHS]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kwargs})


def make_engine(loaded: LoadedModel, **options) -> LLMEngine:
    config = EngineConfig(
        model=str(loaded.path), dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB", swap_space=0, **options
    )
    return LLMEngine(config, loaded)


def run(loaded: LoadedModel, prompts=PROMPTS, params=None, **options) -> tuple[list[list[int]], object]:
    """Every completion's tokens (n per prompt) of an engine with ``options``, and its cache (closed)."""
    engine = make_engine(loaded, **options)
    ids = [engine.add_request(p, params or greedy()) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.close()
    return [[c.token_ids for c in done[i].outputs] for i in ids], engine.runner.cache


def direct(folder: Path, **options) -> dict:
    return {"kv_offload": "disk", "kv_disk_io": "direct", "kv_offload_path": str(folder), **options}


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 16}],
    ids=["prompts-whole", "chunked-beside-decodes"],
)
def test_fetch_everything_through_direct_io_is_the_host_tier(loaded, folder, options) -> None:
    host, host_cache = run(loaded, kv_offload="host", **options)
    tokens, cache = run(loaded, **direct(folder, **options))
    assert tokens == host
    assert cache.stats.fetch_fraction() == [1.0] * loaded.config.num_layers
    assert cache.queue.stats.bytes_stored == host_cache.queue.stats.bytes_stored  # every row went down once
    tier = cache.tier
    assert tier.stats["disk_read"] > 0 and tier.stats["disk_written"] > 0  # from and to the device
    assert list(folder.iterdir()) == []


def test_forks_and_prefix_hits_through_direct_io_are_the_host_tier(loaded, folder) -> None:
    shared = prompt_ids(23, seed=99)
    prompts = [shared + prompt_ids(6, seed=1), shared + prompt_ids(11, seed=2)]
    params = greedy(n=2, temperature=0.8, seed=3)
    host, _ = run(loaded, prompts, params, kv_offload="host")
    tokens, _ = run(loaded, prompts, params, **direct(folder))
    assert tokens == host


def test_infinigen_pages_covering_every_block_are_fetch_everything(loaded, folder) -> None:
    full, full_cache = run(loaded, **direct(folder))
    options = {"kv_policy": "infinigen", "infinigen_partial_ratio": 1.0, "infinigen_alpha": 1e9}
    tokens, cache = run(loaded, **direct(folder, **options))
    assert tokens == full
    assert cache.stats.fetch_fraction() == [1.0] * loaded.config.num_layers
    assert cache.tier.stats["disk_read"] == full_cache.tier.stats["disk_read"]


def test_infinigen_pages_read_fewer_blocks_past_layer_zero(loaded, folder) -> None:
    prompts = [prompt_ids(200, seed=7), prompt_ids(150, seed=8)]  # long enough for blocks to be left out
    _, full = run(loaded, prompts, **direct(folder))
    tokens, cache = run(loaded, prompts, **direct(folder, kv_policy="infinigen", infinigen_alpha=0.5))
    fractions = cache.stats.fetch_fraction()
    assert fractions[0] == 1.0  # layer 0 reads its whole cache
    assert all(0 < f < 1 for f in fractions[1:]), fractions
    assert cache.tier.stats["disk_read"] < full.tier.stats["disk_read"]
    assert [len(t[0]) for t in tokens] == [MAX_TOKENS] * len(prompts)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_disk_io": "uring"}, "kv_disk_io must be one of"),
        ({"kv_offload": "host", "kv_disk_io": "direct"}, "set kv_offload='disk'"),
        ({"kv_offload": "disk", "kv_disk_io": "direct", "kv_policy": "int4"}, "not 'int4'.*kv_disk_io='mmap'"),
        (
            {"kv_offload": "disk", "kv_disk_io": "direct", "kv_policy": "infinigen", "kv_pool_limit": 0.5},
            "kv_pool_limit=0.5 .*whole blocks",
        ),
    ],
)
def test_options_the_direct_tier_cannot_run_are_refused(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_an_unwritable_folder_is_a_tier_error_naming_it(loaded, folder, monkeypatch) -> None:
    def read_only(**kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(direct_tier.tempfile, "mkstemp", read_only)  # root writes anywhere: what a read-only mount says
    with pytest.raises(KVTierError, match=f"cannot create its file in '{folder}'.*EROFS"):
        make_engine(loaded, **direct(folder))


def test_armed_disk_faults_end_each_request_right_or_with_the_fault(loaded, folder) -> None:
    """EIO at the direct tier's reads and writes: a step's requests compute again (exactly), or end in error."""
    reference, _ = run(loaded, kv_offload="host")
    engine = make_engine(loaded, **direct(folder))
    ids = [engine.add_request(p, greedy()) for p in PROMPTS]
    done = {}
    with faults({"kv-disk": 0.1}, seed=2) as injected:
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert injected["kv-disk"] > 0
    for i, request_id in enumerate(ids):
        output = done[request_id]
        if output.error is None:
            assert output.outputs[0].token_ids == reference[i][0]
        else:
            assert FAULT_MARK in output.error and output.outputs[0].finish_reason == "error"
    assert engine.kv_usage().used_blocks == 0
    engine.close()
