"""Mixtures of experts on tiny random checkpoints (float32): Qwen3-MoE (a dense ``mlp_only_layers`` layer before
sparse ones, top-k renormalised), Mixtral (Llama attention, Q/K permuted in GGUF, top-2) and Qwen2-MoE (shared
expert behind a sigmoid gate, q/k/v bias, top-k not renormalised), each from its Hugging Face folder and from GGUF,
against transformers; the grouped-by-expert block against a per-token loop; quantised GGUF experts; one KV
technique per family through the engine; tensor-parallel shards of the experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.errors import UnsupportedModelError
from kvserve.models import LoadedModel, load_model
from kvserve.models.loader import read_model_config
from kvserve.models.moe import BlockExperts, SparseMoE, checkpoint_names
from kvserve.models.quant_linear import QuantLinear
from kvserve.models.sharding import TensorShard, check_shardable
from kvserve.parallel.tensor_model import RowParallel
from tests.family_checks import all_position_logits, assert_engine_greedy_matches, assert_logits_match, random_ids
from tests.gguf_convert import Q, write_gguf_from_hf
from tests.tiny_models import TinySpec, hf_logits, load_hf_model, torch_single_thread, write_tiny_model  # noqa: F401

FAMILIES = {
    "qwen3_moe": TinySpec(
        arch="qwen3_moe", num_kv_heads=2, num_layers=3, seed=3,
        extra={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
               "mlp_only_layers": [0]},
    ),
    "mixtral": TinySpec(
        arch="mixtral", num_kv_heads=2, intermediate_size=64, seed=4,
        extra={"num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    "qwen2_moe": TinySpec(
        arch="qwen2_moe", num_kv_heads=2, seed=5,
        extra={"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 64},
    ),
}  # fmt: skip
FORMATS = ("folder", "gguf")
IDS = random_ids(48, 300, seed=1)


@dataclass
class Family:
    name: str
    folder: Path
    gguf: Path
    hf: object

    def source(self, fmt: str) -> Path:
        return self.folder if fmt == "folder" else self.gguf


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Family:
    root = tmp_path_factory.mktemp(request.param)
    folder = write_tiny_model(root / "hf", FAMILIES[request.param])
    return Family(request.param, folder, write_gguf_from_hf(folder, root / "f32.gguf"), load_hf_model(folder))


def sparse_inputs(loaded: LoadedModel, ids: list[int]) -> dict[int, torch.Tensor]:
    """Each sparse layer's MLP input over ``ids`` (captured from a real forward)."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda _, args, i=i: seen.__setitem__(i, args[0].clone()))
        for i, layer in enumerate(loaded.model.layers)
        if isinstance(layer.mlp, SparseMoE)
    ]
    all_position_logits(loaded, ids)
    for hook in hooks:
        hook.remove()
    return seen


def per_token_reference(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The block computed one token and one chosen expert at a time, straight from the stacked weights."""
    experts, weights = block.route(x)
    size = block.experts.intermediate_size
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].tolist(), strict=True):
            gate, up = (block.experts.gate_up[e] @ x[t]).split(size)
            out[t] += w * (block.experts.down[e] @ (torch.nn.functional.silu(gate) * up))
    if "shared_expert" in block._modules:
        out += torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


# ----- structure and logits -----


def test_config_from_gguf_matches_the_folder(family) -> None:
    folder, gguf = read_model_config(family.folder), read_model_config(family.gguf)
    fields = ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "sparse_layers", "shared_expert_intermediate_size", "attention_bias", "intermediate_size")  # fmt: skip
    assert {f: getattr(gguf, f) for f in fields} == {f: getattr(folder, f) for f in fields}
    expected = {"qwen3_moe": (1, 2), "mixtral": (0, 1), "qwen2_moe": (0, 1)}[family.name]
    assert folder.sparse_layers == expected
    assert folder.norm_topk_prob == (family.name != "qwen2_moe")


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_transformers_at_every_position(family, fmt) -> None:
    loaded = load_model(family.source(fmt))
    assert_logits_match(loaded, family.hf, IDS)
    layers = loaded.model.layers
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == [
        i in loaded.config.sparse_layers for i in range(len(layers))
    ]


def test_grouped_experts_equal_a_per_token_loop_and_routing_spreads(family) -> None:
    loaded = load_model(family.folder)
    for i, x in sparse_inputs(loaded, IDS).items():
        block = loaded.model.layers[i].mlp
        with torch.no_grad():
            torch.testing.assert_close(block(x), per_token_reference(block, x), atol=1e-5, rtol=1e-5)
            experts, weights = block.route(x)
        used = torch.bincount(experts.reshape(-1), minlength=loaded.config.num_experts)
        assert (used > 0).sum() >= loaded.config.num_experts - 1, f"layer {i}: experts used {used.tolist()}"
        assert len({tuple(row) for row in experts.tolist()}) > 4, "tokens should not all pick the same experts"
        logits = block.gate(x).float().sort(-1, descending=True).values
        k = loaded.config.num_experts_per_tok
        assert (logits[:, k - 1] - logits[:, k]).min() > 1e-3, "a near tie in the top-k would make routing fragile"
        if loaded.config.norm_topk_prob:
            torch.testing.assert_close(weights.sum(-1), torch.ones(len(IDS)))


def test_batch_invariant_experts_give_a_token_the_same_result_in_any_batch(family) -> None:
    loaded = load_model(family.folder, batch_invariant=True)
    layer, x = next(iter(sparse_inputs(loaded, IDS).items()))
    block = loaded.model.layers[layer].mlp
    with torch.no_grad():
        assert torch.equal(block(x[:5]), block(x)[:5])
        assert torch.equal(block(x[7:8]), block(x)[7:8])


def test_a_wrong_routing_rule_would_be_caught(family) -> None:
    """The parity checks see routing: flipping the renormalisation moves the logits far beyond the tolerance."""
    loaded = load_model(family.folder)
    for layer in loaded.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.norm_topk_prob = not layer.mlp.norm_topk_prob
    diff = (all_position_logits(loaded, IDS) - hf_logits(family.hf, IDS)).abs().max().item()
    assert diff > 1e-2


# ----- the engine -----


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_greedy_matches_transformers_with_prefix_hits_and_preemption(family, fmt) -> None:
    assert_engine_greedy_matches(family.source(fmt), family.hf)


def test_quantised_gguf_experts_load_and_run(family, tmp_path) -> None:
    """Q8_0 everywhere: dequantised, the stacked experts are ggml's dequantisation of their blocks, and the logits
    stay near transformers'; by default the experts run on the file's blocks (``BlockExperts``, int8 activations)
    close to the dequantised model. Qwen2-MoE also as Q4_0: its 2-D projections (attention, shared expert) run on
    their 4-bit codes while the stacked experts are dequantised, and that equals the same file fully dequantised."""
    reference = hf_logits(family.hf, IDS)
    q8_path = write_gguf_from_hf(family.folder, tmp_path / "q8.gguf", Q.Q8_0)
    q8 = load_model(q8_path, weights="dequant")
    assert "Q8_0" in q8.weights_summary
    layer = q8.config.sparse_layers[-1]
    state = load_file(family.folder / "model.safetensors")
    prefix, (_, _, down) = checkpoint_names(q8.config.architecture)
    name = f"model.layers.{layer}.{prefix}experts.{{}}.{down}.weight"
    stacked = torch.stack([state[name.format(e)] for e in range(q8.config.num_experts)]).numpy()
    expected = torch.from_numpy(dequantize(quantize(stacked, Q.Q8_0), Q.Q8_0))
    assert torch.equal(q8.model.layers[layer].mlp.experts.down, expected)
    logits = all_position_logits(q8, IDS)
    # Near, not within 1e-4: rounding moves every logit a little, and a token whose top-k changes moves more.
    assert (logits - reference).abs().median().item() < 0.1
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.85
    blocks = load_model(q8_path)
    assert isinstance(blocks.model.layers[layer].mlp.experts, BlockExperts)
    on_blocks = all_position_logits(blocks, IDS)  # int8 activations also move a token's top-k now and then
    assert (on_blocks - reference).abs().median().item() < 0.1
    assert (on_blocks.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.85
    if family.name == "qwen2_moe":
        path = write_gguf_from_hf(family.folder, tmp_path / "q4.gguf", Q.Q4_0)
        native, dequant = load_model(path), load_model(path, weights="dequant")
        assert native.weights == "native" and "Q4_0 as int4" in native.weights_summary
        assert isinstance(native.model.layers[0].mlp.shared_expert.down_proj, QuantLinear)
        torch.testing.assert_close(
            all_position_logits(native, IDS), all_position_logits(dequant, IDS), atol=1e-3, rtol=0
        )
        llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=2**20, swap_space=2**20)
        (out,) = llm.generate([IDS[:20]], GREEDY_16, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 16


def greedy(source: Path, prompts: list[list[int]], **options) -> list[list[int]]:
    llm = LLM(str(source), dtype="float32", block_size=4, kv_cache_memory=2**20, swap_space=2**20, **options)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = [random_ids(n, 298, seed=n) for n in (30, 45)]


def test_a_lossless_kv_technique_is_token_identical_to_the_full_cache(family) -> None:
    """Qwen3-MoE: SnapKV at a budget of the whole prompt; Mixtral: the host offload tier; Qwen2-MoE: Prompt Cache
    over a one-module schema, which equals the same tokens run without the cache."""
    source = family.gguf if family.name == "mixtral" else family.folder
    if family.name == "qwen3_moe":
        assert greedy(source, PROMPTS, kv_policy="snapkv", kv_budget=1.0) == greedy(source, PROMPTS)
        assert [len(t) for t in greedy(source, PROMPTS, kv_policy="snapkv", kv_budget=0.5)] == [16, 16]  # lossy: runs
    elif family.name == "mixtral":
        assert greedy(source, PROMPTS, kv_offload="host") == greedy(source, PROMPTS)
    else:
        loaded = load_model(source)
        options = {"dtype": "float32", "kv_cache_memory": 2**20, "swap_space": 2**18, "block_size": 4}
        engine = LLMEngine(EngineConfig(model=str(source), **options), loaded=loaded)
        engine.register_schema('<schema name="s">the cat sat on the mat and then it ran off to the</schema>')
        request = engine.add_request('<prompt schema="s"> red door and so</prompt>', GREEDY_16)
        cached = finish(engine)[request]
        assert cached.num_cached_tokens > 10
        plain = LLMEngine(EngineConfig(model=str(source), enable_prefix_caching=False, **options), loaded=loaded)
        request = plain.add_request(cached.prompt_token_ids, GREEDY_16)
        assert finish(plain)[request].outputs[0].token_ids == cached.outputs[0].token_ids


GREEDY_16 = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def finish(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


# ----- tensor parallelism -----


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_shards_sum_to_the_whole_block(family, fmt) -> None:
    """Each rank holds its share of every expert's (and the shared expert's) intermediate dimension and the whole
    router: the ranks route alike, and their blocks' outputs add up to the one-process block's."""
    source = family.source(fmt)
    whole = load_model(source)
    parts = [load_model(source, shard=TensorShard(rank, 2)) for rank in range(2)]
    config = whole.config
    for i, x in sparse_inputs(whole, IDS).items():
        blocks = [part.model.layers[i].mlp for part in parts]
        full = whole.model.layers[i].mlp
        size = config.moe_intermediate_size // 2
        for rank, block in enumerate(blocks):
            assert torch.equal(block.gate.weight, full.gate.weight)
            gate, up = full.experts.gate_up.split(config.moe_intermediate_size, dim=1)
            rows = slice(rank * size, (rank + 1) * size)
            assert torch.equal(block.experts.gate_up, torch.cat((gate[:, rows], up[:, rows]), dim=1))
            assert torch.equal(block.experts.down, full.experts.down[:, :, rows])
        with torch.no_grad():
            torch.testing.assert_close(blocks[0](x) + blocks[1](x), full(x), atol=1e-5, rtol=1e-5)


def test_expert_sizes_that_do_not_divide_are_refused_naming_them(family) -> None:
    config = read_model_config(family.folder)
    check_shardable(config, 4)
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size=4.*moe_intermediate_size"):
        check_shardable(dataclasses.replace(config, moe_intermediate_size=34), 4)
    if config.shared_expert_intermediate_size:
        with pytest.raises(UnsupportedModelError, match="tensor_parallel_size=4.*shared_expert_intermediate_size"):
            check_shardable(dataclasses.replace(config, shared_expert_intermediate_size=34), 4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)  # routed and shared experts; one such run is enough
def test_tensor_parallel_engine_generates_what_one_process_does(family) -> None:
    """Two processes against one: the greedy tokens agree."""
    options = {"dtype": "float32", "kv_cache_memory": "2MiB", "swap_space": "2MiB", "block_size": 4}
    outputs = []
    for size in (1, 2):
        with LLMEngine(EngineConfig(model=str(family.folder), tensor_parallel_size=size, **options)) as engine:
            ids = [engine.add_request(p, GREEDY_16) for p in PROMPTS]
            done = finish(engine)
            outputs.append([done[i].outputs[0].token_ids for i in ids])
            if size == 2:  # rank 0 ran its shard, each sparse block reduced as one
                assert engine.loaded.shard == TensorShard(0, 2)
                assert all(isinstance(layer.mlp, RowParallel) for layer in engine.loaded.model.layers)
                assert engine.tensor_parallel.stats.calls > 0
    assert outputs[1] == outputs[0]


def test_parallelize_wraps_a_sparse_block_whole() -> None:
    from kvserve.parallel.tensor_model import CommStats, parallelize

    class Layer(torch.nn.Module):
        def __init__(self, mlp: torch.nn.Module) -> None:
            super().__init__()
            self.self_attn = torch.nn.Module()
            self.self_attn.o_proj = torch.nn.Identity()
            self.mlp = mlp

    dense = torch.nn.Module()
    dense.down_proj = torch.nn.Identity()
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer(dense), Layer(torch.nn.Identity())])
    parallelize(model, None, CommStats())
    assert isinstance(model.layers[0].mlp.down_proj, RowParallel)
    assert isinstance(model.layers[1].mlp, RowParallel)


def test_bench_counts_the_routed_share_of_the_experts(family) -> None:
    """``bench speed``'s bytes a decode step reads: kvserve's and the GGUF file's count k of E experts per layer,
    so the roofline fractions of a mixture of experts are against what one token really reads."""
    from kvserve.bench import speed

    loaded = load_model(family.folder)
    cfg = loaded.config
    stacked = sum(
        (layer.mlp.experts.gate_up.numel() + layer.mlp.experts.down.numel()) * 4
        for i, layer in enumerate(loaded.model.layers)
        if i in cfg.sparse_layers
    )
    dense = speed.decode_weight_bytes(loaded.model) - stacked * cfg.num_experts_per_tok // cfg.num_experts
    assert dense > 0 and speed.decode_weight_bytes(loaded.model) < dense + stacked
    # F32 file, untied head: the same bytes apart from the embedding row kvserve does not count either.
    assert speed.gguf_decode_bytes(family.gguf) == pytest.approx(speed.decode_weight_bytes(loaded.model), rel=0.02)


def test_mixtral_files_with_one_matrix_per_expert_load_like_stacked_ones(tmp_path) -> None:
    """Mixtral GGUFs written before llama.cpp stacked experts hold ``blk.N.ffn_gate.E.weight`` per expert (and no
    expert size): they load into the same stacked experts and give transformers' logits."""
    folder = write_tiny_model(tmp_path / "hf", FAMILIES["mixtral"])
    legacy = load_model(write_gguf_from_hf(folder, tmp_path / "per-expert.gguf", stack_experts=False))
    stacked = load_model(write_gguf_from_hf(folder, tmp_path / "stacked.gguf"))
    assert legacy.config == stacked.config
    assert torch.equal(legacy.model.layers[1].mlp.experts.gate_up, stacked.model.layers[1].mlp.experts.gate_up)
    assert_logits_match(legacy, load_hf_model(folder), IDS)


def test_more_experts_per_token_than_experts_is_refused_naming_both(family) -> None:
    config = read_model_config(family.folder)
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=99 must be between 1 and num_experts="):
        dataclasses.replace(config, num_experts_per_tok=99)
