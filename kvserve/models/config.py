"""Architecture hyper-parameters of a Llama-family model, independent of the file format."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.errors import UnsupportedModelError

# Architectures that share the Llama block (RMSNorm, RoPE, GQA, SwiGLU); Qwen2 adds q/k/v bias, Qwen3 q/k norms
# (models/qwen3.py), Phi-3 stores q/k/v and gate/up fused and may scale RoPE by LongRoPE (models/longrope.py).
# Gemma 2 and 3 have their own blocks (models/gemma2.py, models/gemma3.py). The mixtures of experts swap the MLP of
# some or all layers for a sparse block (models/moe.py).
LLAMA_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ARCHITECTURES = (*LLAMA_ARCHITECTURES, *MOE_ARCHITECTURES, "gemma2", "gemma3")
SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face's layer_types names
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (``rope_scaling`` in a Hugging Face config).

    ``linear`` divides every position by ``factor``; ``llama3`` rescales low frequencies only
    (Llama 3.1 / SmolLM long-context configs); ``longrope`` (Phi-3, formerly ``su``) divides each frequency by its
    own ``short_factor`` or ``long_factor`` and multiplies cos and sin by ``attention_factor``
    (which set runs: ``models/longrope.py``).
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {self.rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # bias on q, k and v
    o_proj_bias: bool = False  # bias on the attention output too (Llama's attention_bias)
    # Sliding-window attention: a layer of type SLIDING sees the last ``sliding_window`` positions
    # (its own included); ``layer_types`` () means every layer is FULL.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None: rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    # Mixture of experts (models/moe.py): the layers in ``sparse_layers`` route each token to
    # ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of ``moe_intermediate_size``; the others keep the
    # dense MLP of ``intermediate_size``. ``norm_topk_prob``: the chosen experts' probabilities are renormalised
    # to sum to 1. A shared expert (Qwen2-MoE) of ``shared_expert_intermediate_size`` runs on every token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    # Gemma 2's soft caps: attention logits (after scaling) become cap * tanh(logits / cap) before the mask and
    # softmax, in every layer; the LM head's logits likewise with the final cap. None: no cap.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        self._check_windows()
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if (getattr(self, name) or 0.0) < 0:
                raise UnsupportedModelError(f"{name}={getattr(self, name)} must be positive (or none)")
        if self.sparse_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts={self.num_experts}"
            )
        if any(not 0 <= i < self.num_layers for i in self.sparse_layers):
            raise UnsupportedModelError(f"sparse layers {self.sparse_layers} outside 0..{self.num_layers - 1}")

    def _check_windows(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise UnsupportedModelError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown:
            raise UnsupportedModelError(f"layer types {unknown} are not supported (supported: {SLIDING}, {FULL})")
        if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise UnsupportedModelError(f"sliding-window layers need a sliding_window >= 1, got {self.sliding_window}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the positions a query sees (its own included), or None for the whole context."""
        types = self.layer_types or (FULL,) * self.num_layers
        return tuple(self.sliding_window if t == SLIDING else None for t in types)

    @property
    def attention_softcap(self) -> float:
        """The attention-logit soft cap every layer applies, 0.0 for none (``AttentionMetadata.softcap``)."""
        return float(self.attn_logit_softcapping or 0.0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary."""
        model_type = cfg.get("model_type", "")
        if model_type == "gemma3" and "text_config" in cfg:
            raise UnsupportedModelError("Gemma 3 with a vision tower is not supported; use the text-only checkpoint")
        model_type = {"gemma3_text": "gemma3"}.get(model_type, model_type)
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true (biases on the MLP projections) is not supported")
        num_heads = cfg["num_attention_heads"]
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        rope_theta = cfg.get("rope_theta", 10000.0)
        rotary = (scaling or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if rotary is not None and rotary < 1:
            raise UnsupportedModelError(
                f"partial_rotary_factor={rotary} (rotary embedding on part of each head) is not supported"
            )
        if scaling is not None:
            rope_theta = scaling.get("rope_theta", rope_theta)
            scaling = _rope_scaling(cfg, scaling)
        qkv_bias = {"qwen2": True, "qwen2_moe": cfg.get("qkv_bias", True)}.get(model_type)
        return cls(
            **_window_fields(cfg, model_type, cfg["num_hidden_layers"]),
            **_expert_fields(cfg, model_type, cfg["num_hidden_layers"]),
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=qkv_bias if qkv_bias is not None else bool(cfg.get("attention_bias")),
            o_proj_bias=qkv_bias is None and bool(cfg.get("attention_bias")),
        )


def _rope_scaling(cfg: dict, scaling: dict) -> RopeScaling | None:
    """``rope_scaling`` (or ``rope_parameters``) read as transformers reads it; None for plain RoPE."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)  # Phi-3's first name for LongRoPE
    if rope_type == "default":
        return None
    context = cfg.get("max_position_embeddings", 8192)
    # transformers prefers a top-level original_max_position_embeddings (Phi-3's config class defaults it to 4096).
    original = cfg.get("original_max_position_embeddings", 4096 if cfg.get("model_type") == "phi3" else None)
    original = int(original or scaling.get("original_max_position_embeddings", context))
    longrope = {}
    if rope_type == "longrope":  # transformers' _compute_longrope_parameters
        factor = scaling.get("factor")
        factor = context / original if factor is None else factor
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        longrope = {
            "short_factor": tuple(float(f) for f in scaling["short_factor"]),
            "long_factor": tuple(float(f) for f in scaling["long_factor"]),
            "attention_factor": float(attention),
        }
    return RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        **longrope,
    )


def _window_fields(cfg: dict, model_type: str, num_layers: int) -> dict:
    """Sliding-window fields of a Hugging Face config: Gemma 3's ``layer_types`` (or its older
    ``sliding_window_pattern``), or Mistral's ``sliding_window`` over every layer."""
    window = cfg.get("sliding_window")
    fields: dict = {"query_pre_attn_scalar": cfg.get("query_pre_attn_scalar")}
    if model_type == "gemma2":  # transformers' Gemma2Config defaults where a config.json leaves them out
        window = cfg.get("sliding_window", 4096)
        fields["query_pre_attn_scalar"] = cfg.get("query_pre_attn_scalar", 256)
        fields["attn_logit_softcapping"] = cfg.get("attn_logit_softcapping", 50.0)
        fields["final_logit_softcapping"] = cfg.get("final_logit_softcapping", 30.0)
    if model_type == "gemma3":
        fields["rope_local_theta"] = float(cfg.get("rope_local_base_freq", 10000.0))
    if window is None or (model_type in ("qwen2", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window")):
        return fields
    if model_type != "gemma3" and window >= cfg.get("max_position_embeddings", window + 1):
        return fields  # a window over the whole context (Phi-3.5's 262144 of 131072) is full attention
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", {"gemma2": 2, "gemma3": 6}.get(model_type, 1))
        types = [FULL if pattern > 1 and (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    return {**fields, "sliding_window": int(window), "layer_types": tuple(types)}


def _expert_fields(cfg: dict, model_type: str, num_layers: int) -> dict:
    """Mixture-of-experts fields of a Hugging Face config. Mixtral: every layer sparse, top-k always renormalised,
    experts of ``intermediate_size``; Qwen-MoE: layer i sparse unless listed in ``mlp_only_layers`` and when
    (i + 1) is a multiple of ``decoder_sparse_step``, as transformers builds it."""
    if model_type not in MOE_ARCHITECTURES:
        return {}
    experts = cfg.get("num_local_experts", cfg.get("num_experts", 0))
    if model_type == "mixtral":
        sparse, size, norm = tuple(range(num_layers)), cfg["intermediate_size"], True
    else:
        dense, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step", 1)
        sparse = tuple(i for i in range(num_layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
        size, norm = cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False))
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg.get("num_experts_per_tok", 0),
        "moe_intermediate_size": size,
        "norm_topk_prob": norm,
        "sparse_layers": sparse,
        "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size", 0)
        if model_type == "qwen2_moe"
        else 0,
    }
