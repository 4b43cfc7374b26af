"""An offloading engine on a sliding-window model keeps the window layers' KV on the device and only the global
layers' in the tier (``attention/split_offload.py``), on tiny random Gemma 3 (one global layer in six) and Gemma 2
(every other layer global), window 8, blocks of 4 tokens: the fetch-everything offload and its INT4 rows give the
paged engine's (window groups on) tokens and logprobs through chunked prefill, scored chunks, forked samples and
decoding past several windows; the tier holds and fetches the global layers only, far fewer bytes than the tier
keeping every layer (window groups off); the device pool's blocks come back. InfiniGen speculates over the
global layers only, with their rehearsal: selecting everything is the full offload, alpha 0.5 reads fewer rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.offloaded import OffloadedKVCache
from kvserve.attention.split_offload import SplitOffloadKVCache
from kvserve.entrypoints.cli import main
from kvserve.models import load_model
from tests.policies.test_offload_windows_tiny import (
    BLOCK,
    EVERYTHING,
    LENGTHS,
    MAX_TOKENS,
    assert_same,
    generate,
    prompts,
)
from tests.test_sliding_window_tiny import SPECS, WINDOW
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

GEMMA2 = TinySpec(
    arch="gemma2", num_heads=4, num_kv_heads=2, num_layers=4, head_dim=16,
    extra={"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
           "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"},
)  # fmt: skip
MODELS = {"gemma3": SPECS["gemma3"], "gemma2": GEMMA2}
PROMPT = "the quick brown fox jumps over the lazy dog and the cat sat on the mat by the door"  # several windows


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request, tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), MODELS[request.param])
    return folder, load_model(folder, dtype=torch.float32)


def global_layers(loaded) -> tuple[int, ...]:
    return tuple(i for i, w in enumerate(loaded.config.layer_windows) if w is None)


@pytest.fixture(scope="module")
def split(tiny):
    folder, loaded = tiny
    outputs, llm = generate(folder, loaded, kv_offload="host")
    llm.engine.close()
    return outputs, llm


def test_the_split_offload_is_the_paged_engine_with_window_groups(tiny, split) -> None:
    folder, loaded = tiny
    paged, _ = generate(folder, loaded)
    assert_same(split[0], paged)
    cache, kv = split[1].engine.runner.cache, split[1].engine.kv
    assert isinstance(cache, SplitOffloadKVCache)
    assert cache.offloaded.num_layers == len(global_layers(loaded)) < loaded.config.num_layers
    assert cache.stats.fetch_fraction() == [1.0] * len(global_layers(loaded))  # a global layer reads every row
    assert kv.side_pool is not None and kv.leaked_blocks() == 0
    assert kv.side_pool.num_free == kv.side_pool.num_blocks and kv.pool.num_free == kv.pool.num_blocks


def test_the_tier_fetches_only_the_global_layers(tiny, split) -> None:
    """The tier keeping every layer (window groups off) fetches each window layer's window besides the global
    layers: the split fetches the global layers' rows only, with the same tokens."""
    folder, loaded = tiny
    outputs, llm = generate(folder, loaded, kv_offload="host", kv_window_groups=False)
    llm.engine.close()
    whole = llm.engine.runner.cache
    assert isinstance(whole, OffloadedKVCache) and whole.num_layers == loaded.config.num_layers
    assert_same(split[0], outputs)
    ours = split[1].engine.runner.cache.bytes_moved()["fetched"]
    assert 0 < ours < whole.bytes_moved()["fetched"]
    per_layer = dict(zip(global_layers(loaded), split[1].engine.runner.cache.stats.fetched_rows, strict=True))
    assert per_layer == {layer: whole.stats.fetched_rows[layer] for layer in global_layers(loaded)}


def test_forked_samples_copy_on_write_in_both_pools(tiny) -> None:
    """n=3 random samples of one prompt share its blocks in the tier and on the device and copy the partial last
    block on write in each: same tokens as the paged engine under one seed."""
    folder, loaded = tiny
    prompt = prompts(loaded)[1]  # 23 tokens: a partial last block
    params = SamplingParams(n=3, max_tokens=12, temperature=20.0, seed=5, ignore_eos=True)  # tiny logits are peaked
    tokens = {}
    for offload in ("none", "host"):
        llm = LLM(str(folder), dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB", kv_offload=offload)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        tokens[offload] = [c.token_ids for c in out.outputs]
        assert llm.engine.kv.leaked_blocks() == 0
        llm.engine.close()
    assert tokens["host"] == tokens["none"]
    assert len({tuple(t) for t in tokens["host"]}) > 1


def test_int4_rows_in_the_split_tier(tmp_path) -> None:
    """INT4's groups of 64 values need a head dim of 64: the tiny Gemma 3 with wider heads. Its global layer's
    rows cross the tier in 4-bit codes: fewer than a third of the full offload's bytes, every sequence decoding."""
    spec = SPECS["gemma3"]
    spec = dataclasses.replace(spec, head_dim=64, extra={**spec.extra, "query_pre_attn_scalar": 64})
    folder = write_tiny_model(tmp_path, spec)
    loaded = load_model(folder, dtype=torch.float32)
    fetched = {}
    for policy in ("full", "int4"):
        outputs, llm = generate(folder, loaded, kv_offload="host", kv_policy=policy)
        llm.engine.close()
        assert isinstance(llm.engine.runner.cache, SplitOffloadKVCache)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * len(LENGTHS)
        fetched[policy] = llm.engine.runner.cache.bytes_moved()["fetched"]
    assert fetched["int4"] < fetched["full"] / 3


def test_the_disk_tier_splits_too(tiny, split, tmp_path) -> None:
    folder, loaded = tiny
    outputs, llm = generate(folder, loaded, kv_offload="disk", kv_offload_path=str(tmp_path))
    llm.engine.close()
    assert isinstance(llm.engine.runner.cache, SplitOffloadKVCache)
    assert_same(outputs, split[0])


def test_infinigen_selecting_everything_is_the_split_full_offload(tiny, split) -> None:
    """InfiniGen over the tier's global layers only (their rehearsal and alphas): selecting every row reads what
    the full offload reads; the window layers attend on the device as the paged engine does."""
    folder, loaded = tiny
    outputs, llm = generate(folder, loaded, kv_offload="host", **EVERYTHING)
    llm.engine.close()
    cache = llm.engine.runner.cache
    assert isinstance(cache, SplitOffloadKVCache)
    assert cache.offloaded.rehearsal.speculated_layers == frozenset(range(len(global_layers(loaded))))
    assert_same(outputs, split[0])
    assert cache.stats.fetch_fraction() == split[1].engine.runner.cache.stats.fetch_fraction()


def test_infinigen_fetches_fewer_rows_of_the_global_layers(tiny, split) -> None:
    folder, loaded = tiny
    outputs, llm = generate(folder, loaded, kv_offload="host", kv_policy="infinigen", infinigen_alpha=0.5)
    llm.engine.close()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * len(LENGTHS)
    assert all(f < 1.0 for f in llm.engine.runner.cache.stats.fetch_fraction())
    assert llm.engine.runner.cache.bytes_moved()["fetched"] < split[1].engine.runner.cache.bytes_moved()["fetched"]


def test_generate_command_offloads_one_request_split(tiny, capsys, monkeypatch) -> None:
    """``kvserve generate`` sizes its pools for its one request: the tier for its tokens, the device's window pool
    for one sequence's windows and a step (not cut to the tier's few bytes); it prints the plain continuation."""
    folder, _ = tiny
    monkeypatch.setenv("KVSERVE_CONFIGURE_LOGGING", "0")
    outputs = []
    for flags in ([], ["--kv-offload", "host"]):
        capsys.readouterr()
        status = main(["generate", PROMPT, "--model", str(folder), "--max-tokens", "12", "--dtype", "float32",
                       "--threads", "1", *flags])  # fmt: skip
        out, err = capsys.readouterr()
        assert status == 0, err
        outputs.append(out)
    assert outputs[1] == outputs[0] and len(outputs[0]) > len(PROMPT)
