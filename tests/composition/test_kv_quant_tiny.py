"""The int8 and int4 KV cache (``kv_cache_dtype``) on a tiny random checkpoint: its attention against a
dequantise-then-attend reference, and each technique it composes with against the same quantized engine without
that technique (lossless over a quantized cache: token-identical), or refused with the reason.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.attention.kv_quant import KVQuant, hadamard
from kvserve.attention.paged import PagedKVCache
from kvserve.attention.paged_metadata import PagedAttentionMetadata
from kvserve.config import EngineConfig
from kvserve.sampling.sampling_params import SamplingParams
from tests.composition.conftest import BLOCK, GREEDY, PML, SCHEMA, make_engine, prompt_ids, run, tokens
from tests.tiny_models import torch_single_thread  # noqa: F401 - autouse fixture

QUANT = ["int8", "int4"]


# ----- the row format -----


@pytest.mark.parametrize("dim", [16, 64, 80, 256])
def test_hadamard_is_orthonormal_and_its_own_inverse(dim) -> None:
    h = hadamard(dim)
    assert torch.allclose(h @ h, torch.eye(dim), atol=1e-6)
    assert torch.equal(h, h.T)


@pytest.mark.parametrize(("name", "row_bytes", "bound"), [("int8", 66, 0.01), ("int4", 36, 0.15)])
def test_rows_hold_codes_and_scales_in_their_bytes(name, row_bytes, bound) -> None:
    quant = KVQuant(name, 64)
    torch.manual_seed(0)
    x = torch.randn(50, 2, 64) * torch.linspace(0.1, 30, 50)[:, None, None]  # rows of very different scales
    rows = quant.quantize(quant.rotated(x))
    assert rows.dtype == torch.uint8 and rows.shape == (50, 2, row_bytes)
    back = quant.rotated(quant.dequantize(rows))  # rotating again undoes the rotation
    err = (back - x).norm(dim=-1) / x.norm(dim=-1)
    assert err.max() < bound
    with pytest.raises(ValueError, match="66 bytes"):
        KVQuant("int8", 64).dequantize(torch.zeros(3, 64, dtype=torch.uint8))


def test_a_row_of_zeros_reads_as_zeros() -> None:
    """The pool starts zeroed: a padding slot must read as finite zeros in both formats."""
    for name in QUANT:
        quant = KVQuant(name, 64)
        assert torch.equal(quant.dequantize(torch.zeros(4, quant.row_bytes, dtype=torch.uint8)), torch.zeros(4, 64))


# ----- the cache's attention against dequantise-then-attend -----


def _reference(quant: KVQuant, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int) -> torch.Tensor:
    """Causal attention of q (T, H, D) at positions ctx.. over keys/values (ctx + T, Hkv, D), each read back from its
    rotated, quantized row, the output rotated back."""
    k = quant.dequantize(quant.quantize(quant.rotated(keys)))
    v = quant.dequantize(quant.quantize(quant.rotated(values)))
    qr = quant.rotated(q)
    group = q.shape[1] // keys.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.einsum("thd,shd->hts", qr, k) / math.sqrt(q.shape[-1])
    t, s = torch.arange(q.shape[0])[:, None] + ctx, torch.arange(keys.shape[0])[None, :]
    weights = torch.softmax(logits.masked_fill(s > t, float("-inf")), dim=-1)
    return quant.rotated(torch.einsum("hts,shd->thd", weights, v))


@pytest.mark.parametrize("name", QUANT)
def test_prefill_chunk_and_decode_read_the_quantized_rows(name) -> None:
    """A 13-token prefill, a 7-token chunk after it and a decode step, batched with another sequence's decode:
    every output equals attention over the dequantised rows (float32)."""
    torch.manual_seed(0)
    hkv, heads, dim, block = 2, 4, 64, 4
    quant = KVQuant(name, dim)
    cache = PagedKVCache(1, 16, block, hkv, dim, torch.float32, kv_quant=quant)
    assert cache.k.dtype == torch.uint8 and cache.k.shape[-1] == quant.row_bytes
    total = 21
    keys, values = torch.randn(total, hkv, dim) * 3, torch.randn(total, hkv, dim)
    queries = torch.randn(total, heads, dim)
    other_k, other_v, other_q = torch.randn(6, hkv, dim), torch.randn(6, hkv, dim), torch.randn(6, heads, dim)
    table_a, table_b = [3, 7, 1, 9, 12, 5], [2, 4]

    def step(parts):  # parts: (table, context_len, rows) per sequence
        meta = PagedAttentionMetadata.build(
            seq_ids=list(range(len(parts))), query_lens=[len(r) for _, _, r in parts],
            context_lens=[c for _, c, _ in parts], block_tables=[t for t, _, _ in parts], block_size=block,
        )  # fmt: skip
        return meta

    # sequence b: 5 tokens prefilled, then a decode beside a's chunk
    meta = step([(table_a, 0, range(13)), (table_b, 0, range(5))])
    q = torch.cat((queries[:13], other_q[:5]))
    out = cache.forward(0, q, torch.cat((keys[:13], other_k[:5])), torch.cat((values[:13], other_v[:5])), meta)
    torch.testing.assert_close(out[:13], _reference(quant, queries[:13], keys[:13], values[:13], 0), atol=2e-5, rtol=0)
    meta = step([(table_a, 13, range(13, 20)), (table_b, 5, range(5, 6))])
    out = cache.forward(0, torch.cat((queries[13:20], other_q[5:6])), torch.cat((keys[13:20], other_k[5:6])),
                        torch.cat((values[13:20], other_v[5:6])), meta)  # fmt: skip
    expected = _reference(quant, queries[13:20], keys[:20], values[:20], 13)
    torch.testing.assert_close(out[:7], expected, atol=2e-5, rtol=0)
    torch.testing.assert_close(out[7:], _reference(quant, other_q[5:6], other_k, other_v, 5), atol=2e-5, rtol=0)
    meta = step([(table_a, 20, range(20, 21))])
    out = cache.forward(0, queries[20:], keys[20:], values[20:], meta)
    torch.testing.assert_close(out, _reference(quant, queries[20:], keys, values, 20), atol=2e-5, rtol=0)


def test_quantized_cache_swaps_only_with_its_own_format() -> None:
    int8 = PagedKVCache(1, 4, 4, 2, 64, torch.float32, kv_quant=KVQuant("int8", 64), num_host_blocks=4)
    plain = PagedKVCache(1, 4, 4, 2, 64, torch.float32)
    assert int8.host_cache is not None and int8.host_cache.kv_quant is int8.kv_quant
    with pytest.raises(ValueError, match="format"):
        int8.swap_out([(0, 0)], plain)


# ----- the engine -----


@pytest.fixture(scope="module")
def plain_tokens(loaded) -> list[list[int]]:
    engine = make_engine(loaded)
    try:
        return tokens(run(engine, [prompt_ids(30, seed=s) for s in range(3)]))
    finally:
        engine.close()


@pytest.mark.parametrize(("name", "ratio"), [("int8", 1.9), ("int4", 3.5)])
def test_a_quantized_pool_holds_more_blocks(loaded, name, ratio) -> None:
    plain, quantized = make_engine(loaded), make_engine(loaded, kv_cache_dtype=name)
    try:
        assert quantized.plan.num_blocks >= ratio * plain.plan.num_blocks  # float32 model: 4 bytes a value
        assert name in quantized.kv_summary
    finally:
        plain.close()
        quantized.close()


def test_int8_prompt_logprobs_stay_close_to_the_float_cache(loaded) -> None:
    """Prompt log-probabilities (every position reads the quantized keys) within a small distance of the float32
    cache's; int4 further, still bounded."""
    ids = prompt_ids(40, seed=3)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    got = {}
    for name in ("auto", "int8", "int4"):
        engine = make_engine(loaded, kv_cache_dtype=name, max_num_batched_tokens=16)  # chunks read the cache
        out = run(engine, [ids], params)[0]
        got[name] = torch.tensor([p[t] for p, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])
        engine.close()
    assert (got["int8"] - got["auto"]).abs().mean() < 0.02
    assert 0 < (got["int4"] - got["auto"]).abs().mean() < 0.2


def _quantized_tokens(loaded, name: str, prompts: list, params: SamplingParams = GREEDY, **options):
    engine = make_engine(loaded, kv_cache_dtype=name, **options)
    try:
        return tokens(run(engine, prompts, params)), engine
    finally:
        engine.close()


@pytest.fixture(scope="module", params=QUANT)
def quantized(request, loaded) -> tuple[str, list[list[int]]]:
    """Each quantized dtype's own reference: three prompts, no prefix caching, a roomy pool."""
    name = request.param
    prompts = [prompt_ids(30, seed=s) for s in range(3)]
    return name, _quantized_tokens(loaded, name, prompts, enable_prefix_caching=False)[0]


def test_prefix_caching_over_quantized_blocks_is_lossless(loaded, quantized) -> None:
    name, expected = quantized
    prompts = [prompt_ids(30, seed=s) for s in range(3)]
    engine = make_engine(loaded, kv_cache_dtype=name)
    try:
        run(engine, prompts[:1])  # its full blocks are cached
        outputs = run(engine, prompts)
        assert tokens(outputs) == expected
        assert outputs[0].num_cached_tokens >= 7 * BLOCK
    finally:
        engine.close()


def test_parallel_samples_share_quantized_blocks_copy_on_write(loaded, quantized) -> None:
    """n=3 greedy samples share the prompt's blocks and copy the partial last one on write: each equals the
    single sample."""
    name, expected = quantized
    params = SamplingParams(n=3, max_tokens=10, temperature=0, ignore_eos=True)
    engine = make_engine(loaded, kv_cache_dtype=name, enable_prefix_caching=False)
    try:
        out = run(engine, [prompt_ids(30, seed=0)], params)[0]
        assert [c.token_ids for c in out.outputs] == [expected[0]] * 3
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_over_quantized_blocks_is_lossless(loaded, quantized, mode) -> None:
    name, expected = quantized
    prompts = [prompt_ids(30, seed=s) for s in range(3)]
    roomy = make_engine(loaded, kv_cache_dtype=name)
    tight_bytes = roomy.kv_block_bytes * 18  # two prompts fit (8 blocks each), not their growth to 10: preempted
    roomy.close()
    engine = make_engine(
        loaded, kv_cache_dtype=name, kv_cache_memory=tight_bytes, preemption_mode=mode, enable_prefix_caching=False,
        swap_space=roomy.kv_block_bytes * 64,
    )  # fmt: skip
    try:
        assert tokens(run(engine, prompts)) == expected
        assert engine.scheduler.num_preemptions > 0
    finally:
        engine.close()


@pytest.mark.parametrize("tier", ["device", "host"])
def test_prompt_cache_modules_stored_quantized(loaded, tier) -> None:
    """A schema's modules are encoded once into quantized blocks and imported by later prompts: the importing
    requests generate what the first did, in either tier."""
    for name in QUANT:
        engine = make_engine(loaded, kv_cache_dtype=name, prompt_cache_tier=tier)
        try:
            engine.register_schema(SCHEMA)
            first = run(engine, [PML])
            later = run(engine, [PML, PML])
            assert tokens(later) == tokens(first) * 2
            assert later[0].num_cached_tokens > 0
        finally:
            engine.close()


def test_window_groups_over_a_quantized_cache_equal_whole_context_layers(tmp_path_factory) -> None:
    """Gemma 3's sliding-window layers in KV groups of their own (which release blocks behind the window) over an
    int8 cache generate what the same int8 cache keeping every layer's whole context does."""
    from kvserve.models import load_model
    from tests.test_sliding_window_tiny import SPECS
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("gemma3-quant"), SPECS["gemma3"])
    gemma = load_model(folder, torch.float32)
    prompts = [prompt_ids(30, seed=s) for s in range(2)]
    got = {}
    for groups in (True, False):
        engine = make_engine(gemma, kv_cache_dtype="int8", kv_window_groups=groups)
        try:
            got[groups] = tokens(run(engine, prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)))
        finally:
            engine.close()
    assert got[True] == got[False]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "partition"), [("int8", "even"), ("int4", "tsp")])
def test_parallel_prefill_passes_quantized_rows_and_equals_one_process(folder, name, partition) -> None:
    """KV-Runahead (and the TSP baseline) over a quantized cache: the ranks pass the cache's rows, attend over them
    read back and hand them to the cache as they are; the same tokens as one process prefilling in chunks."""
    from kvserve import LLM

    ids = prompt_ids(75, seed=4)
    options = {
        "model": str(folder),
        "dtype": "float32",
        "block_size": BLOCK,
        "kv_cache_dtype": name,
        "kv_cache_memory": "4MiB",
    }
    with LLM(max_num_batched_tokens=32, **options) as single:
        expected = single.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(prefill_parallel=2, prefill_partition=partition, **options) as parallel:
        got = parallel.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert parallel.engine.parallel_prefill.last_route.processes == 2
    assert got == expected


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"kv_policy": "pyramid"}, "kv_policy='full'"),
        ({"kv_offload": "host"}, "kv_offload='none'"),
        ({"batch_invariant": True}, "batch_invariant"),
        ({"prompt_cache_recompute": 0.2}, "prompt_cache_recompute=0"),
    ],
)
def test_unsupported_pairs_are_refused_with_the_reason(options, reason) -> None:
    with pytest.raises(ValueError, match=reason):
        EngineConfig(kv_cache_dtype="int8", **options)


def test_generate_and_serve_take_the_option() -> None:
    from kvserve.entrypoints.cli import _engine_config as generate_config
    from kvserve.entrypoints.cli import build_parser
    from kvserve.entrypoints.engine_args import engine_config_from_args

    parser = build_parser()
    assert generate_config(parser.parse_args(["generate", "--kv-cache-dtype", "int4", "hi"])).kv_quant == "int4"
    assert engine_config_from_args(parser.parse_args(["serve", "--kv-cache-dtype", "int8"])).kv_quant == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "int3"])
