"""Native int4 execution of GGUF Q4_0 / Q4_1 weights, and the ``auto`` dtype.

The conversion keeps every 4-bit code and its group constants, so with float32 activations (kvserve's
kernel) the product must reproduce the dequantised float32 weights to float32 rounding; with bfloat16
activations (torch's int4 kernel) to bfloat16 rounding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvserve.attention import AttentionMetadata, ContiguousKVCache
from kvserve.config import EngineConfig
from kvserve.entrypoints.engine_args import describe_config
from kvserve.models import dtype as dtype_module
from kvserve.models import gguf_file, loader
from kvserve.models.catalog import default_model_path
from kvserve.models.dtype import resolve_dtype
from kvserve.models.loader import load_model
from kvserve.models.packed_linear import can_prepack
from kvserve.models.quant_linear import (
    INT4_MAX_ROWS,
    Int4Weight,
    Int8Weight,
    Q8Linear,
    QuantEmbedding,
    QuantLinear,
    max_rows,
)
from tests.real_models import shared_load
from tests.test_gguf_loader import GQA, checkpoint, random_ids, write_gguf
from tests.tiny_models import TinySpec, torch_single_thread  # noqa: F401 - autouse fixture

Q = GGMLQuantizationType
INT4 = [Q.Q4_0, Q.Q4_1]


def blocks_of(shape: tuple[int, int], qtype: GGMLQuantizationType, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random weights quantised by ggml's reference code: (raw blocks, float32 dequantised weight)."""
    array = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    blocks = quantize(array, qtype)
    return blocks, torch.from_numpy(np.asarray(dequantize(blocks, qtype), dtype=np.float32))


@torch.inference_mode()
def logits_of(loaded, ids: torch.Tensor) -> torch.Tensor:
    cfg = loaded.config
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, len(ids), loaded.dtype)
    metadata = AttentionMetadata(seq_ids=(0,), query_lens=(len(ids),), context_lens=(0,))
    return loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids)), cache, metadata))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# ----- the conversion, on random blocks -----


@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(64, 64), (100, 96), (7, 32), (192, 576)])
def test_int4_codes_dequantise_exactly_like_ggml(qtype, shape) -> None:
    blocks, expected = blocks_of(shape, qtype)
    weight = Int4Weight.from_ggml_blocks(blocks, qtype)
    assert weight.codes.dtype == torch.uint8 and int(weight.codes.max()) <= 15
    assert torch.equal(weight.dequantize(), expected)


@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(64, 64), (100, 96), (7, 32), (576, 1536)])  # 100 and 7 rows are padded to 16
def test_quant_linear_matches_the_dequantised_linear(qtype, shape) -> None:
    blocks, w = blocks_of(shape, qtype, seed=1)
    weight = Int4Weight.from_ggml_blocks(blocks, qtype)
    x = torch.randn(2, 3, shape[1], generator=torch.Generator().manual_seed(2))  # leading dims are flattened
    bias = torch.randn(shape[0])
    # float32 activations: only float32 rounding differs (measured ~1e-6 relative).
    y32 = QuantLinear(weight, torch.float32, bias)(x)
    assert y32.shape == (2, 3, shape[0])
    assert rel_err(y32, F.linear(x, w, bias)) < 1e-5
    # bfloat16: against a bfloat16 copy of the dequantised weight (measured up to ~0.7% of the largest output).
    xb = x.bfloat16()
    yb = QuantLinear(weight, torch.bfloat16)(xb)
    assert yb.dtype == torch.bfloat16
    assert rel_err(yb, F.linear(xb, w.bfloat16())) < 0.02


@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
def test_quant_embedding_looks_up_dequantised_rows(qtype) -> None:
    blocks, w = blocks_of((300, 64), qtype, seed=3)
    embedding = QuantEmbedding(Int4Weight.from_ggml_blocks(blocks, qtype), torch.float32)
    ids = torch.tensor([[0, 299, 17], [5, 5, 42]])
    assert torch.equal(embedding(ids), w[ids])
    assert QuantEmbedding(Int4Weight.from_ggml_blocks(blocks, qtype), torch.bfloat16)(ids).dtype == torch.bfloat16


def test_fused_and_permuted_rows_keep_codes_and_constants_together() -> None:
    parts = [blocks_of((32, 64), q, seed=s) for s, q in enumerate([Q.Q4_0, Q.Q4_1, Q.Q4_1])]
    weights = [Int4Weight.from_ggml_blocks(b, q) for (b, _), q in zip(parts, [Q.Q4_0, Q.Q4_1, Q.Q4_1], strict=True)]
    fused = Int4Weight.cat(weights)
    assert torch.equal(fused.dequantize(), torch.cat([w for _, w in parts]))
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fused.map_rows(lambda rows: rows[perm]).dequantize(), fused.dequantize()[perm])


# ----- tiny GGUF files: the loader's native path -----


@pytest.mark.parametrize("shape", [(64, 64), (100, 96), (48, 576)])
def test_q8_0_codes_and_planes_give_the_ggml_weight(shape) -> None:
    """The 8-bit codes dequantise to ggml's weight exactly; two int4 planes carry every code: their
    dequantised rows add up to it exactly too."""
    blocks, expected = blocks_of(shape, Q.Q8_0)
    weight = Int8Weight.from_q8_0_blocks(blocks)
    assert torch.equal(weight.dequantize(), expected)
    planes = weight.planes()
    assert planes.shape == (2 * shape[0], shape[1])
    dense = planes.dequantize()
    assert torch.equal(dense[: shape[0]] + dense[shape[0] :], expected)
    x = torch.randn(3, 2, shape[1])
    assert rel_err(Q8Linear(weight, torch.float32)(x), F.linear(x, expected)) < 1e-5
    got = Q8Linear(weight, torch.bfloat16)(x.bfloat16())
    assert rel_err(got, F.linear(x.bfloat16(), expected.bfloat16())) < 0.02
    # Above max_rows rows the dense copy computes, exactly as a plain matmul.
    for dtype in (torch.bfloat16, torch.float32):
        with_dense = Q8Linear(weight, dtype, dense=expected.to(dtype))
        assert with_dense.max_rows == max_rows(dtype, head=True)
        many = torch.randn(with_dense.max_rows + 1, shape[1]).to(dtype)
        assert torch.equal(with_dense(many), F.linear(many, expected.to(dtype)))


TIED = TinySpec(num_heads=4, num_kv_heads=4, tie_word_embeddings=True, seed=3)


def tiny_quantised(param: str, tmp_path_factory) -> tuple[TinySpec, Path]:
    """A tiny llama GGUF named by ``param`` ("TYPE-gqa-untied" or "TYPE-tied"): its spec and path."""
    qname, _, kind = param.partition("-")
    spec = TIED if kind == "tied" else GQA
    tmp = tmp_path_factory.mktemp(param)
    _, state = checkpoint(tmp, spec)
    path = tmp / f"tiny-{param}.gguf"
    write_gguf(path, spec, state, qtype=Q[qname])
    return spec, path


@pytest.fixture(scope="module", params=["Q4_0-gqa-untied", "Q4_1-gqa-untied", "Q4_1-tied"])
def tiny_q4(request, tmp_path_factory):
    return tiny_quantised(request.param, tmp_path_factory)


def test_native_int4_sources_unpermute_qk_like_the_dequantised_ones(tiny_q4) -> None:
    _, path = tiny_q4
    reader = gguf_file.open_gguf(path)
    config = gguf_file.read_config(reader)
    dense, int4 = gguf_file.tensor_sources(reader, config), gguf_file.int4_sources(reader, config)
    assert "model.layers.0.self_attn.q_proj.weight" in int4 and "model.norm.weight" not in int4
    for name, source in int4.items():
        assert torch.equal(source().dequantize(), dense[name]()), name


def test_int4_model_runs_int4_and_matches_the_dequantised_model(tiny_q4, monkeypatch) -> None:
    spec, path = tiny_q4
    native = load_model(path, torch.bfloat16, weights="int4")
    assert native.weights == "int4" and "as int4" in native.weights_summary
    layer = native.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    assert isinstance(native.model.embed_tokens, QuantEmbedding)
    assert isinstance(native.model.lm_head, QuantLinear)  # tied or not, the head reads the int4 codes
    ids = random_ids()
    dequant32 = logits_of(load_model(path, torch.float32, weights="dequant"), ids)
    # Same weights, bfloat16 arithmetic: tiny logits (|max| ~12) differ by bfloat16 rounding only.
    dequant16 = logits_of(load_model(path, torch.bfloat16, weights="dequant"), ids)
    diff_native = (logits_of(native, ids) - dequant32).abs().max().item()
    diff_bf16 = (dequant16 - dequant32).abs().max().item()
    assert diff_native < max(3 * diff_bf16, 0.1), (diff_native, diff_bf16)
    # float32 activations through kvserve's kernel: the same weights, only the order of the sums differs.
    native32 = load_model(path, torch.float32, weights="int4")
    assert native32.weights == "int4" and isinstance(native32.model.layers[0].mlp.down_proj, QuantLinear)
    assert (logits_of(native32, ids) - dequant32).abs().max().item() < 1e-4
    # Without the compiled kernels float32 is dequantised, and the summary says why.
    monkeypatch.setattr(loader, "cpu_kernels_available", lambda: False)
    fallback = load_model(path, torch.float32, weights="int4")
    assert fallback.weights == "dequant" and "needs kvserve's CPU kernels" in fallback.weights_summary


def test_native_model_runs_large_batches_through_the_dequantised_copy(tiny_q4) -> None:
    """weights=native: a prefill (more than INT4_MAX_ROWS rows) computes exactly what the dequantised
    bfloat16 model computes; a single token goes through the int4 kernel, as weights=int4 does."""
    _, path = tiny_q4
    native = load_model(path, torch.bfloat16, weights="native")
    assert native.weights == "native" and f"up to {INT4_MAX_ROWS} rows" in native.weights_summary
    down = native.model.layers[0].mlp.down_proj
    # One dense copy: the oneDNN-packed one where its bfloat16 reorder runs (AVX-512, AMX), else the plain one.
    packs = can_prepack(torch.empty(1, dtype=torch.bfloat16))
    assert (down.dense_packed is not None, down.dense is None) == (packs, packs)
    ids = random_ids()
    assert len(ids) > INT4_MAX_ROWS
    assert torch.equal(logits_of(native, ids), logits_of(load_model(path, torch.bfloat16, weights="dequant"), ids))
    one = ids[:1]
    assert torch.equal(logits_of(native, one), logits_of(load_model(path, torch.bfloat16, weights="int4"), one))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", ["one", "max", "max+1", 64])
def test_quant_linear_picks_its_kernel_by_row_count(rows, dtype) -> None:
    limit = max_rows(dtype)
    rows = {"one": 1, "max": limit, "max+1": limit + 1}.get(rows, rows)
    blocks, w = blocks_of((48, 64), Q.Q4_1)
    weight = Int4Weight.from_ggml_blocks(blocks, Q.Q4_1)
    bias = torch.randn(48)
    both = QuantLinear(weight, dtype, bias, dense=w)
    x = torch.randn(rows, 64).to(dtype)
    if rows <= limit:
        expected = QuantLinear(weight, dtype, bias)(x)
    else:
        expected = F.linear(x, w.to(dtype), bias.to(dtype))
    assert torch.equal(both(x), expected)
    with pytest.raises(ValueError, match="dense weight has shape"):
        QuantLinear(weight, dtype, dense=w[:, :32])


def test_dequant_mode_dequantises(tiny_q4) -> None:
    _, path = tiny_q4
    for dtype in (torch.bfloat16, torch.float32):
        loaded = load_model(path, dtype, weights="dequant")
        assert loaded.weights == "dequant"
        assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in loaded.model.modules())
        assert loaded.model.layers[0].self_attn.qkv_proj.weight.dtype == loaded.dtype


def test_bad_weights_mode_is_an_error(tiny_q4) -> None:
    with pytest.raises(ValueError, match="weights must be one of"):
        load_model(tiny_q4[1], torch.bfloat16, weights="int2")
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int2")


# ----- dtype auto -----


def test_auto_dtype_follows_bf16_acceleration(monkeypatch) -> None:
    monkeypatch.setattr(dtype_module, "cpu_has_bf16_acceleration", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert EngineConfig().torch_dtype == torch.float32
    assert describe_config(EngineConfig())["dtype"] == "float32"
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    monkeypatch.setattr(dtype_module, "cpu_has_bf16_acceleration", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    report = describe_config(EngineConfig())
    assert report["dtype"] == "bfloat16" and report["dtype_requested"] == "auto"
    assert resolve_dtype("float32", "cpu") == torch.float32 and resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float16")


def test_cpuinfo_flags_are_the_fallback_detection(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile\n")
    assert "amx_bf16" in dtype_module._proc_cpuinfo_flags(cpuinfo)
    assert dtype_module._proc_cpuinfo_flags(tmp_path / "missing") == set()


def test_cli_resolves_auto_before_anything_reads_it(monkeypatch) -> None:
    from kvserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["generate", "hi"])
    assert (args.dtype, args.weights) == ("auto", "native")
    args = build_parser().parse_args(["generate", "hi", "--dtype", "float32", "--weights", "dequant"])
    assert (args.dtype, args.weights) == ("float32", "dequant")


# ----- the real default model -----


@pytest.fixture(scope="module")
def real_int4():
    reader = gguf_file.open_gguf(default_model_path())
    config = gguf_file.read_config(reader)
    return gguf_file.tensor_sources(reader, config), gguf_file.int4_sources(reader, config)


@pytest.mark.real_model
@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
             "model.layers.29.mlp.down_proj.weight", "model.layers.3.mlp.gate_proj.weight"],
)  # fmt: skip
def test_real_tensors_convert_losslessly(real_int4, name) -> None:
    dense, int4 = real_int4
    weight = int4[name]()
    w = dense[name]()
    assert torch.equal(weight.dequantize(), w)  # q and k include llama.cpp's row permutation
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(0))
    assert rel_err(QuantLinear(weight, torch.float32)(x), F.linear(x, w)) < 1e-5
    assert rel_err(QuantLinear(weight, torch.bfloat16)(x.bfloat16()), F.linear(x.bfloat16(), w.bfloat16())) < 0.02


@pytest.mark.real_model
def test_real_model_int4_matches_dequantised_bfloat16(default_model) -> None:
    """Measured on 5 prompts (benchmarks/weights_accuracy.py): max |logit diff| vs float32 dequant is 0.64-2.6
    for bfloat16 dequant and 0.54-1.8 for native int4 (logits up to ~40); native vs bfloat16 dequant 0.5-2.6."""
    native = shared_load(dtype=torch.bfloat16, weights="int4")
    assert native.weights == "int4"
    assert native.weights_summary.startswith("210 Q4_1 as int4, 61 F32 + 1 Q8_0 as bfloat16")  # token_embd: Q8_0
    # The tied Q8_0 embedding: lookups read its bfloat16 copy, the head its 8-bit codes as two int4 planes.
    assert isinstance(native.model.lm_head, Q8Linear) and native.model.lm_head.planes is not None
    assert native.model.lm_head.dense.data_ptr() == native.model.embed_tokens.weight.data_ptr()  # shared, no copy
    bf16 = shared_load(dtype=torch.bfloat16, weights="dequant")
    ids = torch.tensor(default_model.tokenizer.encode("The quick brown fox jumps over the lazy dog because"))
    ref = logits_of(default_model, ids)
    got_native, got_bf16 = logits_of(native, ids), logits_of(bf16, ids)
    assert (got_native - ref).abs().max().item() < 3.0
    assert (got_native - got_bf16).abs().max().item() < 3.0
    # Near-ties move: at the last position the top two logits differ by 0.02 in float32 and round to one bfloat16.
    assert (got_native.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8
    assert (ref.topk(3).indices == got_native.argmax(-1, keepdim=True)).any(-1).all()


# ----- kvserve's float32 kernels on the codes (csrc/quant_gemv.cpp) -----


@pytest.mark.parametrize("qtype", [*INT4, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(7, 32), (100, 96), (576, 1536), (33, 576)])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9])
def test_float32_kernel_matches_the_dequantised_matmul_row_by_row(qtype, shape, rows) -> None:
    """Odd row and output counts (tiles of 4 rows, outputs split over threads); each row's result does not
    depend on the rows beside it, and equals the float64 product of the dequantised weight to float32 rounding."""
    torch.set_num_threads(2)  # the outputs split over threads
    blocks, w = blocks_of(shape, qtype, seed=rows)
    if qtype == Q.Q8_0:
        module = Q8Linear(Int8Weight.from_q8_0_blocks(blocks), torch.float32)
    else:
        module = QuantLinear(Int4Weight.from_ggml_blocks(blocks, qtype), torch.float32)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    got = module(x)
    expected = F.linear(x.double(), w.double())
    assert rel_err(got, expected) < 1e-5
    for i in range(rows):
        assert torch.equal(module(x[i : i + 1])[0], got[i])


def test_float32_kernel_without_compiled_kernels_takes_the_reference(monkeypatch) -> None:
    from kvserve.models import quant_linear

    blocks, w = blocks_of((48, 64), Q.Q4_1)
    quant = QuantLinear(Int4Weight.from_ggml_blocks(blocks, Q.Q4_1), torch.float32)
    head_blocks, w8 = blocks_of((40, 64), Q.Q8_0)
    head = Q8Linear(Int8Weight.from_q8_0_blocks(head_blocks), torch.float32)
    x = torch.randn(3, 64)
    monkeypatch.setattr(quant_linear, "cpu_kernels_available", lambda: False)
    assert torch.equal(quant(x), F.linear(x, w))  # the dequantised weight, exactly
    assert torch.equal(head(x), F.linear(x, w8))


def test_float32_kernel_refuses_what_it_cannot_compute() -> None:
    blocks, _ = blocks_of((48, 64), Q.Q4_1)
    quant = QuantLinear(Int4Weight.from_ggml_blocks(blocks, Q.Q4_1), torch.float32)
    with pytest.raises(RuntimeError, match="x must be .M, K. float32"):
        torch.ops.kvserve.q4_linear(torch.randn(2, 64).bfloat16(), quant.codes, quant.consts)
    with pytest.raises(RuntimeError, match="codes must be contiguous int32 .N, 8."):
        torch.ops.kvserve.q4_linear(torch.randn(2, 64), quant.codes[:, :4], quant.consts)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        torch.ops.kvserve.q8_linear(torch.randn(2, 48), torch.zeros(4, 48, dtype=torch.int8), torch.zeros(4, 1))
