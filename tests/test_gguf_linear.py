"""GGUF K-quant, Q5_0 and Q8_0 weights run on their file's blocks (``models/gguf_linear.py``, ``csrc/gguf_gemv.cpp``).

The reference is written out: the activations rounded to int8 per block as the kernel (and llama.cpp) rounds them,
times the weight dequantised by ggml's own code (``gguf.quants``), in float64. Random blocks of every type (every
bit pattern of codes and scales), real tensors of the Gemma 3 file, tails of 1-32 rows, fused parts with a row order.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvserve.models import gguf_file
from kvserve.models.batch_invariant import make_batch_invariant
from kvserve.models.catalog import gemma3_270m_path
from kvserve.models.gguf_linear import NATIVE_TYPES, GGUFEmbedding, GGUFLinear, GGUFWeight
from kvserve.models.loader import load_model
from kvserve.platform.cpu_kernels import CSRC, build_directory, cpu_kernels_available
from tests.test_gguf_loader import random_ids
from tests.test_quant_linear import logits_of, tiny_quantised

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="kvserve's CPU kernels did not build here")

SUPER_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
NO_INDEX = torch.empty(0, dtype=torch.long)


def random_blocks(qtype: Q, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes) uint8: every byte random but the float16 scales, kept finite and small."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    offsets = {Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for offset in offsets:
        scales = rng.uniform(-0.01, 0.01, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def rounded_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as the kernel rounds it: per row and block, q = round(x * (127 / max|x|)) in float32, times max|x| / 127."""
    xb = x.float().reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv).double() * (amax.double() / 127)).reshape(x.shape)


def reference(x: torch.Tensor, weights: list[np.ndarray], types: list[Q]) -> tuple[torch.Tensor, torch.Tensor]:
    """The written-out product (float64) and the sum of |terms| per output, the scale its rounding error has."""
    outs, scales = [], []
    for blocks, qtype in zip(weights, types, strict=True):
        w = torch.from_numpy(dequantize(blocks, qtype).reshape(blocks.shape[0], -1)).double()
        xr = rounded_activations(x, 256 if qtype in SUPER_TYPES else 32)
        outs.append(xr @ w.T)
        scales.append(xr.abs() @ w.abs().T)
    return torch.cat(outs, dim=1), torch.cat(scales, dim=1)


def assert_close(y: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> None:
    error = (y.double() - expected).abs() / (scale + 1e-30)
    assert error.max().item() < 1e-5, f"largest error {error.max().item():.2e} of the terms' magnitude"


@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES))
@pytest.mark.parametrize("n", [1, 7, 33])
def test_every_type_matches_the_written_out_product_for_1_to_32_rows(qtype: Q, n: int) -> None:
    k = 512 if qtype in SUPER_TYPES else 96  # two superblocks / three blocks: more than one per row
    blocks = random_blocks(qtype, n, k, seed=n)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(n)) * 3
    expected, scale = reference(x, [blocks], [qtype])
    for rows in (1, 2, 3, 4, 5, 17, 32):  # every tile size, and tails after whole tiles
        y = torch.ops.kvserve.gguf_linear(x[:rows], [torch.from_numpy(blocks)], [int(qtype)], NO_INDEX)
        assert y.shape == (rows, n)
        assert_close(y, expected[:rows], scale[:rows])


@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES))
def test_a_rows_result_does_not_depend_on_its_batch(qtype: Q) -> None:
    k = 256
    blocks = torch.from_numpy(random_blocks(qtype, 24, k))
    x = torch.randn(70, k)  # past one 64-row block of a thread's loop
    together = torch.ops.kvserve.gguf_linear(x, [blocks], [int(qtype)], NO_INDEX)
    for row in (0, 3, 63, 64, 69):
        alone = torch.ops.kvserve.gguf_linear(x[row : row + 1], [blocks], [int(qtype)], NO_INDEX)
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES))
def test_blocks_dequantise_exactly_like_ggml(qtype: Q) -> None:
    blocks = random_blocks(qtype, 9, 512)
    expected = torch.from_numpy(dequantize(blocks, qtype).reshape(9, -1))
    weight = GGUFWeight(torch.from_numpy(blocks), qtype)
    assert torch.equal(weight.dequantize(), expected)
    rows = torch.tensor([8, 0, 8, 3])
    assert torch.equal(weight.dequantize_rows(rows), expected[rows])


def test_fused_parts_of_mixed_types_with_a_row_order() -> None:
    """q/k/v-style: three tensors, two types, one with llama.cpp's rows permuted; outputs land in model order."""
    k = 256
    types = [Q.Q4_K, Q.Q6_K, Q.Q8_0]
    weights = [random_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(zip(types, (16, 8, 8), strict=True))]
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    parts = [GGUFWeight(torch.from_numpy(weights[0]), types[0], order)]
    parts += [GGUFWeight(torch.from_numpy(w), t) for w, t in zip(weights[1:], types[1:], strict=True)]
    module = GGUFLinear(parts, torch.float32, bias=torch.arange(32.0))
    x = torch.randn(2, 3, k)
    expected, scale = reference(x.reshape(6, k), weights, types)
    expected[:, :16] = expected[:, order]
    scale[:, :16] = scale[:, order]
    y = module(x)
    assert y.shape == (2, 3, 32)
    assert_close(y.reshape(6, 32) - torch.arange(32.0), expected, scale)
    bf16 = GGUFLinear(parts, torch.bfloat16)(x.bfloat16())
    assert bf16.dtype == torch.bfloat16


def test_bfloat16_batches_from_dense_rows_run_a_gemm_on_the_dequantised_weight() -> None:
    """Prefill-sized bfloat16 batches: the weight dequantised to bfloat16 in the model's row order (the Q/K rows
    undone) and oneDNN's GEMM; smaller batches, and the batch-invariant mode, keep the int8 kernel."""
    k = 256
    types = [Q.Q4_K, Q.Q8_0]
    weights = [random_blocks(t, 16, k, seed=i) for i, t in enumerate(types)]
    order = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    parts = [
        GGUFWeight(torch.from_numpy(weights[0]), types[0], order),
        GGUFWeight(torch.from_numpy(weights[1]), types[1]),
    ]
    module = GGUFLinear(parts, torch.bfloat16)
    stacked = torch.cat([p.dequantize() for p in parts])  # each in the model's row order
    assert torch.equal(stacked[:16], torch.from_numpy(dequantize(weights[0], types[0]).reshape(16, -1))[order])
    assert torch.equal(module.dequantize(), stacked)
    assert torch.equal(module.dequantize(torch.bfloat16), stacked.bfloat16())
    module.dense_rows = 8  # what a CPU with bfloat16 matmuls sets (SUPER_BLOCK_DENSE_ROWS), made small
    x = torch.randn(9, k).bfloat16()
    assert torch.equal(module(x), F.linear(x, stacked.bfloat16()))
    few = x[:7]
    expected = torch.ops.kvserve.gguf_linear(few.float(), module.blocks(), module.types, module.out_index)
    assert torch.equal(module(few), expected.bfloat16())
    model = torch.nn.Module()
    model.proj = module
    model.head_row_tile = 0
    make_batch_invariant(model)
    assert module.dense_rows > 2**40


def test_embedding_looks_up_dequantised_rows() -> None:
    blocks = random_blocks(Q.Q6_K, 10, 256)
    embedding = GGUFEmbedding(GGUFWeight(torch.from_numpy(blocks), Q.Q6_K), torch.bfloat16)
    ids = torch.tensor([[9, 0], [4, 4]])
    expected = torch.from_numpy(dequantize(blocks, Q.Q6_K).reshape(10, -1))[ids].bfloat16()
    assert torch.equal(embedding(ids), expected)


def test_the_ops_name_what_is_wrong() -> None:
    blocks = torch.from_numpy(random_blocks(Q.Q4_K, 4, 256))
    with pytest.raises(RuntimeError, match="ggml type 2 is not one of"):
        torch.ops.kvserve.gguf_linear(torch.randn(1, 256), [blocks], [int(Q.Q4_0)], NO_INDEX)
    with pytest.raises(RuntimeError, match="input size 288 is not a multiple of 256"):
        torch.ops.kvserve.gguf_linear(torch.randn(1, 288), [blocks], [int(Q.Q4_K)], NO_INDEX)
    with pytest.raises(RuntimeError, match=r"must be contiguous uint8 \(N, 288\)"):
        torch.ops.kvserve.gguf_linear(torch.randn(1, 512), [blocks], [int(Q.Q4_K)], NO_INDEX)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.kvserve.gguf_linear(torch.randn(1, 256).double(), [blocks], [int(Q.Q4_K)], NO_INDEX)
    with pytest.raises(RuntimeError, match="out_index must be"):
        torch.ops.kvserve.gguf_linear(torch.randn(1, 256), [blocks], [int(Q.Q4_K)], torch.arange(3))
    with pytest.raises(RuntimeError, match=r"out_index\[3\] = 4 is not a column of 4"):
        torch.ops.kvserve.gguf_linear(torch.randn(1, 256), [blocks], [int(Q.Q4_K)], torch.arange(1, 5))
    with pytest.raises(RuntimeError, match="row 4 is out of range"):
        torch.ops.kvserve.gguf_dequantize(blocks, int(Q.Q4_K), torch.tensor([4]))
    with pytest.raises(ValueError, match="Q4_0 is not one of"):
        GGUFWeight(blocks, Q.Q4_0)


@pytest.fixture(scope="module")
def gemma_tensors() -> dict[Q, object]:
    """The first tensor of each type the kernels run in the Gemma 3 270M Q4_K_M file."""
    reader = gguf_file.open_gguf(gemma3_270m_path())
    first: dict[Q, object] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type in NATIVE_TYPES and len(tensor.data.shape) == 2:
            first.setdefault(tensor.tensor_type, tensor)
    return first


def test_real_tensors_of_every_type_in_the_gemma_file(gemma_tensors) -> None:
    assert set(gemma_tensors) == {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0}
    for qtype, tensor in gemma_tensors.items():
        blocks = np.array(tensor.data[:640])  # at most 640 rows (the head has 262k), copied out of the read-only map
        k = GGUFWeight(torch.from_numpy(blocks), qtype).in_features
        x = torch.randn(3, k)
        expected, scale = reference(x, [blocks], [qtype])
        y = torch.ops.kvserve.gguf_linear(x, [torch.from_numpy(blocks)], [int(qtype)], NO_INDEX)
        assert_close(y, expected, scale)


AVX2_RUN = textwrap.dedent(
    """
    import sys, torch
    from torch.utils import cpp_extension
    csrc, build, out = sys.argv[1:4]
    cpp_extension.load(name="kvserve_gguf_gemv_avx2", sources=[csrc + "/gguf_gemv.cpp"], extra_include_paths=[csrc],
                       extra_cflags=["-O3", "-ffast-math", "-fopenmp", "-std=c++17", "-march=haswell"],
                       extra_ldflags=["-fopenmp"], build_directory=build, is_python_module=False)
    cases = torch.load(out)
    results = [torch.ops.kvserve.gguf_linear(x, [w], [t], torch.empty(0, dtype=torch.long)) for x, w, t in cases]
    torch.save(results, out)
    """
)


@pytest.mark.slow
def test_the_avx2_build_computes_the_same_bits(tmp_path) -> None:
    """The AVX2 path (maddubs + madd, built for haswell) and this CPU's (VNNI where it has it) sum the same integers
    in the same float order: identical results."""
    cases = []
    for i, qtype in enumerate(sorted(NATIVE_TYPES)):
        k = 512 if qtype in SUPER_TYPES else 96
        cases.append((torch.randn(5, k) * 2, torch.from_numpy(random_blocks(qtype, 11, k, seed=i)), int(qtype)))
    path = tmp_path / "cases.pt"
    torch.save(cases, path)
    build = build_directory().parent / f"{build_directory().name}_gguf_gemv_haswell"
    build.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", AVX2_RUN, str(CSRC), str(build), str(path)], check=True, timeout=600)
    for (x, w, qtype), avx2 in zip(cases, torch.load(path), strict=True):
        assert torch.equal(torch.ops.kvserve.gguf_linear(x, [w], [qtype], NO_INDEX), avx2), Q(qtype).name


@pytest.fixture(scope="module", params=["Q8_0-gqa-untied", "Q5_0-tied"])
def tiny_blocks(request, tmp_path_factory):
    return tiny_quantised(request.param, tmp_path_factory)


def test_a_llama_file_runs_on_its_blocks_close_to_the_dequantised_model(tiny_blocks) -> None:
    """Fused q/k/v and gate/up over the file's own tensors, llama.cpp's Q/K rows undone by where outputs land, the
    embedding (and a tied head) on the same bytes: the dequantised float32 model up to the int8 rounding of the
    activations, in float32 and bfloat16."""
    _, path = tiny_blocks
    native = load_model(path, torch.float32)
    assert native.weights == "native" and "on their blocks" in native.weights_summary
    layer = native.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, GGUFLinear) and isinstance(layer.mlp.gate_up_proj, GGUFLinear)
    assert layer.self_attn.qkv_proj.out_index.numel() == layer.self_attn.qkv_proj.out_features  # Q/K reordered
    assert isinstance(native.model.embed_tokens, GGUFEmbedding) and isinstance(native.model.lm_head, GGUFLinear)
    ids = random_ids()
    dequant = logits_of(load_model(path, torch.float32, weights="dequant"), ids)
    scale = dequant.abs().max().item()
    assert (logits_of(native, ids) - dequant).abs().max().item() < 0.03 * scale
    bf16 = logits_of(load_model(path, torch.bfloat16), ids).float()
    assert (bf16 - dequant).abs().max().item() < 0.1 * scale
    # weights=dequant, or no kernels: dequantised as before
    assert not any(
        isinstance(m, GGUFLinear) for m in load_model(path, torch.float32, weights="dequant").model.modules()
    )
