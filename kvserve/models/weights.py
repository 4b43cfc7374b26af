"""Turn a Hugging Face-named state dict into a ready ``LlamaForCausalLM`` (fusing q/k/v and gate/up).

Weights given as 4-bit codes (``int4``: GGUF Q4_0 / Q4_1) become ``QuantLinear`` projections (and a
``QuantEmbedding`` for the token embedding) instead of dequantised matrices; with ``int4_dense`` each
also keeps a dequantised copy for large batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.models.config import ModelConfig
from kvserve.models.gemma2 import Gemma2ForCausalLM
from kvserve.models.gemma3 import Gemma3ForCausalLM
from kvserve.models.gguf_linear import GGUFEmbedding, GGUFLinear, GGUFWeight
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.moe import MoEForCausalLM, Qwen3MoEForCausalLM, load_sparse_block
from kvserve.models.quant_linear import Int4Weight, Int8Weight, Q8Linear, QuantEmbedding, QuantLinear
from kvserve.models.qwen3 import Qwen3ForCausalLM

TensorSource = Callable[[str], torch.Tensor]
Int4Source = Callable[[], Int4Weight]
Int8Source = Callable[[], Int8Weight]
NativeSource = Callable[[], GGUFWeight]


def build_model(
    config: ModelConfig,
    names: Mapping[str, TensorSource],
    dtype: torch.dtype,
    rope_freq_factors: torch.Tensor | None = None,
    progress: Callable[[int, int], None] | None = None,
    int4: Mapping[str, Int4Source] | None = None,
    int4_dense: bool = False,
    head_q8: Int8Source | None = None,
    native: Mapping[str, NativeSource] | None = None,
) -> LlamaForCausalLM:
    """Create the model from lazily loaded tensors keyed by their Hugging Face names.

    ``names[name]()`` returns the float tensor (out, in) for ``name`` such as
    ``model.layers.0.self_attn.q_proj.weight``; each is materialised once, cast, and dropped.
    ``int4[name]()``, where given, returns the same weight as 4-bit codes: a projection whose parts
    are all there runs as ``QuantLinear`` in ``dtype`` activations; the others are dequantised.
    ``int4_dense`` gives each ``QuantLinear`` the dequantised weight too (``names[name]()``, the same
    values the dequantised path runs), used for batches too large for the int4 kernel to win.
    ``head_q8()``, for a tied Q8_0 embedding, gives its 8-bit codes: the LM head reads those (``Q8Linear``)
    and the dequantised embedding only above ``quant_linear.max_rows(dtype)`` rows.
    ``native[name]()``, where given, returns the weight as its GGUF blocks: a projection whose parts are all there
    runs as ``GGUFLinear`` (every batch, no dequantised copy), the token embedding as ``GGUFEmbedding``.
    """
    model_class = model_class_for(config)
    weights = _Weights(names, dtype, int4 or {}, int4_dense, progress, native or {})
    weights.state["norm.weight"] = weights.get("model.norm.weight")
    weights.embeddings(config, head_q8)
    for i in range(config.num_layers):
        weights.layer(config, model_class.layer_class.NORMS, i)
    if config.tie_word_embeddings:
        weights.used.add("lm_head.weight")  # some checkpoints store the tied copy too
    unused = sorted(set(names) - weights.used)
    if unused:
        raise UnsupportedModelError(
            f"the checkpoint has {len(unused)} tensors this architecture does not use, e.g. {unused[:3]}; "
            "kvserve would compute a different model than the checkpoint describes"
        )
    model = model_class(config, rope_freq_factors)
    state = weights.state
    for name, module in weights.modules.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
        state.update({f"{name}.{key}": value for key, value in module.state_dict().items()})
    _check_shapes(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


class _Weights:
    """The checkpoint's tensors taken one by one into our names: a state dict of plain tensors, and the
    quantised modules that replace some of ours; which checkpoint names were used, for the unused check."""

    def __init__(
        self,
        names: Mapping[str, TensorSource],
        dtype: torch.dtype,
        int4: Mapping[str, Int4Source],
        int4_dense: bool,
        progress: Callable[[int, int], None] | None,
        native: Mapping[str, NativeSource],
    ) -> None:
        self.names, self.dtype, self.int4, self.int4_dense, self.progress = names, dtype, int4, int4_dense, progress
        self.native = native
        self.used: set[str] = set()
        self.state: dict[str, torch.Tensor] = {}
        self.modules: dict[str, torch.nn.Module] = {}  # our module name -> its quantised replacement

    def _mark_used(self, name: str) -> None:
        if name not in self.names:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint")
        self.used.add(name)
        if self.progress is not None:
            self.progress(len(self.used), len(self.names))

    def get(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint")
        tensor = self.names[name]().to(self.dtype)
        self._mark_used(name)
        return tensor

    def get_int4(self, name: str) -> Int4Weight:
        weight = self.int4[name]()
        self._mark_used(name)
        return weight

    def get_native(self, name: str) -> GGUFWeight:
        weight = self.native[name]()
        self._mark_used(name)
        return weight

    def linear(self, ours: str, parts: list[str], bias: list[str] | None = None) -> None:
        """The projection ``ours`` from the rows of ``parts`` (fused when several), quantised if all are."""
        bias_tensor = torch.cat([self.get(b) for b in bias]) if bias else None
        if all(p in self.native for p in parts):
            self.modules[ours] = GGUFLinear([self.get_native(p) for p in parts], self.dtype, bias_tensor)
            return
        if all(p in self.int4 for p in parts):
            dense = torch.cat([self.get(p) for p in parts]) if self.int4_dense else None
            weight = Int4Weight.cat([self.get_int4(p) for p in parts])
            self.modules[ours] = QuantLinear(weight, self.dtype, bias_tensor, dense)
            return
        self.state[ours + ".weight"] = torch.cat([self.get(p) for p in parts]) if len(parts) > 1 else self.get(parts[0])
        if bias_tensor is not None:
            self.state[ours + ".bias"] = bias_tensor

    def embeddings(self, config: ModelConfig, head_q8: Int8Source | None) -> None:
        """The token embedding, and the LM head (tied to it, or its own)."""
        embed = "model.embed_tokens.weight"
        if embed in self.int4:
            weight = self.get_int4(embed)
            self.modules["embed_tokens"] = QuantEmbedding(weight, self.dtype)
            if config.tie_word_embeddings:  # the head reads the same codes, packed for the int4 matmul
                dense = self.get(embed) if self.int4_dense else None
                self.modules["lm_head"] = QuantLinear(weight, self.dtype, dense=dense)
        elif embed in self.native:
            weight = self.get_native(embed)
            self.modules["embed_tokens"] = GGUFEmbedding(weight, self.dtype)
            if config.tie_word_embeddings:  # the head reads the same blocks
                self.modules["lm_head"] = GGUFLinear([weight], self.dtype)
        else:
            self.state["embed_tokens.weight"] = self.get(embed)
            if config.tie_word_embeddings and head_q8 is not None:
                dense = self.state["embed_tokens.weight"]
                self.modules["lm_head"] = Q8Linear(head_q8(), self.dtype, dense=dense)
        if not config.tie_word_embeddings:
            self.linear("lm_head", ["lm_head.weight"])

    def layer(self, config: ModelConfig, norms: Sequence[str], i: int) -> None:
        """Decoder layer ``i``: its norms, fused q/k/v, o, and its MLP: fused gate/up and down, or a sparse block."""
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        for norm in norms:
            self.state[f"{ours}{norm}.weight"] = self.get(f"{hf}{norm}.weight")
        # A checkpoint that stores q/k/v or gate/up fused already (Phi-3), in our row order, loads as it is.
        qkv_bias = [attn + f"{p}_proj.bias" for p in "qkv"] if config.attention_bias else None
        qkv = [attn + f"{p}_proj.weight" for p in "qkv"]
        self.linear(ours + "self_attn.qkv_proj", self._fused(attn + "qkv_proj.weight", qkv), qkv_bias)
        o_bias = [attn + "o_proj.bias"] if config.o_proj_bias else None
        self.linear(ours + "self_attn.o_proj", [attn + "o_proj.weight"], o_bias)
        if i in config.sparse_layers:
            load_sparse_block(self, config, hf, ours + "mlp.")
            return
        gate_up = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        self.linear(ours + "mlp.gate_up_proj", self._fused(mlp + "gate_up_proj.weight", gate_up))
        self.linear(ours + "mlp.down_proj", [mlp + "down_proj.weight"])

    def _fused(self, fused: str, parts: list[str]) -> list[str]:
        return [fused] if fused in self.names else parts


def model_class_for(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module that computes ``config.architecture``."""
    classes = {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM, "qwen3": Qwen3ForCausalLM,
               "qwen3_moe": Qwen3MoEForCausalLM, "mixtral": MoEForCausalLM, "qwen2_moe": MoEForCausalLM}  # fmt: skip
    return classes.get(config.architecture, LlamaForCausalLM)


def _check_shapes(model: LlamaForCausalLM, state: dict[str, torch.Tensor]) -> None:
    for name, param in model.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(state[name].shape)}, the config implies {tuple(param.shape)}"
            )
