"""Turn a Hugging Face-named state dict into a ready ``LlamaForCausalLM`` (fusing q/k/v and gate/up)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.models.config import ModelConfig
from kvserve.models.llama import LlamaForCausalLM

TensorSource = Callable[[str], torch.Tensor]


def build_model(
    config: ModelConfig,
    names: Mapping[str, TensorSource],
    dtype: torch.dtype,
    rope_freq_factors: torch.Tensor | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> LlamaForCausalLM:
    """Create the model from lazily loaded tensors keyed by their Hugging Face names.

    ``names[name]()`` returns the float tensor (out, in) for ``name`` such as
    ``model.layers.0.self_attn.q_proj.weight``; each is materialised once, cast, and dropped.
    """
    used: set[str] = set()
    total = len(names)

    def get(name: str) -> torch.Tensor:
        if name not in names:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint")
        tensor = names[name]().to(dtype)
        used.add(name)
        if progress is not None:
            progress(len(used), total)
        return tensor

    state = {"embed_tokens.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = get("lm_head.weight")
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        state[ours + "input_layernorm.weight"] = get(hf + "input_layernorm.weight")
        state[ours + "post_attention_layernorm.weight"] = get(hf + "post_attention_layernorm.weight")
        state[ours + "self_attn.qkv_proj.weight"] = torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"])
        if config.attention_bias:
            state[ours + "self_attn.qkv_proj.bias"] = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"])
        state[ours + "self_attn.o_proj.weight"] = get(attn + "o_proj.weight")
        if config.o_proj_bias:
            state[ours + "self_attn.o_proj.bias"] = get(attn + "o_proj.bias")
        mlp = hf + "mlp."
        state[ours + "mlp.gate_up_proj.weight"] = torch.cat(
            [get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]
        )
        state[ours + "mlp.down_proj.weight"] = get(mlp + "down_proj.weight")

    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # some checkpoints store the tied copy too
    unused = sorted(set(names) - used)
    if unused:
        raise UnsupportedModelError(
            f"the checkpoint has {len(unused)} tensors this architecture does not use, e.g. {unused[:3]}; "
            "kvserve would compute a different model than the checkpoint describes"
        )
    model = LlamaForCausalLM(config, rope_freq_factors)
    _check_shapes(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _check_shapes(model: LlamaForCausalLM, state: dict[str, torch.Tensor]) -> None:
    for name, param in model.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(state[name].shape)}, the config implies {tuple(param.shape)}"
            )
