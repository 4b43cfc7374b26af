"""InfiniGen without kv_offload: sparse decode over the device's paged cache (``attention/sparse_decode.py``), on a
tiny random checkpoint in float32. Selecting everything is the paged engine, token for token (chunked prefill,
decodes beside chunks); a small alpha selects, layer by layer, the rows the offloaded InfiniGen fetches and
generates its tokens; scored chunks select as the offloaded cache's do; the kernel over the (slot, KV head) view
equals the torch reference; on sliding-window models (tiny Gemma 3 and Mistral) only the global layers are sparse,
and selecting everything is the paged engine with window groups; the partial keys follow the blocks through
preemption by swap, forks (copy-on-write) and prefix hits."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.decode import paged_decode, paged_decode_reference
from kvserve.attention.paged import PagedKVCache
from kvserve.attention.sparse_decode import SparseDecodeKVCache, selected_table
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.models import load_model
from kvserve.platform.cpu_kernels import cpu_kernels_available
from kvserve.policies.infinigen import PagedCandidates, Selection
from tests.policies.test_offload_engine_tiny import PROMPTS, greedy, make_engine, run, tokens
from tests.policies.test_offload_engine_tiny import loaded as loaded  # noqa: F401 - the module's fixture
from tests.test_sliding_window_tiny import SPECS
from tests.tiny_models import skewing_in_tmp, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixtures

EVERYTHING = {"kv_policy": "infinigen", "infinigen_alpha": 1e9}


def sparse_engine(loaded, **options) -> tuple[LLMEngine, SparseDecodeKVCache]:  # noqa: F811 - the fixture
    engine = make_engine(loaded, **{"kv_policy": "infinigen", **options})
    cache = engine.runner.cache
    assert isinstance(cache, SparseDecodeKVCache)
    return engine, cache


def test_selecting_everything_is_the_paged_engine(loaded) -> None:  # noqa: F811
    engine = make_engine(loaded, max_num_batched_tokens=16)
    expected = tokens(run(engine, PROMPTS, greedy()))
    engine.close()
    engine, cache = sparse_engine(loaded, max_num_batched_tokens=16, infinigen_alpha=1e9)
    assert tokens(run(engine, PROMPTS, greedy())) == expected
    engine.close()
    assert cache.sparse_layers == frozenset(range(1, loaded.config.num_layers))
    fractions = cache.stats.read_fraction()
    assert fractions[1:] == [1.0] * (loaded.config.num_layers - 1)
    assert cache.stats.selected_rows[1] > 0


def test_small_alpha_selects_what_the_offloaded_infinigen_fetches(loaded) -> None:  # noqa: F811
    """The same rows per layer (counted as the offloaded cache counts its fetches) and the same tokens."""
    options = {"kv_policy": "infinigen", "infinigen_alpha": 0.5}
    engine = make_engine(loaded, kv_offload="host", **options)
    offloaded = engine.runner.cache
    expected = tokens(run(engine, PROMPTS, greedy()))
    engine.close()
    engine, cache = sparse_engine(loaded, **options)
    assert tokens(run(engine, PROMPTS, greedy())) == expected
    engine.close()
    assert cache.stats.selected_rows[1:] == offloaded.stats.fetched_rows[1:]
    assert cache.stats.cached_rows[1:] == offloaded.stats.cached_rows[1:]
    assert all(0 < f < 1 for f in cache.stats.read_fraction()[1:])


def test_scored_chunks_select_as_the_offloaded_cache(loaded) -> None:  # noqa: F811
    """Prompt logprobs: each scored row reads its own selection, with the offloaded cache's counts and logprobs."""
    params = greedy(max_tokens=4, prompt_logprobs=1)
    options = {"kv_policy": "infinigen", "infinigen_alpha": 0.5, "max_num_batched_tokens": 64}
    engine = make_engine(loaded, kv_offload="host", **options)
    offloaded = engine.runner.cache
    expected = run(engine, PROMPTS[:2], params)
    engine.close()
    engine, cache = sparse_engine(loaded, **options)
    outputs = run(engine, PROMPTS[:2], params)
    engine.close()
    assert tokens(outputs) == tokens(expected)
    assert cache.stats.selected_rows[1:] == offloaded.stats.fetched_rows[1:]
    for ours, theirs in zip(outputs, expected, strict=True):
        for a, b in zip(ours.prompt_logprobs, theirs.prompt_logprobs, strict=True):
            if b is not None:
                assert max(abs(a[t] - b[t]) for t in b) < 1e-4


def test_a_request_cannot_pick_another_policy(loaded) -> None:  # noqa: F811
    engine, _ = sparse_engine(loaded)
    with pytest.raises(ValueError, match="cannot pick kv_policy='full'"):
        engine.add_request(PROMPTS[0], greedy(kv_policy="full"))
    engine.close()
    plain = make_engine(loaded)
    with pytest.raises(ValueError, match="cannot pick kv_policy='infinigen'"):
        plain.add_request(PROMPTS[0], greedy(kv_policy="infinigen"))
    plain.close()


def test_a_quantized_cache_is_refused(loaded) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_engine(loaded, kv_policy="infinigen", kv_cache_dtype="int8")


def test_config_takes_infinigen_without_offload() -> None:
    assert EngineConfig(model="x", kv_policy="infinigen").kv_offload == "none"
    with pytest.raises(ValueError, match="kv_offload"):
        EngineConfig(model="x", kv_policy="int4")  # INT4 still only fetches from a tier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_over_selected_slots_equals_the_reference(dtype) -> None:
    """Per (sequence, KV head) its own rows, read in place through the (slot x Hkv + head) view of the cache."""
    gen = torch.Generator().manual_seed(3)
    blocks, bs, hkv, group, dim = 12, 4, 3, 3, 64
    k = torch.randn(blocks, bs, hkv, dim, generator=gen).to(dtype)
    v = torch.randn(blocks, bs, hkv, dim, generator=gen).to(dtype)
    tables = torch.tensor([[3, 7, 1, 9, 0], [5, 2, 11, 4, 8]], dtype=torch.int32)
    ends = torch.tensor([17, 9], dtype=torch.int32)  # cached rows; the own row is at position ``ends``
    candidates = PagedCandidates(tables, bs, torch.zeros(2, dtype=torch.int32), ends)
    index = torch.stack([torch.randperm(int(e), generator=gen)[:6] for e in ends for _ in range(hkv)]).view(2, hkv, 6)
    counts = torch.tensor([6, 4])
    chosen = torch.arange(6)[None, :] < counts[:, None]
    table, read = selected_table(Selection(index, chosen, counts), candidates, hkv)
    assert read.tolist() == [7] * hkv + [5] * hkv
    q = torch.randn(2 * hkv, group, dim, generator=gen).to(dtype)
    view = (-1, 1, 1, dim)
    args = (q, k.view(view), v.view(view), table, torch.zeros_like(read), read)
    if cpu_kernels_available():
        out = paged_decode(*args)[0]
        reference = paged_decode_reference(*args)[0]
        torch.testing.assert_close(out, reference, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    # The table reads what the selection says, in position order, the own row last: a written-out attention.
    for b in range(2):
        for h in range(hkv):
            positions = sorted(index[b, h, : counts[b]].tolist()) + [int(ends[b])]
            slots = [int(tables[b, p // bs]) * bs + p % bs for p in positions]
            assert table[b * hkv + h, : len(slots)].tolist() == [s * hkv + h for s in slots]
            keys, values = k.view(-1, hkv, dim)[slots, h].float(), v.view(-1, hkv, dim)[slots, h].float()
            weights = torch.softmax(q[b * hkv + h].float() @ keys.T / dim**0.5, dim=-1)
            got = paged_decode_reference(*args)[0][b * hkv + h].float()
            torch.testing.assert_close(got, weights @ values, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


# ----- sliding-window models -----

BLOCK = 4
WINDOW_LENGTHS = (40, 23, 9)


@pytest.fixture(scope="module", params=list(SPECS))
def windowed(request, tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    return folder, load_model(folder, dtype=torch.float32)


def window_generate(folder, loaded, **options) -> tuple[list, LLM]:  # noqa: F811
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in WINDOW_LENGTHS]
    llm = LLM(str(folder), dtype="float32", block_size=BLOCK, max_num_batched_tokens=16, kv_cache_memory="4MiB",
              enable_prefix_caching=False, **options)  # fmt: skip
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2)
    return llm.generate(prompts, params, use_tqdm=False), llm


def test_windowed_model_sparse_in_global_layers_only(windowed) -> None:
    folder, loaded = windowed
    expected, plain = window_generate(folder, loaded)
    assert len(plain.engine.runner.cache.layer_to_group) == loaded.config.num_layers
    outputs, llm = window_generate(folder, loaded, **EVERYTHING)
    cache = llm.engine.runner.cache
    assert isinstance(cache, SparseDecodeKVCache) and type(plain.engine.runner.cache) is PagedKVCache
    windows = loaded.config.layer_windows
    assert cache.sparse_layers == {i for i, w in enumerate(windows) if w is None and i > 0}
    assert bool(cache.sparse_layers) == (loaded.config.architecture == "gemma3")  # Mistral's layers all have windows
    assert cache.layer_to_group == plain.engine.runner.cache.layer_to_group  # window groups on
    for out, ref in zip(outputs, expected, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for ours, theirs in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert max(abs(ours[t] - theirs[t]) for t in theirs) < 1e-4
    for layer in cache.sparse_layers:
        assert cache.stats.read_fraction()[layer] == 1.0 and cache.stats.selected_rows[layer] > 0
    assert all(cache.stats.cached_rows[i] == 0 for i in range(len(windows)) if i not in cache.sparse_layers)
    # A small alpha runs too, reading fewer rows in the global layers.
    _, small = window_generate(folder, loaded, kv_policy="infinigen", infinigen_alpha=0.5)
    stats = small.engine.runner.cache.stats
    assert all(0 < stats.read_fraction()[layer] < 1 for layer in cache.sparse_layers)
    assert stats.cached_rows == cache.stats.cached_rows


@pytest.mark.parametrize(("mode", "alpha"), [("swap", 0.5), ("recompute", 1e9)])
def test_preemption_keeps_the_tokens(loaded, mode, alpha) -> None:  # noqa: F811
    """Swapped-in blocks get their partial keys back (recomputed from their keys): a small alpha's tokens are a roomy
    cache's. Recompute prefills a sequence's generated rows again, attending to everything (as the offloaded cache
    does), so only a selection of everything keeps them exactly there.
    10 blocks hold 40 tokens: the 23-token prompt plus 16 outputs fits alone, not beside the others."""
    prompts = [PROMPTS[0][:n] for n in (9, 5, 23, 2)]
    options = {"kv_policy": "infinigen", "infinigen_alpha": alpha}
    engine, _ = sparse_engine(loaded, **options)
    roomy = tokens(run(engine, prompts, greedy(16)))
    engine.close()
    block = engine.runner.cache.k[:, 0].nbytes * 2 + engine.runner.cache.partial_keys[:, :, 0].nbytes
    config = EngineConfig(
        model=str(loaded.path), dtype="float32", block_size=4, kv_cache_memory=10 * block + block - 1,
        swap_space=40 * block if mode == "swap" else 0, preemption_mode=mode, **options,
    )  # fmt: skip
    engine = LLMEngine(config, loaded)
    assert engine.kv.pool.num_blocks == 10
    cache, swapped = engine.runner.cache, []
    swap_in = cache.swap_in

    def spy(pairs, host_cache=None):  # noqa: ANN001, ANN202 - the cache's own
        swapped.append(len(pairs))
        return swap_in(pairs, host_cache)

    cache.swap_in = spy
    assert tokens(run(engine, prompts, greedy(16))) == roomy
    assert engine.scheduler.num_preemptions > 0
    assert (sum(swapped) > 0) == (mode == "swap")
    engine.close()


def test_forks_and_prefix_hits_select_as_the_offloaded_infinigen(loaded) -> None:  # noqa: F811
    """n=2 samples share their prompt's blocks and copy the partial one on write (with its partial keys); a repeated
    prompt reuses cached blocks and their partial keys, and its last row, decoded after the hit, selects: a small
    alpha's outputs are the offloaded InfiniGen's (whose prefix hits work the same way)."""
    params = [SamplingParams(n=2, seed=7 + i, max_tokens=8, ignore_eos=True) for i in range(2)]
    outputs = []
    for options in ({}, {"kv_offload": "host"}):
        engine = make_engine(loaded, kv_policy="infinigen", infinigen_alpha=0.5, **options)
        forked = run(engine, PROMPTS[:2], params)
        again = run(engine, [PROMPTS[1]], greedy())
        engine.close()
        assert again[0].num_cached_tokens > 0
        outputs.append(([[c.token_ids for c in out.outputs] for out in forked], tokens(again)))
    assert outputs[0] == outputs[1]
