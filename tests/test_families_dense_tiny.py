"""The dense model families on tiny random checkpoints, from their Hugging Face folder and from their GGUF file (as
llama.cpp's converter writes it, F32): Llama 3.1 (llama3 rope scaling), Qwen2.5 (q/k/v bias), Qwen3 (q/k norms),
Phi-3 (fused q/k/v and gate/up, LongRoPE, a sliding window) and Mistral with and without a sliding window.

Each is compared with transformers on the same weights: float32 logits at every position of a sequence past the
original context of its rope scaling, and greedy tokens through the paged engine (prefix hits, preemption). Each
also runs one KV technique on the engine path (lossless ones token-identical to the full cache), and the loader's
reading of the config fields is checked from both formats.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.errors import UnsupportedModelError
from kvserve.models import load_model
from kvserve.models.config import SLIDING, ModelConfig
from kvserve.models.gguf_file import open_gguf, rope_freq_factors
from kvserve.models.loader import LoadedModel, read_model_config
from kvserve.models.longrope import uses_long_factors
from tests.composition.conftest import run
from tests.family_checks import (
    all_position_logits,
    assert_engine_greedy_matches,
    assert_logits_match,
    engine_prompts,
    random_ids,
)
from tests.gguf_convert import write_gguf_from_hf
from tests.prompt_cache.reference import prompt_cache_reference
from tests.tiny_models import (  # noqa: F401 - torch_single_thread, skewing_in_tmp: autouse fixtures
    VOCAB_SIZE,
    TinySpec,
    load_hf_model,
    skewing_in_tmp,
    torch_single_thread,
    write_tiny_model,
)

ORIGINAL = 16  # the rope scalings' original context: every prompt (25+ tokens) and logits check (40) runs past it
SEQ = 40
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}  # fmt: skip
# Per-frequency factors unlike each other and far from 1: a wrong set or a wrong order changes the logits.
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.0 + 0.6 * i for i in range(8)]}  # fmt: skip
SPECS = {
    "llama3.1": TinySpec(arch="llama", num_kv_heads=2, rope_scaling=LLAMA3, rope_theta=500_000.0),
    "qwen2.5": TinySpec(arch="qwen2", num_kv_heads=2, rope_theta=1_000_000.0, tie_word_embeddings=True),
    "qwen3": TinySpec(arch="qwen3", num_kv_heads=2, head_dim=32, rope_theta=1_000_000.0),
    "phi3-longrope": TinySpec(arch="phi3", num_kv_heads=2, rope_scaling=LONGROPE,
                              extra={"original_max_position_embeddings": ORIGINAL}),
    "phi3-window": TinySpec(arch="phi3", extra={"sliding_window": 11}),  # Phi-3-mini-4k's odd window (2047), scaled
    "mistral": TinySpec(arch="mistral", num_kv_heads=2),
    "mistral-window": TinySpec(arch="mistral", num_kv_heads=2, extra={"sliding_window": 8}),
}  # fmt: skip
FORMATS = ("hf", "gguf")


@dataclass
class Family:
    folder: Path
    gguf: Path
    hf: object  # the transformers model
    loaded: dict[str, LoadedModel]  # per format

    def source(self, fmt: str) -> Path:
        return self.folder if fmt == "hf" else self.gguf


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """``family(name)``: that family's checkpoint in both formats, loaded once for the whole module."""
    built: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in built:
            root = tmp_path_factory.mktemp(name)
            folder = write_tiny_model(root / "hf", SPECS[name])
            path = write_gguf_from_hf(folder, root / "model.gguf")
            loaded = {"hf": load_model(folder, torch.float32), "gguf": load_model(path, torch.float32)}
            built[name] = Family(folder, path, load_hf_model(folder), loaded)
        return built[name]

    return get


def windowed(name: str) -> bool:
    return "sliding_window" in SPECS[name].extra


# ----- exactness against transformers, both formats -----


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_transformers_at_every_position(family, name, fmt):
    fam = family(name)
    assert_logits_match(fam.loaded[fmt], fam.hf, random_ids(SEQ, VOCAB_SIZE, seed=1))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(SPECS))
def test_engine_greedy_matches_transformers(family, name, fmt):
    """Prefix hits and preemption through the paged engine; a sliding-window model once with every layer's KV kept
    (so that the small memory preempts) and once through its window groups."""
    fam = family(name)
    if windowed(name):
        assert_engine_greedy_matches(fam.source(fmt), fam.hf, kv_window_groups=False)
        assert_engine_greedy_matches(fam.source(fmt), fam.hf, preempt=False)
    else:
        assert_engine_greedy_matches(fam.source(fmt), fam.hf)


# ----- one KV technique per family on the engine path -----

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def greedy_tokens(source: Path, summary: str = "", **options: object) -> list[list[int]]:
    """Greedy tokens of the four engine prompts; ``summary``: a phrase the engine's KV summary must hold (the
    technique is in force, not ignored)."""
    # Room for all four sequences (no preemption to blur what is compared), and no more: pools are allocated.
    options = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 16, "kv_cache_memory": "512KiB",
               "swap_space": "512KiB", **options}  # fmt: skip
    with LLM(str(source), **options) as llm:
        assert summary in llm.engine.kv_summary
        return [o.outputs[0].token_ids for o in llm.generate(engine_prompts(VOCAB_SIZE), PARAMS, use_tqdm=False)]


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("llama3.1", {"kv_policy": "snapkv", "kv_budget": 1.0}),
        ("qwen2.5", {"kv_offload": "host"}),
        ("phi3-window", {"kv_policy": "h2o", "kv_budget": 1.0}),
        ("mistral", {"kv_offload": "disk"}),
        ("mistral-window", {"kv_policy": "pyramid", "kv_budget": 1.0}),
    ],
)
def test_lossless_technique_is_token_identical_to_the_full_cache(family, name, options, tmp_path):
    if options.get("kv_offload") == "disk":
        options = {**options, "kv_offload_path": str(tmp_path)}
    source = family(name).gguf  # the engine path from the GGUF file (the folder runs in the greedy checks)
    summary = "offloaded" if "kv_offload" in options else f"policy {options['kv_policy']} (budget 1)"
    assert greedy_tokens(source, summary, **options) == greedy_tokens(source)


@pytest.mark.slow
def test_phi3_tensor_parallel_splits_the_fused_projections(family):
    """Two ranks, each with its rows of the fused q/k/v and gate/up (and the heads' LongRoPE), give one process's
    tokens: a wrong row split would compute another model."""
    fam = family("phi3-longrope")
    for source in (fam.folder, fam.gguf):
        assert greedy_tokens(source, tensor_parallel_size=2) == greedy_tokens(source)


def test_qwen3_prompt_cache(family):
    """A one-module schema reuses the module's KV and gives the uncached tokens; a two-module prompt's next token
    equals transformers' under Prompt Cache's mask (modules encoded apart, at their positions)."""
    fam = family("qwen3")
    loaded = fam.loaded["hf"]
    options = {"dtype": "float32", "kv_cache_memory": 2**20, "swap_space": 2**18, "block_size": 4}
    engine = LLMEngine(EngineConfig(model=str(fam.folder), **options), loaded=loaded)
    engine.register_schema('<schema name="s">the cat sat on the mat and then it ran off to the</schema>')
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (cached,) = run(engine, ['<prompt schema="s"> red door and so</prompt>'], params)
    assert cached.num_cached_tokens > 0
    plain_engine = LLMEngine(EngineConfig(model=str(fam.folder), enable_prefix_caching=False, **options), loaded=loaded)
    (plain,) = run(plain_engine, [cached.prompt_token_ids], params)
    assert cached.outputs[0].token_ids == plain.outputs[0].token_ids

    from tests.composition.conftest import PML, SCHEMA

    engine.register_schema(SCHEMA)
    reference = prompt_cache_reference(engine, fam.hf, PML)
    (out,) = run(engine, [PML], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    assert out.outputs[0].token_ids[0] == int(reference.argmax())
    for token, logprob in out.outputs[0].logprobs[0].items():
        assert logprob == pytest.approx(float(reference[token]), abs=1e-4)


# ----- what the loader reads -----


def test_llama31_reads_llama3_scaling_and_gguf_rope_freqs(family):
    fam = family("llama3.1")
    scaling = fam.loaded["hf"].config.rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings) == ("llama3", 8.0, ORIGINAL)
    assert fam.loaded["hf"].config.rope_theta == 500_000.0
    # llama.cpp stores the scaling as per-frequency divisors: the file's config carries none.
    assert fam.loaded["gguf"].config.rope_scaling is None
    factors = rope_freq_factors(open_gguf(fam.gguf))
    plain = 1 / 500_000.0 ** (torch.arange(0, 16, 2) / 16)
    assert torch.allclose(factors, plain / fam.hf.model.rotary_emb.inv_freq, rtol=1e-5)  # transformers' divisors
    assert factors.max() == 8.0  # the low frequencies divided by the factor


@pytest.mark.parametrize("fmt", FORMATS)
def test_qwen_reads_bias_and_head_dim(family, fmt):
    qwen25, qwen3 = family("qwen2.5").loaded[fmt].config, family("qwen3").loaded[fmt].config
    assert (qwen25.architecture, qwen25.attention_bias, qwen25.o_proj_bias) == ("qwen2", True, False)
    assert qwen25.tie_word_embeddings and qwen25.rope_theta == 1_000_000.0
    assert (qwen3.architecture, qwen3.attention_bias, qwen3.head_dim, qwen3.q_size) == ("qwen3", False, 32, 128)


@pytest.mark.parametrize("fmt", FORMATS)
def test_phi3_reads_longrope_and_window(family, fmt):
    longrope = family("phi3-longrope").loaded[fmt].config
    scaling = longrope.rope_scaling
    assert longrope.architecture == "phi3" and scaling.rope_type == "longrope"
    assert scaling.original_max_position_embeddings == ORIGINAL and longrope.max_position_embeddings == 256
    assert np.allclose(scaling.short_factor, LONGROPE["short_factor"])
    assert np.allclose(scaling.long_factor, LONGROPE["long_factor"])
    # transformers' default: sqrt(1 + ln(256 / 16) / ln(16)) = sqrt(2); llama.cpp stores it as attn_factor.
    assert scaling.attention_factor == pytest.approx(2**0.5)
    assert uses_long_factors(longrope)
    assert longrope.layer_windows == (None, None)  # the GGUF file says sliding_window 0
    window = family("phi3-window").loaded[fmt].config
    assert window.rope_scaling is None and window.layer_windows == (11, 11)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mistral_reads_the_window(family, fmt):
    assert family("mistral").loaded[fmt].config.layer_windows == (None, None)
    assert family("mistral-window").loaded[fmt].config.layer_windows == (8, 8)


def test_hf_config_longrope_variants():
    """Phi-3's first name for LongRoPE ("su"), a given attention_factor, the top-level original context winning over
    rope_scaling's (as in transformers), and a window wider than the context (Phi-3.5-mini's) read as none."""
    base = {"model_type": "phi3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 131072}  # fmt: skip
    rope = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 8}
    cfg = ModelConfig.from_hf_config({**base, "rope_scaling": rope, "original_max_position_embeddings": 4096})
    assert cfg.rope_scaling.rope_type == "longrope" and cfg.rope_scaling.original_max_position_embeddings == 4096
    assert cfg.rope_scaling.attention_factor == pytest.approx((1 + np.log(32) / np.log(4096)) ** 0.5)
    given = ModelConfig.from_hf_config({**base, "rope_scaling": {**rope, "attention_factor": 1.25}})
    assert given.rope_scaling.attention_factor == 1.25
    assert ModelConfig.from_hf_config({**base, "sliding_window": 262144}).layer_windows == (None, None)
    assert ModelConfig.from_hf_config({**base, "sliding_window": 2047}).layer_types == (SLIDING, SLIDING)


# ----- the scalings change what is computed, and LongRoPE's factor sets -----


def _variant(fam: Family, tmp_path: Path, **changes: object) -> tuple[LoadedModel, object]:
    """The family's weights under an edited config.json (a value None removes the key): kvserve's and transformers'."""
    folder = tmp_path / "variant"
    shutil.copytree(fam.folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        cfg.pop(key) if value is None else cfg.__setitem__(key, value)
    (folder / "config.json").write_text(json.dumps(cfg))
    return load_model(folder, torch.float32), load_hf_model(folder)


def test_llama3_scaling_changes_the_logits(family, tmp_path):
    fam = family("llama3.1")
    ids = random_ids(SEQ, VOCAB_SIZE, seed=1)
    plain, _ = _variant(fam, tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
    assert (all_position_logits(plain, ids) - all_position_logits(fam.loaded["hf"], ids)).abs().max() > 0.1


def test_longrope_sets_change_the_logits_and_short_factors_match_within_the_original_context(family, tmp_path):
    """Without scaling the logits differ (so the parity above checks the scaling); a Phi-3 whose context is its
    original one runs the short factors and no cos/sin scale, and matches transformers there too."""
    fam = family("phi3-longrope")
    ids = random_ids(SEQ, VOCAB_SIZE, seed=1)
    long = all_position_logits(fam.loaded["hf"], ids)
    plain, _ = _variant(fam, tmp_path / "plain", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert (all_position_logits(plain, ids) - long).abs().max() > 0.1
    short, short_hf = _variant(fam, tmp_path / "short", original_max_position_embeddings=256)
    assert not uses_long_factors(short.config) and short.config.rope_scaling.attention_factor == 1.0
    assert_logits_match(short, short_hf, ids)
    assert (all_position_logits(short, ids) - long).abs().max() > 0.1
    assert (all_position_logits(short, ids) - all_position_logits(plain, ids)).abs().max() > 0.1


# ----- refusals -----


def test_unknown_architecture_is_refused_by_name(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    cfg = {"model_type": "gpt_neox", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="'gpt_neox'"):
        read_model_config(folder)
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "falcon")
    for add, value in (("add_context_length", 256), ("add_embedding_length", 64), ("add_block_count", 2),
                       ("add_feed_forward_length", 128), ("add_head_count", 4), ("add_vocab_size", 300)):  # fmt: skip
        getattr(writer, add)(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'falcon'"):
        read_model_config(tmp_path / "m.gguf")


def test_partial_rotary_factor_is_refused_by_name(family, tmp_path):
    """Phi-4-mini rotates three quarters of each head: refused from config.json and from GGUF's rope dimensions."""
    folder = tmp_path / "hf"
    shutil.copytree(family("phi3-window").folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.75
    cfg["partial_rotary_factor"] = 0.75
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.75"):
        read_model_config(folder)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.75"):
        read_model_config(write_gguf_from_hf(folder, tmp_path / "m.gguf"))
