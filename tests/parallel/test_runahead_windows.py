"""Parallel prefill (KV-Runahead and TSP) over sliding-window layers: a tiny random Gemma 3 (five window layers of
8 positions, one global) with chunks longer than the window and prompts several windows long.

Each rank applies the window and receives only the rows it reaches (``parallel/window_kv.py``); the last rank still
stores every row, as one process does. Checked against one process: the ranks' hidden states and the KV handed to
the sink (p = 3, chunks longer and shorter than the window), and the engine's greedy tokens and logprobs with window
KV groups on and off, over an int8 cache, offloaded (the global layer in the tier, the window layers on the device),
and for a later prompt whose prefix hit reads the stored rows.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import AttentionMetadata, ContiguousKVCache
from kvserve.config import EngineConfig
from kvserve.core.kv_plan import plan_kv
from kvserve.eval.data import AUSTEN, require
from kvserve.models import load_model
from kvserve.parallel import ChunkJob, PrefillGroup, WorkerModel
from kvserve.parallel.window_kv import Transfer, passed_rows, window_transfers
from tests.parallel.conftest import even, prompt
from tests.parallel.test_runahead_tiny import KVCollector
from tests.tiny_models import TinySpec, write_tiny_model

WINDOW = 8
SPEC = TinySpec(
    arch="gemma3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=6, tie_word_embeddings=True,
    extra={"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh"},
)  # fmt: skip
ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("runahead-windows") / "model", SPEC)
    return folder, load_model(folder, torch.float32)


def test_window_transfers_pass_only_the_window_and_the_last_rank_gets_every_row() -> None:
    b = (0, 20, 41, 61)
    assert window_transfers(b, WINDOW) == (
        Transfer(0, 1, 13, 20, True),  # rank 1 attends over the 7 rows before it
        Transfer(1, 2, 34, 41, True),  # the last rank too...
        Transfer(0, 2, 0, 20, False),  # ...and stores the rest, which reaches it off the attention path
        Transfer(1, 2, 20, 34, False),
    )
    # Chunks shorter than the window: the window's rows come from several ranks.
    small = window_transfers((0, 3, 6, 61), WINDOW)
    assert [(t.src, t.lo, t.hi) for t in small if t.dst == 2 and t.attends] == [(0, 0, 3), (1, 3, 6)]
    assert [(t.src, t.lo, t.hi) for t in small if t.dst == 1] == [(0, 0, 3)]


def test_passed_rows_are_trimmed_for_gemma3_geometry() -> None:
    """Gemma 3 270M: 15 window layers of 512 and 3 global, a 4,096-token prompt."""
    layers = ((512,) * 5 + (None,)) * 3
    two = even(4096, 2)
    runahead = passed_rows(two, layers, "runahead")
    assert runahead.untrimmed == 18 * 2048
    assert runahead.passed == runahead.untrimmed  # p = 2: the last rank stores all of chunk 0 anyway
    assert runahead.attending == 3 * 2048 + 15 * 511  # what it waits for before attending
    tsp = passed_rows(two, layers, "tsp")
    assert (tsp.untrimmed, tsp.passed) == (18 * 2 * 2048, 3 * 2 * 2048 + 15 * 2048)
    four = passed_rows(even(4096, 4), layers, "runahead")
    assert (four.untrimmed, four.passed) == (18 * 6144, 3 * 6144 + 15 * (2 * 511 + 3072))
    assert passed_rows(two, (None,) * 18, "runahead").passed == 18 * 2048  # no window: nothing trimmed


def test_parallel_prefill_on_windows_refused_only_where_the_store_has_rules_of_its_own(gemma) -> None:
    _, loaded = gemma
    assert plan_kv(EngineConfig(prefill_parallel=2), loaded.config, torch.float32).layout.windowed
    for options in ({"kv_policy": "pyramid"}, {"kv_offload": "host", "kv_window_groups": False}):
        with pytest.raises(ValueError, match="windows its processes' attention over the paged cache only"):
            plan_kv(EngineConfig(prefill_parallel=2, **options), loaded.config, torch.float32)
    # Offloaded with window groups: the window layers stay in a paged cache on the device (split).
    assert plan_kv(EngineConfig(prefill_parallel=2, kv_offload="host"), loaded.config, torch.float32).layout.split


def reference(loaded, ids: list[int], windows: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One process: final hidden states (C, hidden), keys and values (layers, C, Hkv, D)."""
    cfg, n = loaded.config, len(ids)
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, n, torch.float32)
    metadata = AttentionMetadata((0,), (n,), (0,), layer_windows=cfg.layer_windows if windows else ())
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(n), cache, metadata)
    return hidden, cache.k[:, 0].transpose(1, 2), cache.v[:, 0].transpose(1, 2)


@pytest.mark.slow
def test_three_ranks_apply_windows_and_hand_every_row_to_the_sink(gemma) -> None:
    folder, loaded = gemma
    ids = prompt(61)
    ref_hidden, ref_k, ref_v = reference(loaded, ids)
    assert (reference(loaded, ids, windows=False)[0] - ref_hidden).abs().max() > 0.1  # the windows matter here
    group = PrefillGroup(loaded.model, WorkerModel(str(folder), "float32", "dequant"), 3, threads_per_proc=1)
    try:
        for scheme in ("runahead", "tsp"):
            for boundaries in (even(61, 3), (0, 3, 6, 61)):  # chunks longer than the window, and shorter
                sink = KVCollector()
                hidden = group.prefill(ChunkJob(scheme, tuple(ids), boundaries), sink)
                assert torch.allclose(hidden, ref_hidden[boundaries[-2] :], atol=ATOL), (scheme, boundaries)
                assert sorted(sink.k) == list(range(loaded.config.num_layers))
                for layer, k in sink.k.items():
                    v = sink.v[layer]
                    assert k.shape == ref_k[layer].shape
                    assert torch.allclose(k, ref_k[layer], atol=ATOL) and torch.allclose(v, ref_v[layer], atol=ATOL)
    finally:
        group.close()
    assert not any(w.is_alive() for w in group.workers)


def _generate(llm: LLM, ids: list[int]) -> tuple[list[int], list[float], int]:
    out = llm.generate(ids, GREEDY, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    logprobs = [top[t] for t, top in zip(tokens, out.outputs[0].logprobs, strict=True)]
    return tokens, logprobs, out.num_cached_tokens


def _pool(llm: LLM) -> torch.Tensor:
    """Every key and value the engine's paged cache holds (freed blocks keep theirs), as float32."""
    cache = llm.engine.runner.cache
    pool = torch.stack((cache.k, cache.v))
    return pool.float() if cache.kv_quant is None else cache.kv_quant.dequantize(pool)


@pytest.mark.slow
def test_engine_parallel_prefill_on_windows_equals_one_process(gemma) -> None:
    """Prompt A (91 tokens: 11 windows) over 2 processes stores what one process stores, every row of every window
    layer included: the two engines' pools, block by block, after the same requests. Then B, A's first 40 tokens
    and others, hits the prefix cache: its window layers read rows of A from before the last rank's window, which
    reached that rank apart, off its attention path. Window groups on (KV-Runahead, then TSP on the same engine),
    off, over an int8 cache, and offloaded (split: tokens and prefix hits only, its pools being two): the same
    greedy tokens, logprobs within 1e-3."""
    folder, _ = gemma
    options = {"model": str(folder), "dtype": "float32", "block_size": 4, "kv_cache_memory": "1MiB"}
    prompts = {scheme: prompt(91 + i) for i, scheme in enumerate(("runahead", "tsp"))}
    follow_ups = {scheme: ids[:40] + prompt(12 + i) for i, (scheme, ids) in enumerate(prompts.items())}
    cases = [
        ({}, ("runahead", "tsp"), ATOL),
        ({"kv_window_groups": False}, ("runahead",), ATOL),
        ({"kv_cache_dtype": "int8"}, ("tsp",), 0.05),  # a code may round the other way: one step of its scale
        ({"kv_offload": "host"}, ("runahead",), None),  # split: global layer to the tier, window layers on the device
    ]
    for extra, schemes, pool_atol in cases:
        expected = {}
        with LLM(**options, **extra) as single:
            for scheme in schemes:
                expected[scheme] = _generate(single, prompts[scheme]), _generate(single, follow_ups[scheme])
            expected_pool = _pool(single) if pool_atol is not None else None
        with LLM(**options, **extra, prefill_parallel=2, prefill_partition="even") as parallel:
            for scheme in schemes:
                parallel.engine.parallel_prefill.set_partition("tsp" if scheme == "tsp" else "even")
                for ids, (tokens, logprobs, cached) in zip(
                    (prompts[scheme], follow_ups[scheme]), expected[scheme], strict=True
                ):
                    got_tokens, got_logprobs, got_cached = _generate(parallel, ids)
                    assert got_tokens == tokens, (extra, scheme, len(ids))
                    assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs, strict=True)) < 1e-3
                    assert got_cached == cached
                    if ids is prompts[scheme]:
                        route = parallel.engine.parallel_prefill.last_route
                        assert route.processes == 2, route.describe()
                assert cached == 40  # B's prefix hit (ten blocks of 4): prefilled here, over A's stored rows
            pool = _pool(parallel) if pool_atol is not None else None
        if pool is None:  # the split cache: its tokens and prefix hits above
            continue
        assert expected_pool.abs().amax().item() > 0.5  # the prompts' KV is in there
        assert (pool - expected_pool).abs().amax().item() <= pool_atol, extra


@pytest.mark.slow
@pytest.mark.real_model
def test_gemma3_270m_parallel_prefill_same_greedy_tokens(gemma3_model, shared_real_loads) -> None:
    """Gemma 3 270M (15 window layers of 512, 3 global) on a 1,536-token prompt: three windows per chunk."""
    text = require(AUSTEN, "Jane Austen's novels").read_text(encoding="utf-8")
    start = text.index("Emma Woodhouse, handsome, clever, and rich")
    ids = gemma3_model.tokenizer.encode(text[start : start + 8000])[:1536]
    assert len(ids) == 1536
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    options = {"model": "gemma3-270m", "dtype": "float32", "weights": "dequant", "kv_cache_memory": "64MiB"}
    with LLM(**options) as single:
        expected = single.generate(ids, greedy, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(**options, prefill_parallel=2, prefill_partition="even") as parallel:
        assert parallel.generate(ids, greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert parallel.engine.parallel_prefill.last_route.processes == 2
