"""GGUF loading: files written with ggml's own ``gguf.GGUFWriter`` from tiny Hugging Face checkpoints.

The writer below mirrors llama.cpp's ``convert_hf_to_gguf.py`` for the Llama architecture: tensor
names, metadata keys, the Q/K row permutation and the GPT-2 style tokenizer fields. Loading the
GGUF and loading the Hugging Face folder of the same weights must give the same model.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from kvserve.attention import AttentionMetadata, ContiguousKVCache
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.models import load_model
from kvserve.text.tokenizer import Tokenizer
from tests.gguf_convert import add_tiny_tokenizer, permute
from tests.gguf_convert import llama3_rope_factors as llama3_rope_factors_of
from tests.tiny_models import (  # noqa: F401 - torch_single_thread is an autouse fixture
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    VOCAB_SIZE,
    TinySpec,
    build_hf_model,
    tiny_vocab,
    torch_single_thread,
    write_tiny_model,
)

Q = GGMLQuantizationType
SEQ_LEN = 40


def llama3_rope_factors(spec: TinySpec) -> np.ndarray:
    """llama.cpp's ``rope_freqs.weight`` for ``spec``'s llama3 scaling."""
    rope = {**spec.rope_scaling, "rope_theta": spec.rope_theta}
    cfg = {"rope_parameters": rope, "hidden_size": spec.hidden_size, "num_attention_heads": spec.num_heads}
    return llama3_rope_factors_of(cfg | {"head_dim": spec.head_dim})["rope_freqs.weight"]


def gguf_tensors(state: dict[str, torch.Tensor], spec: TinySpec, permute_qk: bool = True) -> dict[str, np.ndarray]:
    """llama.cpp tensor name -> float32 (out, in) array, Q/K permuted like the converter."""
    out = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    if not spec.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(spec.num_layers):
        for hf, ours in names.items():
            out[f"blk.{i}.{ours}"] = state[f"model.layers.{i}.{hf}"]
    arrays = {name: t.detach().float().numpy().copy() for name, t in out.items()}
    if permute_qk:
        for i in range(spec.num_layers):
            arrays[f"blk.{i}.attn_q.weight"] = permute(arrays[f"blk.{i}.attn_q.weight"], spec.num_heads, spec.num_heads)
            arrays[f"blk.{i}.attn_k.weight"] = permute(
                arrays[f"blk.{i}.attn_k.weight"], spec.num_heads, spec.num_kv_heads
            )
    return arrays


def write_gguf(
    path: Path,
    spec: TinySpec,
    state: dict[str, torch.Tensor],
    qtype: GGMLQuantizationType = Q.F32,
    arch: str = "llama",
    tokenizer: bool = True,
    permute_qk: bool = True,
    tensor_types: dict[str, GGMLQuantizationType] | None = None,
) -> dict[str, tuple[GGMLQuantizationType, np.ndarray]]:
    """Write a GGUF of ``state``; 2-D weights stored as ``qtype`` (norms stay F32).

    Returns name -> (stored type, stored data) for the tensors written.
    """
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    writer = GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(VOCAB_SIZE)
    if spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope_scaling["factor"])
    if tokenizer:
        add_tiny_tokenizer(writer, VOCAB_SIZE)

    stored: dict[str, tuple[GGMLQuantizationType, np.ndarray]] = {}
    arrays = gguf_tensors(state, spec, permute_qk)
    if spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "llama3":
        arrays["rope_freqs.weight"] = llama3_rope_factors(spec)
    for name, array in arrays.items():
        kind = (tensor_types or {}).get(name, qtype if array.ndim == 2 else Q.F32)
        data = array if kind == Q.F32 else quantize(array, kind)
        if kind in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=kind)
        stored[name] = (kind, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


# ----- helpers -----


@torch.inference_mode()
def logits_of(loaded, ids: torch.Tensor) -> torch.Tensor:
    cfg = loaded.config
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32)
    metadata = AttentionMetadata(seq_ids=(0,), query_lens=(len(ids),), context_lens=(0,))
    return loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids)), cache, metadata))


def random_ids(n: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(99))


def checkpoint(tmp: Path, spec: TinySpec) -> tuple[Path, dict[str, torch.Tensor]]:
    """HF folder + its state dict (the same weights go into the GGUF)."""
    model = build_hf_model(spec)
    folder = write_tiny_model(tmp / "hf", spec)
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


GQA = TinySpec(num_heads=4, num_kv_heads=2)
F32_SPECS = {
    "gqa_4_2_untied": GQA,
    "mha_4_4_tied": TinySpec(num_heads=4, num_kv_heads=4, tie_word_embeddings=True, seed=3),
    "odd_5_1_hd16": TinySpec(num_heads=5, num_kv_heads=1, hidden_size=80, seed=4),
    "explicit_head_dim_8_2_hd16": TinySpec(num_heads=8, num_kv_heads=2, head_dim=16, seed=5),
    "llama3_rope_freqs": TinySpec(
        num_heads=4,
        num_kv_heads=2,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "linear_rope": TinySpec(num_heads=4, num_kv_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.fixture(scope="module")
def gqa_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], Path]:
    """HF folder, state dict and the F32 GGUF of the GQA tiny model, shared by several tests."""
    tmp = tmp_path_factory.mktemp("gqa")
    folder, state = checkpoint(tmp, GQA)
    path = tmp / "tiny-f32.gguf"
    write_gguf(path, GQA, state)
    return folder, state, path


# ----- (a) F32 files equal the Hugging Face folder -----


@pytest.mark.parametrize("name", list(F32_SPECS))
def test_f32_gguf_equals_hf_folder(name, tmp_path) -> None:
    spec = F32_SPECS[name]
    folder, state = checkpoint(tmp_path, spec)
    path = tmp_path / "tiny-f32.gguf"
    write_gguf(path, spec, state)
    from_gguf, from_hf = load_model(path), load_model(folder)
    ours, theirs = from_gguf.config, from_hf.config
    # GGUF stores the epsilon as float32; the rest of the architecture must be read identically.
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps, rope_scaling=None) == dataclasses.replace(
        theirs, rope_scaling=None
    )
    if spec.rope_scaling is None:
        assert ours.rope_scaling is theirs.rope_scaling is None
    elif spec.rope_scaling["rope_type"] == "llama3":
        # llama.cpp stores llama3 scaling as precomputed factors (rope_freqs.weight), not rope.scaling.* keys.
        assert ours.rope_scaling is None
        assert theirs.rope_scaling.rope_type == "llama3"
    else:
        assert (ours.rope_scaling.rope_type, ours.rope_scaling.factor) == ("linear", 2.0)
        assert (theirs.rope_scaling.rope_type, theirs.rope_scaling.factor) == ("linear", 2.0)
    ids = random_ids()
    ours, ref = logits_of(from_gguf, ids), logits_of(from_hf, ids)
    assert ref.std() > 1.0
    assert (ours - ref).abs().max().item() <= 1e-5


def test_unpermuted_qk_would_differ(gqa_checkpoint, tmp_path) -> None:
    """Guard for the test above: a GGUF written without llama.cpp's Q/K permutation loads differently."""
    folder, state, _ = gqa_checkpoint
    path = tmp_path / "tiny-not-permuted.gguf"
    write_gguf(path, GQA, state, permute_qk=False)
    ids = random_ids()
    assert (logits_of(load_model(path), ids) - logits_of(load_model(folder), ids)).abs().max().item() > 1e-2


def test_gguf_tokenizer_equals_tokenizer_json(gqa_checkpoint) -> None:
    folder, _, path = gqa_checkpoint
    from_gguf, from_hf = load_model(path).tokenizer, load_model(folder).tokenizer
    assert from_gguf.bos_token_id == from_hf.bos_token_id == BOS_ID
    assert from_gguf.eos_token_ids == from_hf.eos_token_ids == (EOS_ID,)
    assert from_gguf.vocab_size == from_hf.vocab_size == VOCAB_SIZE
    texts = ["the cat sat on the mat", "Hello there!  two  spaces\nnew line", "héllo 你好 🎉 naïve", "a </s> b"]
    for text in texts:
        ids = from_hf.encode(text)
        assert ids[0] == BOS_ID
        assert from_gguf.encode(text) == ids, text
        assert from_gguf.decode(ids, skip_special_tokens=False) == from_hf.decode(ids, skip_special_tokens=False)
        if "</s>" in text:
            assert EOS_ID in ids  # the special token is matched whole, not spelled out in bytes
        else:
            assert from_gguf.decode(ids) == from_hf.decode(ids) == text
    messages = [{"role": "user", "content": "hi"}]
    assert from_gguf.apply_chat_template(messages) == from_hf.apply_chat_template(messages)


# ----- (b) quantised files -----

# Logits of a quantised file against the F32 file of the same tiny weights (logit std ~3.0, |max| ~12;
# two unrelated models differ by ~3.4 on average). Measured (max |diff|, mean |diff|, top-1 agreement):
#   F16 0.007 / 0.0012 / 1.00    BF16 0.048 / 0.009 / 1.00    Q8_0 0.21 / 0.030 / 0.97
#   Q5_0 1.34 / 0.24 / 0.75      Q5_1 0.99 / 0.20 / 0.82      Q4_0 2.78 / 0.47 / 0.62   Q4_1 2.30 / 0.43 / 0.70
# The weights are scaled for peaky attention, which amplifies quantisation noise; the limits below
# leave about 2x headroom on the measured values.
QUANT_TOLERANCE = {  # type: (max |diff|, mean |diff|, minimum top-1 agreement)
    Q.F16: (0.02, 0.003, 0.95),
    Q.BF16: (0.1, 0.02, 0.95),
    Q.Q8_0: (0.4, 0.06, 0.9),
    Q.Q5_0: (2.5, 0.45, 0.5),
    Q.Q5_1: (2.5, 0.45, 0.5),
    Q.Q4_0: (5.0, 0.9, 0.4),
    Q.Q4_1: (5.0, 0.9, 0.4),
}


def loaded_weights(loaded, spec: TinySpec) -> dict[str, torch.Tensor]:
    """The loaded model's weights under llama.cpp names, Q/K re-permuted into llama.cpp's row order."""
    model, cfg = loaded.model, loaded.config
    out = {"token_embd.weight": model.embed_tokens.weight, "output_norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        q, k, v = layer.self_attn.qkv_proj.weight.split((cfg.q_size, cfg.kv_size, cfg.kv_size))
        gate, up = layer.mlp.gate_up_proj.weight.split(cfg.intermediate_size)
        out |= {
            f"blk.{i}.attn_norm.weight": layer.input_layernorm.weight,
            f"blk.{i}.attn_q.weight": torch.from_numpy(permute(q.numpy(), spec.num_heads, spec.num_heads)),
            f"blk.{i}.attn_k.weight": torch.from_numpy(permute(k.numpy(), spec.num_heads, spec.num_kv_heads)),
            f"blk.{i}.attn_v.weight": v,
            f"blk.{i}.attn_output.weight": layer.self_attn.o_proj.weight,
            f"blk.{i}.ffn_norm.weight": layer.post_attention_layernorm.weight,
            f"blk.{i}.ffn_gate.weight": gate,
            f"blk.{i}.ffn_up.weight": up,
            f"blk.{i}.ffn_down.weight": layer.mlp.down_proj.weight,
        }
    return out


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_quantised_gguf_loads_dequantised_weights(qtype, gqa_checkpoint, tmp_path) -> None:
    _, state, f32_path = gqa_checkpoint
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    stored = write_gguf(path, GQA, state, qtype=qtype)
    assert {t.name: t.tensor_type for t in GGUFReader(path).tensors}["blk.0.attn_q.weight"] == qtype
    loaded = load_model(path, weights="dequant")  # the dequantised values themselves (native: test_quant_linear)
    weights = loaded_weights(loaded, GQA)
    assert set(weights) == set(stored)
    for name, (kind, data) in stored.items():
        expected = torch.from_numpy(np.asarray(dequantize(data, kind), dtype=np.float32))
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], expected), name
    ids = random_ids()
    reference = logits_of(load_model(f32_path), ids)
    logits = logits_of(loaded, ids)
    max_limit, mean_limit, min_agree = QUANT_TOLERANCE[qtype]
    diff = (logits - reference).abs()
    assert 0 < diff.max().item() <= max_limit, f"{qtype.name}: max |logit diff| {diff.max().item():.4f}"
    assert diff.mean().item() <= mean_limit, f"{qtype.name}: mean |logit diff| {diff.mean().item():.4f}"
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree >= min_agree, f"{qtype.name}: top-1 agreement {agree:.2f}"


# ----- (c) errors -----


def test_nonexistent_path(tmp_path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        load_model(missing)
    assert str(missing) in str(info.value)


def test_not_a_gguf_file(tmp_path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_model(path)


def test_truncated_gguf(gqa_checkpoint, tmp_path) -> None:
    _, _, source = gqa_checkpoint
    path = tmp_path / "truncated.gguf"
    data = source.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(path)


def test_unsupported_architecture(gqa_checkpoint, tmp_path) -> None:
    _, state, _ = gqa_checkpoint
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, GQA, state, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        load_model(path)


@pytest.mark.parametrize("kind", [Q.TQ1_0, Q.MXFP4], ids=lambda q: q.name)
def test_unsupported_tensor_type(kind, tmp_path) -> None:
    # intermediate 256 so that ffn_down rows (256 values) fit TQ1_0's 256-value blocks.
    spec = TinySpec(num_heads=4, num_kv_heads=2, intermediate_size=256)
    _, state = checkpoint(tmp_path, spec)
    path = tmp_path / f"tiny-{kind.name}.gguf"
    write_gguf(path, spec, state, tensor_types={"blk.1.ffn_down.weight": kind})
    with pytest.raises(UnsupportedModelError, match=kind.name) as info:
        load_model(path)
    assert "blk.1.ffn_down.weight" in str(info.value)


def test_gguf_without_tokenizer(gqa_checkpoint, tmp_path) -> None:
    _, state, _ = gqa_checkpoint
    path = tmp_path / "no-tokenizer.gguf"
    write_gguf(path, GQA, state, tokenizer=False)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(path)


def _copy_folder(folder: Path, dest: Path, drop: str) -> Path:
    shutil.copytree(folder, dest)
    for file in dest.glob(drop):
        file.unlink()
    return dest


def test_hf_folder_without_tokenizer_json(gqa_checkpoint, tmp_path) -> None:
    folder = _copy_folder(gqa_checkpoint[0], tmp_path / "m", "tokenizer.json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_model(folder)


def test_hf_folder_without_config(gqa_checkpoint, tmp_path) -> None:
    folder = _copy_folder(gqa_checkpoint[0], tmp_path / "m", "config.json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(folder)


def test_hf_folder_without_safetensors(gqa_checkpoint, tmp_path) -> None:
    folder = _copy_folder(gqa_checkpoint[0], tmp_path / "m", "*.safetensors")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(folder)


def test_tokenizer_from_gguf_reports_missing_tokenizer(gqa_checkpoint, tmp_path) -> None:
    """Tokenizer.from_gguf on its own: the message names the missing key."""
    _, state, _ = gqa_checkpoint
    path = tmp_path / "no-tokenizer.gguf"
    write_gguf(path, GQA, state, tokenizer=False)
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf(GGUFReader(path))


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json"])
def test_hf_folder_with_corrupt_tokenizer_files(file, gqa_checkpoint, tmp_path) -> None:
    folder = _copy_folder(gqa_checkpoint[0], tmp_path / "m", file)
    (folder / file).write_text('{"truncated": ')
    with pytest.raises(ModelLoadError, match=file):
        load_model(folder)


def test_checkpoint_tensors_the_model_does_not_use_are_an_error(gqa_checkpoint, tmp_path) -> None:
    """A tensor we would silently drop (here an MLP bias) means we would compute a different model."""
    from safetensors.torch import load_file, save_file

    folder = _copy_folder(gqa_checkpoint[0], tmp_path / "m", drop="no-such-file")
    weights = next(folder.glob("*.safetensors"))
    state = load_file(weights)
    state["model.layers.0.mlp.up_proj.bias"] = torch.zeros(state["model.layers.0.mlp.up_proj.weight"].shape[0])
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp\.up_proj\.bias"):
        load_model(folder)
