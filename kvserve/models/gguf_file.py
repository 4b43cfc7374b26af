"""A GGUF file (llama.cpp's format) as kvserve reads it: config, tensors by Hugging Face name, tokenizer fields."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.models.config import FULL, SLIDING, ModelConfig, RopeScaling
from kvserve.models.gguf_linear import NATIVE_TYPES, GGUFWeight
from kvserve.models.gguf_reader import GGUFFile, torch_view
from kvserve.models.moe import checkpoint_names
from kvserve.models.quant_linear import INT4_TYPES, Int4Weight, Int8Weight

# Tensor types we read; every one is dequantised by ggml's reference code in the gguf package.
SUPPORTED_TENSOR_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32",
        "F16",
        "BF16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ4_NL",
        "IQ4_XS",
    )
)

# llama.cpp tensor names -> Hugging Face names (per layer: "blk.{i}." -> "model.layers.{i}.").
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 2's and 3's names where they differ: its "ffn_norm" is the norm before the MLP, and it has norms after
# attention and MLP (and Gemma 3 on q and k per head).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Qwen3's q and k norms per head.
_QWEN3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Phi-3 stores q/k/v as one tensor, and gate and up as one "ffn_up" (gate rows first).
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# Rotary tensors, read into the config or the rotary table rather than as weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _expert_layer_names(arch: str) -> dict[str, str]:
    """A sparse layer's tensors: the router, the stacked experts, and Qwen2-MoE's shared expert and its gate."""
    prefix, (gate, up, down) = checkpoint_names(arch)
    names = {"ffn_gate_inp.weight": prefix + "gate.weight"}
    for ours, theirs in (("gate", gate), ("up", up), ("down", down)):
        names[f"ffn_{ours}_exps.weight"] = f"{prefix}experts.{theirs}.weight"
        names[f"ffn_{ours}_shexp.weight"] = f"{prefix}shared_expert.{ours}_proj.weight"
    return {**names, "ffn_gate_inp_shexp.weight": prefix + "shared_expert_gate.weight"}


_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": _GEMMA_LAYER_NAMES,
    "qwen3": _QWEN3_LAYER_NAMES,
    "phi3": _PHI3_LAYER_NAMES,
    "qwen3_moe": {**_QWEN3_LAYER_NAMES, **_expert_layer_names("qwen3_moe")},
    "qwen2_moe": {**_LAYER_NAMES, **_expert_layer_names("qwen2_moe")},
    "mixtral": {**_LAYER_NAMES, **_expert_layer_names("mixtral")},
}
# One expert's matrix in Mixtral files written before llama.cpp stacked experts (2024-03): ``ffn_gate.E.weight``.
_PER_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
# llama.cpp's names of the mixtures of experts (Mixtral is a "llama" file with experts).
_GGUF_MOE_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral"}
# llama.cpp builds Gemma 3 with every sixth layer global and a RoPE base of 10,000 on the others
# (llama-model.cpp); the file does not store either.
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA2_WINDOW = 4096  # llama.cpp's default for a gemma2 file without attention.sliding_window
# llama.cpp's converter permutes Q/K rows of these architectures for its interleaved rotary layout.
_PERMUTED_QK_ARCHITECTURES = ("llama", "mistral", "mixtral")


def open_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensor views (a ModelLoadError naming the problem for a damaged file)."""
    return GGUFFile(path)


def field(reader: GGUFFile, key: str, default: object = None) -> object:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader: GGUFFile) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch is None:
        raise ModelLoadError("GGUF file has no general.architecture")

    def meta(key: str, default: object = None) -> object:
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF file lacks {arch}.{key}")
        return value

    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None and f"{arch}.vocab_size" not in reader.fields:
        raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    vocab_size = meta("vocab_size", len(tokens.value) if tokens is not None else None)
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    rotary = int(field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary < head_dim:
        raise UnsupportedModelError(
            f"rope.dimension_count={rotary} of head_dim={head_dim}: partial_rotary_factor={rotary / head_dim:g} "
            "(rotary embedding on part of each head) is not supported"
        )
    scaling_type = field(reader, f"{arch}.rope.scaling.type")
    scaling = None
    if "rope_factors_long.weight" in tensor_names:
        scaling = _longrope_scaling(reader, meta)
    elif scaling_type not in (None, "none") and "rope_freqs.weight" not in tensor_names:
        scaling = RopeScaling(
            rope_type=str(scaling_type),
            factor=float(meta("rope.scaling.factor", 1.0)),
            original_max_position_embeddings=int(meta("rope.scaling.original_context_length", 8192)),
        )
    experts = _expert_fields(reader, str(arch), int(meta("block_count")), tensor_names)
    return ModelConfig(
        **_window_fields(reader, str(arch), int(meta("block_count")), hidden, num_heads),
        **experts,
        architecture=_GGUF_MOE_ARCHITECTURES[str(arch)] if experts else str(arch),
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta("context_length")),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
    )


def _longrope_scaling(reader: GGUFFile, meta: Callable[..., object]) -> RopeScaling:
    """Phi-3's LongRoPE as llama.cpp's converter stores it: both factor sets as tensors, the cos/sin scale and the
    pretraining context as metadata (a missing attn_factor is 1, as llama.cpp reads it)."""
    factors = {t.name: tuple(_dequantize(t).tolist()) for t in reader.tensors if t.name in _ROPE_TENSORS}
    return RopeScaling(
        rope_type="longrope",
        original_max_position_embeddings=int(meta("rope.scaling.original_context_length")),
        short_factor=factors["rope_factors_short.weight"],
        long_factor=factors["rope_factors_long.weight"],
        attention_factor=float(meta("rope.scaling.attn_factor", 1.0)),
    )


def _expert_fields(reader: GGUFFile, arch: str, num_layers: int, tensor_names: set[str]) -> dict:
    """Mixture-of-experts fields, as llama.cpp reads them: a layer is sparse where it has a router
    (``ffn_gate_inp``; llama.cpp's qwen3moe and qwen2moe graphs expect one in every layer, Mixtral's too, and a
    layer without one is read as a dense MLP); the top-k probabilities are renormalised for qwen3moe and
    Mixtral, never for qwen2moe (llama.cpp's graphs fix this per architecture, whatever ``norm_topk_prob`` the
    model was trained with). Expert sizes come from the metadata, or the expert tensors' shapes without it."""
    count = int(field(reader, f"{arch}.expert_count", 0) or 0)
    if count == 0:
        return {}
    if arch not in _GGUF_MOE_ARCHITECTURES:
        raise UnsupportedModelError(f"mixtures of experts in {arch!r} GGUF files are not supported")
    sparse = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names)
    used = field(reader, f"{arch}.expert_used_count")
    if used is None:
        raise ModelLoadError(f"GGUF file lacks {arch}.expert_used_count")
    stacked = f"blk.{sparse[0]}.ffn_gate_exps.weight"  # else one matrix per expert (Mixtral files before 2024-03)
    size = field(reader, f"{arch}.expert_feed_forward_length") or _rows(
        reader, stacked if stacked in tensor_names else f"blk.{sparse[0]}.ffn_gate.0.weight"
    )
    shared = 0
    if arch == "qwen2moe":
        shared = field(reader, f"{arch}.expert_shared_feed_forward_length") or _rows(
            reader, f"blk.{sparse[0]}.ffn_gate_shexp.weight"
        )
    return {
        "num_experts": count,
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(size),
        "norm_topk_prob": arch != "qwen2moe",
        "sparse_layers": sparse,
        "shared_expert_intermediate_size": int(shared),
    }


def _rows(reader: GGUFFile, name: str) -> int:
    """The output rows of a (stacked) matrix: ggml lists its dimensions inputs first."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        raise ModelLoadError(f"GGUF file lacks tensor {name}")
    return int(tensor.shape[1])


def _window_fields(reader: GGUFFile, arch: str, num_layers: int, hidden: int, num_heads: int) -> dict:
    """Sliding-window fields: Gemma 3's pattern (every sixth layer global), or a window over every layer."""
    window = field(reader, f"{arch}.attention.sliding_window")
    if arch == "gemma2":
        return _gemma2_fields(reader, num_layers, hidden, num_heads, window)
    if arch != "gemma3":
        # llama.cpp's converter writes 0 for none (Phi-3 files); a window over the whole context is none too.
        if not window or window >= int(field(reader, f"{arch}.context_length", window + 1)):
            return {}
        return {"sliding_window": int(window), "layer_types": (SLIDING,) * num_layers}
    # llama.cpp scales Gemma 3 27B's queries by its hidden size per head, every other size by head_dim.
    head_dim = int(field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    scalar = hidden // num_heads if num_layers == 62 else head_dim
    fields = {"rope_local_theta": _GEMMA3_LOCAL_ROPE_BASE, "query_pre_attn_scalar": float(scalar)}
    if window is None:
        return fields
    types = tuple(FULL if (i + 1) % _GEMMA3_SWA_PATTERN == 0 else SLIDING for i in range(num_layers))
    return {**fields, "sliding_window": int(window), "layer_types": types}


def _gemma2_fields(reader: GGUFFile, num_layers: int, hidden: int, num_heads: int, window: object) -> dict:
    """Gemma 2 as llama.cpp builds it: even layers sliding (window 4,096 unless stored), both soft caps (50 and 30
    unless stored), queries scaled by head_dim, or for the 27B (46 layers) by its hidden size per head."""
    head_dim = int(field(reader, "gemma2.attention.key_length", hidden // num_heads))
    return {
        "sliding_window": int(window if window is not None else _GEMMA2_WINDOW),
        "layer_types": tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers)),
        "query_pre_attn_scalar": float(hidden // num_heads if num_layers == 46 else head_dim),
        "attn_logit_softcapping": float(field(reader, "gemma2.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(field(reader, "gemma2.final_logit_softcapping", 30.0)),
    }


def tensor_sources(reader: GGUFFile, config: ModelConfig) -> dict[str, Callable[[], torch.Tensor]]:
    """Hugging Face name -> a function that dequantises that tensor to float32 (out, in)."""
    sources: dict[str, Callable[[], torch.Tensor]] = {}
    for tensor in reader.tensors:
        if tensor.name in _ROPE_TENSORS:  # read by rope_freq_factors() and read_config()
            continue
        name = _hf_name(tensor.name, config.architecture)
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise UnsupportedModelError(
                f"tensor {tensor.name} uses quantisation type {tensor.tensor_type.name}, which kvserve does not "
                f"read (supported: {sorted(t.name for t in SUPPORTED_TENSOR_TYPES)})"
            )
        sources[name] = _loader(tensor, _permuted_heads(name, config))
    return sources


def _permuted_heads(hf_name: str, config: ModelConfig) -> int | None:
    """The head count whose Q/K row permutation llama.cpp applied to this tensor, or None."""
    if config.architecture not in _PERMUTED_QK_ARCHITECTURES:
        return None
    return {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(hf_name.split(".")[-2])


def int4_sources(reader: GGUFFile, config: ModelConfig) -> dict[str, Callable[[], Int4Weight]]:
    """Hugging Face name -> a function giving the tensor's 4-bit codes and group constants, for the
    Q4_0 / Q4_1 tensors (no dequantisation; Q/K rows un-permuted like ``tensor_sources``)."""
    sources: dict[str, Callable[[], Int4Weight]] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in INT4_TYPES or len(tensor.data.shape) != 2:
            continue
        name = _hf_name(tensor.name, config.architecture)
        heads = _permuted_heads(name, config)
        sources[name] = _int4_loader(tensor, heads)
    return sources


def native_sources(reader: GGUFFile, config: ModelConfig) -> dict[str, Callable[[], GGUFWeight]]:
    """Hugging Face name -> a function giving the tensor as its ggml blocks, viewed in the mapped file, for the
    matrices of the types ``gguf_linear.py`` runs in place (Q/K rows un-permuted by ``row_order``, not moved)."""
    sources: dict[str, Callable[[], GGUFWeight]] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in NATIVE_TYPES or len(tensor.data.shape) not in (2, 3):  # 3: stacked experts
            continue
        name = _hf_name(tensor.name, config.architecture)
        sources[name] = _native_loader(tensor, _permuted_heads(name, config))
    return sources


def embedding_q8_0(reader: GGUFFile) -> Callable[[], Int8Weight] | None:
    """For a Q8_0 token embedding, a function giving its codes and scales (``Int8Weight``), so a tied LM head
    can read the 8-bit codes instead of a dequantised copy; else None."""
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight" and tensor.tensor_type == GGMLQuantizationType.Q8_0:
            return lambda: Int8Weight.from_q8_0_blocks(tensor.data)
    return None


def tensor_type_names(reader: GGUFFile) -> dict[str, str]:
    """Hugging Face name -> the GGUF tensor type's name (for reports)."""
    arch = read_config(reader).architecture
    return {_hf_name(t.name, arch): t.tensor_type.name for t in reader.tensors}


def rope_freq_factors(reader: GGUFFile) -> torch.Tensor | None:
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            return _dequantize(tensor)
    return None


def _hf_name(gguf_name: str, arch: str) -> str:
    """The Hugging Face name; a tensor we do not know keeps its GGUF name (and is reported as unused)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    expert = _PER_EXPERT.match(parts[2]) if arch == "mixtral" and len(parts) == 3 else None
    if expert:  # a Mixtral file's per-expert matrix: Mixtral's own Hugging Face name for it
        proj = {"gate": "w1", "up": "w3", "down": "w2"}[expert[1]]
        return f"model.layers.{parts[1]}.block_sparse_moe.experts.{expert[2]}.{proj}.weight"
    return gguf_name


def _loader(tensor: object, permuted_heads: int | None) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        weight = _dequantize(tensor)
        return weight if permuted_heads is None else _unpermute_qk(weight, permuted_heads)

    return load


def _int4_loader(tensor: object, permuted_heads: int | None) -> Callable[[], Int4Weight]:
    def load() -> Int4Weight:
        weight = Int4Weight.from_ggml_blocks(tensor.data, tensor.tensor_type)
        if permuted_heads is None:
            return weight
        return weight.map_rows(lambda rows: _unpermute_qk(rows, permuted_heads))

    return load


def _native_loader(tensor: object, permuted_heads: int | None) -> Callable[[], GGUFWeight]:
    def load() -> GGUFWeight:
        blocks = torch_view(tensor.data)  # the map is read-only, and nothing writes to weights
        order = None
        if permuted_heads is not None:
            order = _unpermute_qk(torch.arange(blocks.shape[0]), permuted_heads)
        return GGUFWeight(blocks, tensor.tensor_type, order)

    return load


def _dequantize(tensor: object) -> torch.Tensor:
    array = dequantize(tensor.data, tensor.tensor_type)
    # Copy out of the read-only memory map; float32 whatever the stored type.
    return torch.from_numpy(np.array(array, dtype=np.float32))


def _unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> "rotate half" halves)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)
