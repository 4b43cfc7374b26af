"""The decoder layers as one compiled call for decode steps (``models/decode_chain.py``): bit-identical hidden
states and caches to the eager layers, for weights on 4-bit codes and dense float32 and for bfloat16 on torch's
packed int4 codes, with and without a q/k/v bias, over several sequences whose lengths cross block boundaries;
the steps and models it must leave to the eager layers; its refusals; and the real model's greedy tokens and
logprobs with the chain on and off, in float32 and bfloat16."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from kvserve.attention import PagedAttentionMetadata, PagedKVCache
from kvserve.entrypoints.llm import LLM
from kvserve.models.decode_chain import DecodeChain
from kvserve.models.llama import DecoderLayer
from kvserve.models.loader import LoadedModel, load_model
from kvserve.models.quant_linear import QuantLinear
from kvserve.platform import cpu_kernels
from kvserve.sampling.sampling_params import SamplingParams
from tests.test_gguf_loader import checkpoint, write_gguf
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

BLOCK = 4
LENGTHS = [3, 8, 13, 1]  # prompt lengths: inside a block, a whole block, across blocks, a single token
DECODES = 6  # decode steps after the prompts: several sequences cross a block boundary on the way


@pytest.fixture(autouse=True)
def _kernels_built():
    assert cpu_kernels.cpu_kernels_available()


def load_tiny(name: str, tmp: Path, dtype: torch.dtype) -> LoadedModel:
    """A tiny model named weights-arch[-bias]: dense (a Hugging Face folder) or q4_0 / q4_1 (a GGUF run on its
    codes, ``--weights native``); gqa, mha (with a q/k/v bias) or qwen2 (its bias)."""
    weights, arch = name.split("-")[:2]
    if arch == "qwen2":
        spec = TinySpec(arch="qwen2", num_heads=4, num_kv_heads=2, seed=4)
    elif arch == "mha":
        spec = TinySpec(num_heads=4, num_kv_heads=4, attention_bias=True, seed=5)
    else:
        spec = TinySpec(num_heads=4, num_kv_heads=2, seed=6)
    if weights == "dense":
        return load_model(write_tiny_model(tmp / "hf", spec), dtype)
    _, state = checkpoint(tmp, spec)
    path = tmp / "tiny.gguf"
    qtype = GGMLQuantizationType.Q4_1 if weights == "q4_1" else GGMLQuantizationType.Q4_0
    write_gguf(path, spec, state, qtype=qtype)
    loaded = load_model(path, dtype, weights="native")
    assert loaded.weights == "native"
    return loaded


@pytest.fixture(scope="module", params=["q4_1-gqa", "dense-gqa", "dense-qwen2-bias", "q4_0-mha-bias"])
def tiny(request, tmp_path_factory):
    return load_tiny(request.param, tmp_path_factory.mktemp(request.param), torch.float32)


def run_steps(
    loaded, chain: bool, batch_invariant: bool = False, kv_dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], PagedKVCache]:
    """Prefill LENGTHS (eager: not decode steps), then DECODES steps of every sequence; each step's hidden states."""
    model, cfg = loaded.model, loaded.config
    model.decode_chain = False if chain else None  # False: made at the next forward
    blocks = [math.ceil((n + DECODES) / BLOCK) for n in LENGTHS]
    ids = list(range(1, sum(blocks) + 1))
    random.Random(0).shuffle(ids)  # no sequence's blocks are consecutive
    tables = [[ids.pop() for _ in range(b)] for b in blocks]
    cache = PagedKVCache(cfg.num_layers, sum(blocks) + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim, kv_dtype,
                         batch_invariant=batch_invariant)  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, cfg.vocab_size, (n + DECODES,), generator=gen) for n in LENGTHS]
    seqs = list(range(len(LENGTHS)))
    hidden = []
    with torch.inference_mode():
        for step in range(DECODES + 1):
            query = LENGTHS if step == 0 else [1] * len(LENGTHS)
            ctx = [0] * len(LENGTHS) if step == 0 else [n + step - 1 for n in LENGTHS]
            meta = PagedAttentionMetadata.build(seqs, query, ctx, tables, BLOCK)
            ids_now = torch.cat([t[c : c + q] for t, c, q in zip(tokens, ctx, query, strict=True)])
            positions = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, query, strict=True)])
            hidden.append(model(ids_now, positions, cache, meta))
    return hidden, cache


def test_chain_is_bit_identical_to_the_eager_layers(tiny) -> None:
    chain_hidden, chain_cache = run_steps(tiny, chain=True)
    assert isinstance(tiny.model.decode_chain, DecodeChain)  # it ran
    eager_hidden, eager_cache = run_steps(tiny, chain=False)
    for step, (got, want) in enumerate(zip(chain_hidden, eager_hidden, strict=True)):
        assert torch.equal(got, want), f"step {step}"
    assert torch.equal(chain_cache.k, eager_cache.k) and torch.equal(chain_cache.v, eager_cache.v)


@pytest.fixture(scope="module", params=["q4_1-gqa", "q4_0-mha-bias"])
def tiny_bf16(request, tmp_path_factory):
    """bfloat16 activations on 4-bit codes (``--weights native``): torch's packed int4 kernel for decode rows."""
    return load_tiny(request.param, tmp_path_factory.mktemp(request.param + "-bf16"), torch.bfloat16)


def test_bfloat16_chain_is_bit_identical_to_the_eager_layers(tiny_bf16) -> None:
    chain_hidden, chain_cache = run_steps(tiny_bf16, chain=True, kv_dtype=torch.bfloat16)
    chain = tiny_bf16.model.decode_chain
    assert isinstance(chain, DecodeChain) and chain.dtype == torch.bfloat16  # it ran, on the packed int4 codes
    assert chain.weights[1].dtype == torch.uint8 and chain.weights[2].dtype == torch.bfloat16
    eager_hidden, eager_cache = run_steps(tiny_bf16, chain=False, kv_dtype=torch.bfloat16)
    for step, (got, want) in enumerate(zip(chain_hidden, eager_hidden, strict=True)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), f"step {step}"
    assert torch.equal(chain_cache.k, eager_cache.k) and torch.equal(chain_cache.v, eager_cache.v)
    assert not chain.runs(torch.zeros(1, tiny_bf16.config.hidden_size))  # float32 rows: not this chain's


def assert_wide_batches_match_the_eager_layers(loaded, dtype: torch.dtype) -> None:
    """With the codes limited to 2 rows, the 4-sequence decode steps run the projections' dense copies (float32
    plain, bfloat16 reordered for oneDNN where it can) inside the chain: bit-identical to the eager layers."""
    monkeypatch = pytest.MonkeyPatch()
    for module in loaded.model.modules():
        if isinstance(module, QuantLinear):
            monkeypatch.setattr(module, "max_rows", 2)
    try:
        chain_hidden, chain_cache = run_steps(loaded, chain=True, kv_dtype=dtype)
        chain = loaded.model.decode_chain
        assert chain.max_rows == 2 and chain.wide is not None
        assert chain.runs(torch.zeros(len(LENGTHS), loaded.config.hidden_size, dtype=dtype))
        eager_hidden, eager_cache = run_steps(loaded, chain=False, kv_dtype=dtype)
    finally:
        monkeypatch.undo()
    for step, (got, want) in enumerate(zip(chain_hidden, eager_hidden, strict=True)):
        assert torch.equal(got, want), f"step {step}"
    assert torch.equal(chain_cache.k, eager_cache.k) and torch.equal(chain_cache.v, eager_cache.v)


def test_wide_float32_batches_run_the_dense_copies_bit_identically(tiny) -> None:
    if tiny.weights != "native":  # dense weights only: one tier takes every row count
        chain = DecodeChain.of(tiny.model.layers, DecoderLayer)
        assert chain.wide is None and chain.runs(torch.zeros(1000, tiny.config.hidden_size))
        return
    assert_wide_batches_match_the_eager_layers(tiny, torch.float32)


def test_wide_bfloat16_batches_run_the_dense_copies_bit_identically(tiny_bf16) -> None:
    assert_wide_batches_match_the_eager_layers(tiny_bf16, torch.bfloat16)


def test_the_op_refuses_codes_of_another_dtype(tiny_bf16) -> None:
    """float32 x through a bfloat16 chain is refused by name, not computed: first by its norms, then (norms made
    float32) by the packed int4 codes."""
    cfg = tiny_bf16.config
    cache = PagedKVCache(cfg.num_layers, 8, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    decode = cache.in_place_decode(PagedAttentionMetadata.build([0], [1], [2], [[1]], BLOCK))
    chain = DecodeChain.of(tiny_bf16.model.layers, DecoderLayer)
    rope = tiny_bf16.model.rotary.table(torch.tensor([2]), torch.float32)
    x = torch.zeros(1, cfg.hidden_size)
    as_float32 = DecodeChain(chain.weights, 1, chain.num_heads, chain.num_kv_heads, chain.eps)
    with pytest.raises(RuntimeError, match="norm weights must be Float as x"):
        as_float32(x, rope, decode)
    weights = [w.float() if w.dim() == 1 else w for w in chain.weights]  # the norms
    as_float32 = DecodeChain(weights, 1, chain.num_heads, chain.num_kv_heads, chain.eps)
    with pytest.raises(RuntimeError, match="packed int4 codes take x of their scales' dtype BFloat16"):
        as_float32(x, rope, decode)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_chain_is_bit_identical_over_a_narrower_cache(tiny, kv_dtype) -> None:
    """A float32 model over a bfloat16/float16 cache: the chain rounds the keys as the eager layers do, and both
    stay within float32 rounding of the torch reference (no kernels) over the same rounded cache."""
    chain_hidden, chain_cache = run_steps(tiny, chain=True, kv_dtype=kv_dtype)
    assert isinstance(tiny.model.decode_chain, DecodeChain) and chain_cache.k.dtype == kv_dtype
    eager_hidden, eager_cache = run_steps(tiny, chain=False, kv_dtype=kv_dtype)
    assert all(torch.equal(a, b) for a, b in zip(chain_hidden, eager_hidden, strict=True))
    assert torch.equal(chain_cache.k, eager_cache.k) and torch.equal(chain_cache.v, eager_cache.v)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_KERNELS", "torch")
        patch.setattr(cpu_kernels, "cpu_kernels_available", lambda: False)
        reference, _ = run_steps(tiny, chain=False, kv_dtype=kv_dtype)
    # Float32 differences in a key before it is rounded can flip the rounding of an element (one unit of the
    # cache dtype's last place), which then reaches every later step: measured up to 2e-4 on an AVX-512 CPU
    # with float16. A quarter of the dtype's epsilon leaves room for that and catches a wrong kernel.
    tolerance = torch.finfo(kv_dtype).eps / 4
    for got, want in zip(chain_hidden, reference, strict=True):
        assert torch.allclose(got, want, atol=tolerance, rtol=tolerance)
    wide_hidden, _ = run_steps(tiny, chain=True)
    assert not torch.equal(wide_hidden[-1], chain_hidden[-1])  # the rounding is real


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_decode_steps_skip_the_layer_by_layer_attention(tiny, monkeypatch, batch_invariant) -> None:
    """With the chain only the prefill step calls the cache layer by layer; a batch-invariant cache keeps every
    step there (its attention runs each row in a call of its own shape)."""
    calls = []
    forward = PagedKVCache.forward
    monkeypatch.setattr(PagedKVCache, "forward", lambda self, *a: calls.append(a[0]) or forward(self, *a))
    run_steps(tiny, chain=True, batch_invariant=batch_invariant)
    steps = DECODES + 1 if batch_invariant else 1
    assert len(calls) == tiny.config.num_layers * steps


def test_steps_the_chain_leaves_to_the_eager_layers(tiny) -> None:
    cfg = tiny.config
    cache = PagedKVCache(cfg.num_layers, 8, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    mixed = PagedAttentionMetadata.build([0, 1], [1, 3], [2, 0], [[1], [2]], BLOCK)
    assert cache.in_place_decode(mixed) is None  # a prefill beside the decode
    decode = PagedAttentionMetadata.build([0], [1], [2], [[1]], BLOCK)
    assert cache.in_place_decode(decode) is not None
    invariant = PagedKVCache(cfg.num_layers, 8, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                             batch_invariant=True)  # fmt: skip
    assert invariant.in_place_decode(decode) is None  # attention per row in its own call shape
    windowed = PagedKVCache(cfg.num_layers, 8, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                            layer_windows=[4] * cfg.num_layers)  # fmt: skip
    assert windowed.in_place_decode(decode) is None


def test_models_the_chain_does_not_take(tiny) -> None:
    chain = DecodeChain.of(tiny.model.layers, DecoderLayer)
    assert chain is not None and chain.runs(torch.zeros(1, tiny.config.hidden_size))
    if tiny.weights == "native":  # above max_rows the projections use their dense copies, in the wide weights
        down = tiny.model.layers[0].mlp.down_proj
        assert chain.max_rows == down.max_rows and chain.wide is not None
        assert any(w.data_ptr() == down.dense.data_ptr() for w in chain.wide[0])
        assert chain.runs(torch.zeros(chain.max_rows + 1, tiny.config.hidden_size))
    assert not chain.runs(torch.zeros(1, tiny.config.hidden_size, dtype=torch.bfloat16))
    assert DecodeChain.of(tiny.model.layers, torch.nn.Module) is None  # another layer class (Gemma 3's)
    wrapped = torch.nn.ModuleList(tiny.model.layers)
    original = wrapped[0].self_attn.o_proj
    try:
        wrapped[0].self_attn.o_proj = torch.nn.Sequential(original)  # e.g. tensor parallelism's all-reduce wrapper
        assert DecodeChain.of(wrapped, DecoderLayer) is None
    finally:
        wrapped[0].self_attn.o_proj = original


def test_model_conversion_remakes_the_chain(tiny) -> None:
    run_steps(tiny, chain=True)
    assert isinstance(tiny.model.decode_chain, DecodeChain)
    tiny.model.to(torch.float32)  # any .to(): the chain's tensors may have been replaced
    assert tiny.model.decode_chain is False


def test_the_op_names_a_bad_weight_list(tiny) -> None:
    chain = DecodeChain.of(tiny.model.layers, DecoderLayer)
    cfg = tiny.config
    cache = PagedKVCache(cfg.num_layers, 8, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    decode = cache.in_place_decode(PagedAttentionMetadata.build([0], [1], [2], [[1]], BLOCK))
    x = torch.zeros(1, cfg.hidden_size)
    rope = tiny.model.rotary.table(torch.tensor([2]), torch.float32)
    short = DecodeChain(chain.weights[:-1], chain.max_rows, chain.num_heads, chain.num_kv_heads, chain.eps)
    with pytest.raises(RuntimeError, match=rf"{len(chain.weights) - 1} weights for {cfg.num_layers} layers"):
        short(x, rope, decode)
    wrong_heads = DecodeChain(chain.weights, chain.max_rows, chain.num_heads, chain.num_kv_heads + 1, chain.eps)
    with pytest.raises(RuntimeError, match="query heads over"):
        wrong_heads(x, rope, decode)


@pytest.mark.real_model
def test_real_model_tokens_and_logprobs_do_not_change(shared_real_loads) -> None:
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", swap_space=0, enable_prefix_caching=False)
    assert_the_chain_changes_nothing(llm, ["Tell me a story.", "What is 2+2? Explain in detail, please.", "Hi"], 24)


@pytest.mark.real_model
def test_real_model_bfloat16_tokens_and_logprobs_do_not_change(shared_real_loads) -> None:
    """Three sequences run the packed int4 codes, six the dense copies (reordered for oneDNN where it can)."""
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", swap_space=0, enable_prefix_caching=False)
    prompts = ["Tell me a story.", "What is 2+2? Explain in detail, please.", "Hi"]
    assert_the_chain_changes_nothing(llm, prompts, 24)
    llm.engine.runner.model.decode_chain = False  # made again at the next step
    assert_the_chain_changes_nothing(llm, [*prompts, "Name three rivers.", "Why is the sky blue?", "Count to ten."], 24)


def assert_the_chain_changes_nothing(llm: LLM, prompts: list[str], max_tokens: int) -> None:
    """Greedy tokens and logprobs of ``prompts`` with the decode chain and then with the eager layers: equal."""
    model = llm.engine.runner.model
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    with_chain = llm.generate(prompts, params)
    assert isinstance(model.decode_chain, DecodeChain)
    model.decode_chain = None
    eager = llm.generate(prompts, params)
    for a, b in zip(with_chain, eager, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    model.decode_chain = False  # the chain again at the next decode, for whoever runs this model next
