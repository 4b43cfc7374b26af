"""The offloaded cache keeping every layer's whole context on sliding-window models (window groups off, as with
InfiniGen; tiny random Gemma 3 and Mistral, window 8, blocks of 4 tokens; ``test_split_offload_tiny.py`` has the
default split, window layers on the device): fetch-everything and InfiniGen selecting everything give the paged
engine's tokens and logprobs (window groups),
through chunked prefill, scored chunks and decoding past several windows; a window layer fetches only the
blocks that cover its window; InfiniGen speculates in every layer past the first and in every window layer
(among its window's rows, from its own query), as a written-out reference does; INT4 reads the same rows as the
full offload; the rehearsal rotates and normalises queries as the layer it predicts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.offloaded import OffloadedKVCache
from kvserve.models import load_model
from kvserve.policies.infinigen import Rehearsal
from kvserve.policies.skewing import record_sample, skew_recorded
from tests.policies.test_offload_engine_tiny import InfiniGenReference, greedy_reference
from tests.test_sliding_window_tiny import SPECS
from tests.tiny_models import skewing_in_tmp, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixtures

BLOCK = 4
LENGTHS = (40, 23, 9)  # the longest is five windows before decoding
MAX_TOKENS = 30  # decoding past several more windows
EVERYTHING = {"kv_policy": "infinigen", "infinigen_partial_ratio": 1.0, "infinigen_alpha": 1e9}


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    return folder, load_model(folder, dtype=torch.float32)


def prompts(loaded) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]


def generate(folder, loaded, **options) -> tuple[list, LLM]:
    """Greedy outputs (with the top logprobs of every generated and prompt token) of an engine over ``folder``."""
    llm = LLM(str(folder), dtype="float32", block_size=BLOCK, max_num_batched_tokens=16, kv_cache_memory="4MiB",
              enable_prefix_caching=False, **options)  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    return llm.generate(prompts(loaded), params, use_tqdm=False), llm


def assert_same(outputs, expected) -> None:
    """Same tokens; logprobs of the same tokens within 1e-4 (float32)."""
    for out, ref in zip(outputs, expected, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        pairs = list(zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True))
        pairs += [(a, b) for a, b in zip(out.prompt_logprobs, ref.prompt_logprobs, strict=True) if b is not None]
        for ours, theirs in pairs:
            assert ours.keys() == theirs.keys()
            assert max(abs(ours[t] - theirs[t]) for t in theirs) < 1e-4


@pytest.fixture(scope="module")
def paged(tiny) -> list:
    folder, loaded = tiny
    return generate(folder, loaded)[0]


@pytest.fixture(scope="module")
def full(tiny) -> tuple[list, OffloadedKVCache]:
    folder, loaded = tiny
    outputs, llm = generate(folder, loaded, kv_offload="host", kv_window_groups=False)
    cache = llm.engine.runner.cache
    assert isinstance(cache, OffloadedKVCache) and cache.layer_windows == loaded.config.layer_windows
    llm.engine.close()
    return outputs, cache


@pytest.mark.slow
def test_full_offload_is_the_paged_engine_with_window_groups(paged, full) -> None:
    assert_same(full[0], paged)


def test_infinigen_selecting_everything_is_the_full_offload(tiny, full) -> None:
    folder, loaded = tiny
    outputs, llm = generate(folder, loaded, kv_offload="host", kv_window_groups=False, **EVERYTHING)
    llm.engine.close()
    assert_same(outputs, full[0])
    assert llm.engine.runner.cache.stats.fetch_fraction() == full[1].stats.fetch_fraction()


def test_window_layers_fetch_their_window_and_count_it(tiny, full) -> None:
    """Every decode fetch of a window layer holds at most the window and a block of rows; its stats count the
    window against the whole context, global layers every row."""
    folder, loaded = tiny
    windows = loaded.config.layer_windows
    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory="4MiB",
        kv_offload="host",
        kv_window_groups=False,
    )
    cache = llm.engine.runner.cache
    widths: dict[int, list[int]] = {layer: [] for layer in range(len(windows))}
    fetch_blocks = cache._fetch_blocks

    def spy(layer, step):  # noqa: ANN001, ANN202 - the cache's own
        fetch = fetch_blocks(layer, step)
        widths[layer].append(fetch.shape[1])  # rows per sequence: (B, T, Hkv, D)
        return fetch

    cache._fetch_blocks = spy
    prompt = prompts(loaded)[0]
    llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    llm.engine.close()
    for layer, window in enumerate(windows):
        assert len(widths[layer]) == MAX_TOKENS - 1
        if window is None:
            assert widths[layer][-1] >= len(prompt) + MAX_TOKENS - 1
        else:
            assert max(widths[layer]) <= window + BLOCK
    fractions = cache.stats.fetch_fraction()
    cached = sum(range(len(prompt), len(prompt) + MAX_TOKENS - 1))
    for layer, window in enumerate(windows):
        expected = 1.0 if window is None else (window - 1) * (MAX_TOKENS - 1) / cached
        assert fractions[layer] == pytest.approx(expected)
    # Scored chunks count too: the full offload's window layers read less than every row.
    assert [f < 1 for f in full[1].stats.fetch_fraction()] == [w is not None for w in windows]


def test_infinigen_speculates_in_window_layers_too(tiny, full) -> None:
    """Every layer reads fewer rows than the full offload at a small alpha: a global layer among all its rows, a
    window layer among its window's (layer 0 has one in both models, so it selects too)."""
    folder, loaded = tiny
    outputs, llm = generate(
        folder, loaded, kv_offload="host", kv_window_groups=False, kv_policy="infinigen", infinigen_alpha=0.5
    )
    llm.engine.close()
    cache = llm.engine.runner.cache
    assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * len(LENGTHS)
    fractions, baseline = cache.stats.fetch_fraction(), full[1].stats.fetch_fraction()
    assert loaded.config.layer_windows[0] is not None
    assert all(f < b for f, b in zip(fractions, baseline, strict=True))
    assert cache.queue.stats.bytes_fetched < full[1].queue.stats.bytes_fetched


def test_infinigen_decodes_and_scores_what_the_written_out_selection_does(tiny) -> None:
    """Window layers select among their window's rows, as ``InfiniGenReference`` written out over a contiguous
    cache: decoding after a whole prompt, and a prompt scored in chunks (each scored row reads what decoding it
    alone would) after its first chunk."""
    folder, loaded = tiny
    prompt = prompts(loaded)[0]
    for options, first in (({}, None), ({"prompt_logprobs": 1}, 16)):
        llm = LLM(str(folder), dtype="float32", block_size=BLOCK, max_num_batched_tokens=16, kv_cache_memory="4MiB",
                  enable_prefix_caching=False, kv_offload="host", kv_window_groups=False, kv_policy="infinigen",
                  infinigen_alpha=0.5)  # fmt: skip
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2, **options)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        llm.engine.close()
        cfg = loaded.config
        reference = InfiniGenReference(
            cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, len(prompt) + MAX_TOKENS, torch.float32
        )
        reference.rehearsal, reference.alpha = llm.engine.runner.cache.rehearsal, 0.5
        expected, logprobs = greedy_reference(loaded, reference, prompt, MAX_TOKENS, first=first)
        assert out.outputs[0].token_ids == expected, options
        for exact, top in zip(logprobs, out.outputs[0].logprobs, strict=True):
            for token, logprob in top.items():
                assert logprob == pytest.approx(float(exact[token]), abs=1e-4), options


def test_int4_reads_the_full_offloads_rows(tmp_path) -> None:
    """INT4's groups of 64 values need a head dim of 64: the tiny Gemma 3 with wider heads."""
    spec = SPECS["gemma3"]
    spec = dataclasses.replace(spec, head_dim=64, extra={**spec.extra, "query_pre_attn_scalar": 64})
    folder = write_tiny_model(tmp_path, spec)
    loaded = load_model(folder, dtype=torch.float32)
    caches = {}
    for policy in ("full", "int4"):
        outputs, llm = generate(folder, loaded, kv_offload="host", kv_window_groups=False, kv_policy=policy)
        llm.engine.close()
        assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * len(LENGTHS)
        caches[policy] = llm.engine.runner.cache
    assert caches["int4"].stats.fetch_fraction() == caches["full"].stats.fetch_fraction()
    assert caches["int4"].queue.stats.bytes_fetched < caches["full"].queue.stats.bytes_fetched / 3


def test_a_pool_limit_is_refused_on_a_windowed_model(tiny) -> None:
    folder, _ = tiny
    with pytest.raises(ValueError, match="kv_pool_limit=0.5 overwrites slots in place"):
        LLM(
            str(folder),
            dtype="float32",
            kv_offload="host",
            kv_window_groups=False,
            kv_policy="infinigen",
            kv_pool_limit=0.5,
        )


def test_the_rehearsal_rotates_and_normalises_as_the_layer_it_predicts(tiny) -> None:
    """With every skewed dimension, the rehearsal of a layer from that layer's own input gives its exact skewed
    queries: Gemma 3's per-head query norm and scale, and the rotary tables of the layer predicted (a global
    layer after a window layer rotates with another base), which reach ``observe_input`` of the layer before."""
    _, loaded = tiny
    cfg = loaded.config
    ids = prompts(loaded)[0]
    rows = torch.arange(len(ids))
    recorder = record_sample(loaded.model, ids, rows)
    skewing = skew_recorded(loaded.model, recorder)
    rehearsal = Rehearsal(loaded.model, skewing.partial(cfg.head_dim))
    for layer in range(1, cfg.num_layers):
        ours = rehearsal.partial_query(layer, recorder.inputs[layer], recorder.ropes[layer - 1])  # (R, Hkv, G, D)
        q = recorder.queries[layer].view(len(ids), cfg.num_kv_heads, -1, cfg.head_dim)
        exact = torch.einsum("rhgd,hde->rhge", q, rehearsal.skew[layer])
        assert (ours - exact).abs().max() < 1e-4
        # A layer that speculates from its own query (layer 1) takes the same skewed dimensions of it.
        assert (rehearsal.partial_from_query(layer, recorder.queries[layer]) - exact).abs().max() < 1e-5
