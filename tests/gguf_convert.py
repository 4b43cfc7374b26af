"""A Hugging Face folder written as GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` writes it, for the families
kvserve loads: tensor names from ggml's own ``gguf.TensorNameMap``, llama.cpp's metadata keys, the Q/K row
permutation of ``llama``, Gemma's norms stored as 1 + w, experts stacked into one tensor per projection, and the
tiny tokenizer's GPT-2 fields. Tests load the folder and the file and compare both with transformers.

``write_gguf_from_hf(folder, path)`` reads ``config.json`` and ``*.safetensors`` only: the file holds exactly the
weights transformers loads.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from tests.tiny_models import BOS_ID, CHAT_TEMPLATE, EOS_ID, tiny_vocab

Q = GGMLQuantizationType

# Hugging Face model_type -> llama.cpp architecture (convert_hf_to_gguf.py's registrations).
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",  # MistralForCausalLM is converted by LlamaModel
    "mixtral": "llama",  # experts in a llama file
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
_PERMUTED = ("llama",)  # llama.cpp permutes Q/K rows of these for its interleaved rotary layout
_GEMMA = ("gemma2", "gemma3")  # norms stored as 1 + w
# Hugging Face per-expert names -> the stacked tensor's projection (Qwen-MoE: gate/up/down_proj; Mixtral: w1/w3/w2).
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_tensors(folder: Path, cfg: dict, stack_experts: bool = True) -> dict[str, np.ndarray]:
    """llama.cpp tensor name -> float32 array (rows, cols) or (experts, rows, cols); with ``stack_experts=False``
    one matrix per expert, ``blk.N.ffn_gate.E.weight``, as llama.cpp's converter wrote Mixtral before March 2024."""
    arch = GGUF_ARCH[cfg["model_type"]]
    layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for hf_name, tensor in state.items():
        array = tensor.float().numpy().copy()
        match = _EXPERT.match(hf_name)
        if match:
            layer, expert, proj = int(match[1]), int(match[2]), _EXPERT_PROJ[match[3]]
            experts.setdefault((layer, proj), {})[expert] = array
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        dense = re.match(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$", hf_name)
        if name is None and dense:
            # A dense layer of a Qwen-MoE (mlp_only_layers): llama.cpp's converter has no name for it (its graphs
            # expect experts in every layer); it is written under the dense MLP's names, which kvserve reads.
            name = f"blk.{dense[1]}.ffn_{dense[2]}.weight"
        if name is None:
            raise KeyError(f"no llama.cpp name for {hf_name} in {arch}")
        if arch in _GEMMA and hf_name.endswith("norm.weight"):
            array = array + 1
        if arch in _PERMUTED and name.endswith("attn_q.weight"):
            array = permute(array, heads, heads)
        if arch in _PERMUTED and name.endswith("attn_k.weight"):
            array = permute(array, heads, kv_heads)
        if name.endswith("_shexp.weight") and array.shape[0] == 1 and "gate_inp" in name:
            array = array[0]  # Qwen2-MoE's shared-expert gate (1, hidden) is stored as a vector
        out[name] = array
    for (layer, proj), by_expert in experts.items():
        if stack_experts:
            out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
        else:
            out |= {f"blk.{layer}.ffn_{proj}.{e}.weight": array for e, array in by_expert.items()}
    if "lm_head.weight" in state and cfg.get("tie_word_embeddings", False):
        out.pop("output.weight", None)
    return out


def _add_metadata(writer: GGUFWriter, cfg: dict, arch: str) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_name("tiny")
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads", heads))
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "full_attention" in rope:  # Gemma 3: per layer kind
        rope = rope["full_attention"]
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    writer.add_vocab_size(cfg["vocab_size"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":  # Phi3MiniModel writes both always: 0 for no window
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    elif cfg.get("sliding_window") and (arch != "qwen2" or cfg.get("use_sliding_window")):
        writer.add_sliding_window(cfg["sliding_window"])
    if cfg.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if rope.get("rope_type") in ("longrope", "su"):
        # Phi3MiniModel: the factors are tensors; the cos/sin scale comes from the top-level context lengths only
        # (rope_scaling's own factor or attention_factor are not read).
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        )


def add_tiny_tokenizer(writer: GGUFWriter, vocab_size: int) -> None:
    vocab = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i in vocab.special_ids else gguf.TokenType.NORMAL for i in range(vocab_size)]
    )
    writer.add_token_merges([f"{a} {b}" for a, b in vocab.merges])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf_from_hf(
    folder: str | Path,
    path: str | Path,
    qtype: GGMLQuantizationType = Q.F32,
    extra_tensors: Callable[[dict], dict[str, np.ndarray]] | None = None,
    stack_experts: bool = True,
) -> Path:
    """Write the Hugging Face checkpoint in ``folder`` as the GGUF ``path``: matrices (and stacked experts) as
    ``qtype``, vectors as F32; ``extra_tensors(config)`` adds tensors the converter computes (rope factors);
    ``stack_experts`` as ``gguf_tensors``."""
    folder, path = Path(folder), Path(path)
    cfg = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    writer = GGUFWriter(path, arch)
    _add_metadata(writer, cfg, arch)
    add_tiny_tokenizer(writer, cfg["vocab_size"])
    arrays = gguf_tensors(folder, cfg, stack_experts)
    arrays |= llama3_rope_factors(cfg) | _phi3_rope_factors(cfg) | (extra_tensors(cfg) if extra_tensors else {})
    for name, array in arrays.items():
        kind = qtype if array.ndim >= 2 else Q.F32
        if kind == Q.F32:
            writer.add_tensor(name, array.astype(np.float32))
        else:
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_factors(cfg: dict) -> dict[str, np.ndarray]:
    """llama.cpp's ``rope_freqs.weight`` for llama3 scaling (``LlamaModel.generate_extra_tensors``)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return {}
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * np.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": np.array(factors, dtype=np.float32)}


def _phi3_rope_factors(cfg: dict) -> dict[str, np.ndarray]:
    """Phi-3's longrope factors as llama.cpp stores them: ``rope_factors_long`` / ``rope_factors_short``."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") not in ("longrope", "su"):
        return {}
    return {
        "rope_factors_long.weight": np.asarray(rope["long_factor"], dtype=np.float32),
        "rope_factors_short.weight": np.asarray(rope["short_factor"], dtype=np.float32),
    }
