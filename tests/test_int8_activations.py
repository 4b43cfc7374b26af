"""Int8 activations for the 4-bit projections (``models/int8_activations.py``, ``q4_linear_q8``).

The kernel against a written-out reference (x rounded to int8 per group of 32, integer dot products, then the
scales and offsets) over odd group counts, tile sizes and outputs split over threads; a row's result does not
depend on its batch; the nibble layout round-trips; the engine mode runs the kernel in the decode chain
(bit-identical to the eager layers) and refuses what it cannot run; on the real model the prompt's
log-likelihood and the greedy tokens stay close to float32 activations, and the mode composes with a
compressing policy's one-call decode and a float16 cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.entrypoints.llm import LLM
from kvserve.eval.data import AUSTEN
from kvserve.models.decode_chain import DecodeChain
from kvserve.models.loader import load_model
from kvserve.models.quant_linear import Int4Weight, Int8Weight, Q8Linear, QuantLinear
from kvserve.platform import cpu_kernels
from kvserve.sampling.sampling_params import SamplingParams
from tests.test_decode_chain import assert_the_chain_changes_nothing, run_steps
from tests.test_gguf_loader import checkpoint, write_gguf
from tests.test_quant_linear import blocks_of, rel_err
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

Q = GGMLQuantizationType


@pytest.fixture(autouse=True)
def _kernels_built():
    assert cpu_kernels.cpu_kernels_available()


def rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded to int8 per row and group of 32, as the kernels do: (q (M, G, 32), d (M, G)) in float64."""
    rows, k = x.shape
    groups = x.reshape(rows, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    # 127 / max|x| correctly rounded to float32, as the kernels divide (torch's scalar / tensor multiplies by the
    # reciprocal: a last-bit difference that turns an exact tie, x * inv = n + 0.5, into another integer).
    inv = (127.0 / amax.double()).float()
    q = torch.round(groups * torch.where(amax > 0, inv, torch.zeros_like(amax)))
    return q.double(), (amax / 127.0).squeeze(-1).double()


def reference(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """What ``q4_linear_q8`` computes, written out: x rounded to int8 per row and group of 32 (scale max|x| / 127),
    each group's integer dot product with the codes, times both scales; the offsets times the scaled group sums."""
    q, d = rounded(x)
    offsets = (q.sum(-1) * d) @ weight.offset.double().T
    return scaled_dots(q, d, weight.codes, weight.scale) + offsets


def scaled_dots(q: torch.Tensor, d: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each group's exact integer dot product of rounded rows q (M, G, 32) with codes (N, K), times both scales
    (the rows' d (M, G), the codes' scale (N, G)), summed over groups: (M, N) float64."""
    dots = torch.einsum("mgj,ngj->mng", q, codes.reshape(codes.shape[0], -1, 32).double())  # exact integers
    return (dots * d.unsqueeze(1) * scale.double()).sum(-1)


def head_reference(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """What ``q8_linear_q8`` computes, written out: each group's integer dot product of the rounded x with the
    int8 codes, times both scales."""
    return scaled_dots(*rounded(x), weight.codes, weight.scale)


def int8_head(shape: tuple[int, int], seed: int = 0, dense: bool = False) -> tuple[Q8Linear, Int8Weight]:
    blocks, w = blocks_of(shape, Q.Q8_0, seed=seed)
    weight = Int8Weight.from_q8_0_blocks(blocks)
    weight.codes[0, :3] = torch.tensor([-128, 127, -127], dtype=torch.int8)  # the code range's ends (ggml: +-127)
    head = Q8Linear(weight, torch.float32, dense=w if dense else None)
    assert head.round_activations_to_int8()
    return head, weight


def int8_module(qtype: Q, shape: tuple[int, int], seed: int = 0) -> tuple[QuantLinear, Int4Weight]:
    blocks, _ = blocks_of(shape, qtype, seed=seed)
    weight = Int4Weight.from_ggml_blocks(blocks, qtype)
    module = QuantLinear(weight, torch.float32)
    assert module.round_activations_to_int8()
    return module, weight


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(8, 32), (104, 96), (40, 608), (576, 1536)])  # 1, 3, 19 and 48 groups
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_kernel_matches_the_written_out_reference_row_by_row(qtype, shape, rows) -> None:
    torch.set_num_threads(2)  # the outputs split over threads
    module, weight = int8_module(qtype, shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    if shape[1] > 32:
        x[0, 32:64] = 0.0  # an all-zero group: scale 0, nothing divided by it
    got = module(x)
    assert rel_err(got, reference(x, weight)) < 1e-5
    for i in range(rows):
        assert torch.equal(module(x[i : i + 1])[0], got[i])
    # Lossy against float32 activations, by the rounding of 8 bits (a few tenths of a percent here), not more.
    assert 1e-4 < rel_err(got, F.linear(x.double(), weight.dequantize().double())) < 2e-2


def test_prefill_sized_batches_on_the_codes_cross_row_blocks_unchanged() -> None:
    """Int8 mode keeps no dense copy, so every batch runs the kernel, which takes its rows in blocks of 64: 150
    rows (two blocks and a remainder of 22) against 24 outputs (3 interleaved blocks of 8, split over threads)
    match the reference, and each row equals it computed alone."""
    torch.set_num_threads(2)
    module, weight = int8_module(Q.Q4_1, (24, 96), seed=5)
    x = torch.randn(150, 96, generator=torch.Generator().manual_seed(5))
    got = module(x)
    assert rel_err(got, reference(x, weight)) < 1e-5
    for i in (0, 63, 64, 127, 128, 149):
        assert torch.equal(module(x[i : i + 1])[0], got[i])
    assert torch.equal(module(x[60:70]), got[60:70])


@pytest.mark.parametrize("shape", [(8, 32), (104, 96), (40, 608), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 70])
def test_head_kernel_matches_the_written_out_reference_row_by_row(shape, rows) -> None:
    """The Q8_0 head on int8 rows (VNNI where the CPU has it, else AVX2's sign trick: the same integers)."""
    torch.set_num_threads(2)
    head, weight = int8_head(shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    x[0, :32] = torch.linspace(-1.0, 1.0, 32)  # a group whose maximum rounds to +127 and -127 against -128
    got = head(x)
    assert rel_err(got, head_reference(x, weight)) < 1e-5
    for i in range(min(rows, 9)):
        assert torch.equal(head(x[i : i + 1])[0], got[i])
    assert 1e-4 < rel_err(got, F.linear(x.double(), weight.dequantize().double())) < 2e-2


def test_head_layout_round_trips_and_the_switch_drops_the_dense_copy() -> None:
    head, weight = int8_head((40, 96), dense=True)
    assert head.offset_codes.dtype == torch.uint8 and head.offset_codes.shape == (40, 96)
    assert head.scales.shape == (5, 3, 8)
    # Block 1, group 2, v = 5, row 3, byte 2: input 2 * 32 + 4 * 5 + 2 of row 11, plus 128.
    assert int(head.offset_codes.view(5, 3, 8, 8, 4)[1, 2, 5, 3, 2]) == int(weight.codes[11, 86]) + 128
    assert float(head.scales[1, 2, 3]) == float(weight.scale[11, 2])
    back = Int8Weight.from_interleaved(head.offset_codes, head.scales)
    assert torch.equal(back.codes, weight.codes) and torch.equal(back.scale, weight.scale)
    assert head.dense is None and not hasattr(head, "codes") and not head.round_activations_to_int8()
    many = torch.randn(300, 96)
    assert rel_err(head(many), head_reference(many, weight)) < 1e-5  # every batch on the codes
    blocks, _ = blocks_of((36, 96), Q.Q8_0)  # not whole blocks of 8: float32 activations stay
    odd = Q8Linear(Int8Weight.from_q8_0_blocks(blocks), torch.float32)
    assert not odd.round_activations_to_int8() and hasattr(odd, "codes")
    assert not Q8Linear(weight, torch.bfloat16).round_activations_to_int8()
    with pytest.raises(RuntimeError, match=r"codes must be contiguous uint8 \(N, 96\) with N a multiple of 8"):
        torch.ops.kvserve.q8_linear_q8(many, head.offset_codes[:36], head.scales)


def test_interleaved_layout_round_trips_and_the_switch_keeps_the_weight() -> None:
    module, weight = int8_module(Q.Q4_1, (40, 96))
    assert module.nibbles.dtype == torch.uint8 and module.nibbles.shape == (40, 48)
    assert module.consts.shape == (5, 3, 2, 8)  # 5 blocks of 8 rows, 3 groups, scales then offsets
    # Block 1, group 2, v = 3, row 5, byte 1: input 2 * 32 + 8 * 3 + 1 in the low nibble, + 4 in the high one.
    byte = module.nibbles.view(5, 3, 4, 8, 4)[1, 2, 3, 5, 1]
    assert int(byte) == int(weight.codes[13, 89]) | int(weight.codes[13, 93]) << 4
    assert float(module.consts[1, 2, 1, 5]) == float(weight.offset[13, 2])
    assert torch.equal(Int4Weight.codes_from_interleaved_nibbles(module.nibbles, 96), weight.codes)
    assert torch.equal(module.int4_weight().dequantize(), weight.dequantize())
    assert not hasattr(module, "codes")
    assert not module.round_activations_to_int8()  # once only
    bf16 = QuantLinear(weight, torch.bfloat16)
    assert not bf16.round_activations_to_int8()
    blocks, _ = blocks_of((36, 96), Q.Q4_1)  # 36 outputs: not whole blocks of 8, so it keeps float32 activations
    odd = QuantLinear(Int4Weight.from_ggml_blocks(blocks, Q.Q4_1), torch.float32)
    assert not odd.round_activations_to_int8() and not odd.int8_activations and hasattr(odd, "codes")


def test_the_switch_drops_the_dense_copy_and_every_batch_runs_the_codes() -> None:
    blocks, w = blocks_of((48, 64), Q.Q4_1)
    weight = Int4Weight.from_ggml_blocks(blocks, Q.Q4_1)
    module = QuantLinear(weight, torch.float32, dense=w)
    many = torch.randn(300, 64)
    assert torch.equal(module(many), F.linear(many, w))  # float32: the dense copy above 16 rows
    module.round_activations_to_int8()
    assert module.dense is None and module.dense_packed is None
    got = module(many)
    assert rel_err(got, reference(many, weight)) < 1e-5
    assert torch.equal(module(many[:1])[0], got[0])


def test_the_op_names_bad_codes() -> None:
    module, _ = int8_module(Q.Q4_1, (48, 64))
    with pytest.raises(RuntimeError, match=r"nibbles must be contiguous uint8 \(N, 32\)"):
        torch.ops.kvserve.q4_linear_q8(torch.randn(2, 64), module.nibbles[:, :16], module.consts)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        torch.ops.kvserve.q4_linear_q8(torch.randn(2, 48), module.nibbles, module.consts)
    with pytest.raises(RuntimeError, match=r"\(N, 32\) with N a multiple of 8, got \[44, 32\]"):
        torch.ops.kvserve.q4_linear_q8(torch.randn(2, 64), module.nibbles[:44], module.consts)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    spec = TinySpec(num_heads=4, num_kv_heads=2, seed=6)
    tmp = tmp_path_factory.mktemp("int8")
    _, state = checkpoint(tmp, spec)
    path = tmp / "tiny.gguf"
    write_gguf(path, spec, state, qtype=Q.Q4_1)
    return spec, path


@pytest.mark.slow
def test_decode_chain_runs_the_int8_kernel_bit_identically(tiny_gguf) -> None:
    _, path = tiny_gguf
    loaded = load_model(path, torch.float32, weights="native", int8_activations=True)
    assert loaded.int8_activations and "int8 activations" in loaded.weights_summary
    assert loaded.model.layers[0].mlp.down_proj.int8_activations
    chain_hidden, chain_cache = run_steps(loaded, chain=True)
    assert isinstance(loaded.model.decode_chain, DecodeChain)
    eager_hidden, eager_cache = run_steps(loaded, chain=False)
    assert all(torch.equal(a, b) for a, b in zip(chain_hidden, eager_hidden, strict=True))
    assert torch.equal(chain_cache.k, eager_cache.k)
    float_hidden, _ = run_steps(load_model(path, torch.float32, weights="native"), chain=True)
    assert not torch.equal(float_hidden[-1], chain_hidden[-1])  # the rounding is real
    assert torch.allclose(float_hidden[-1], chain_hidden[-1], rtol=0.1, atol=0.1)


def test_models_and_configurations_it_cannot_run(tiny_gguf, tmp_path) -> None:
    spec, path = tiny_gguf
    with pytest.raises(ValueError, match="has none"):
        load_model(write_tiny_model(tmp_path / "hf", spec), torch.float32, int8_activations=True)
    with pytest.raises(ValueError, match="has none"):
        load_model(path, torch.float32, weights="dequant", int8_activations=True)
    with pytest.raises(ValueError, match="rounds float32 activations; this engine runs bfloat16: set dtype='float32'"):
        EngineConfig(model=str(path), dtype="bfloat16", int8_activations=True)
    with pytest.raises(ValueError, match="needs weights='native' or 'int4', got 'dequant'"):
        EngineConfig(model=str(path), dtype="float32", weights="dequant", int8_activations=True)
    with pytest.raises(ValueError, match="it needs tensor_parallel_size=1, got 2"):
        EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2, int8_activations=True)
    with pytest.raises(ValueError, match="needs a model loaded with load_model"):
        config = EngineConfig(model=str(path), dtype="float32", int8_activations=True)
        LLMEngine(config, load_model(path, torch.float32))


def test_the_command_line_flag_reaches_the_engine_config() -> None:
    import argparse

    from kvserve.entrypoints.cli_common import add_model_args
    from kvserve.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--dtype", "float32", "--int8-activations"])).int8_activations
    assert not engine_config_from_args(parser.parse_args(["--dtype", "float32"])).int8_activations


@pytest.mark.real_model
def test_real_model_likelihood_and_greedy_tokens_stay_close_to_float32(shared_real_loads) -> None:
    text = AUSTEN.read_text()[20000:22000]
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=0, ignore_eos=True)
    results = {}
    for int8 in (False, True):
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", int8_activations=int8)
        ids = llm.engine.tokenizer.encode(text)[:300]
        (out,) = llm.generate([ids], params, use_tqdm=False)
        logprobs = torch.tensor([step[t] for step, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])
        results[int8] = logprobs, out.outputs[0].token_ids
    (wide, wide_tokens), (narrow, narrow_tokens) = results[False], results[True]
    print("int8 vs float32: max |dlogprob|", (narrow - wide).abs().max().item(), "mean", narrow.mean().item(),
          wide.mean().item(), "tokens", narrow_tokens, wide_tokens)  # fmt: skip
    assert not torch.equal(narrow, wide)
    assert narrow.mean().item() == pytest.approx(wide.mean().item(), abs=0.02)
    assert narrow_tokens[:4] == wide_tokens[:4]


@pytest.mark.real_model
def test_real_model_composes_with_a_compressing_policy_and_a_narrower_cache(shared_real_loads) -> None:
    """The int8 kernel inside the compressed cache's one-call decode (per-layer tables, scores folded after it):
    the same tokens and logprobs as the eager layers. Over a float16 paged cache it decodes through the chain too,
    and the greedy text follows the float32 cache's until a near-tie: both round, so where the two first differ each
    run ranks the other's token second, close behind (measured on an AVX2 EPYC: 0.03 and 0.12 nats)."""
    prompts = ["Tell me a story about a lighthouse keeper and the storm that changed his life.", "What is 2+2?"]
    compressed = LLM(dtype="float32", kv_cache_memory="64MiB", swap_space=0, kv_policy="h2o", kv_budget=0.5,
                     int8_activations=True)  # fmt: skip
    assert_the_chain_changes_nothing(compressed, prompts, 40)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = {}
    for kv_cache_dtype in ("auto", "float16"):
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype=kv_cache_dtype, int8_activations=True)
        outputs[kv_cache_dtype] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.runner.cache.k.dtype == torch.float16
    assert isinstance(llm.engine.runner.model.decode_chain, DecodeChain)
    for narrow, wide in zip(outputs["float16"], outputs["auto"], strict=True):
        pairs = list(zip(narrow.token_ids, wide.token_ids, strict=True))
        split = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        assert split >= 2, (narrow.token_ids, wide.token_ids)
        if split < len(pairs):
            for run, own, other in ((narrow, *pairs[split]), (wide, *reversed(pairs[split]))):
                top = run.logprobs[split]
                assert other in top and top[own] - top[other] < 0.25, (split, top, narrow.token_ids, wide.token_ids)
