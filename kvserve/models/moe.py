"""Sparse mixture-of-experts decoders: Mixtral (Jiang et al., 2024, https://arxiv.org/abs/2401.04088), Qwen2-MoE
(a shared expert beside the routed ones) and Qwen3-MoE (q/k norms; dense MLP layers may sit between sparse ones).

Each sparse layer replaces the SwiGLU MLP with ``SparseMoE``: a router (hidden -> experts) whose softmax, taken in
float32, picks each token's top-k experts; the chosen probabilities are renormalised to sum to 1 where the family
does so (Mixtral always, Qwen ``norm_topk_prob``). The (token, expert) pairs are then sorted by expert, so each
expert with tokens runs one gate/up and one down matmul over all of its tokens, and the results, scaled by their
routing weights, are added back into their tokens' rows (in ascending expert order per token, as transformers
does). The experts are held stacked, gate and up fused: (E, 2I, H) and down (E, H, I); a GGUF file's
``ffn_{gate,up,down}_exps`` and a Hugging Face folder's per-expert matrices both load into that form.

Weights: a GGUF file's stacked experts of the types ``gguf_linear.py`` runs in place (Q4_K, Q5_K, Q6_K, Q5_0, Q8_0)
stay the file's blocks (``BlockExperts``: each expert's tokens through ``gguf_linear``, activations rounded to int8
as llama.cpp does), so the experts cost their file size; other types, and Hugging Face folders, are dequantised to
the model dtype at load. The routing weights multiply the expert outputs in float32
and the product is rounded once to the activation dtype.

Tensor parallelism (``models/sharding.py``): each expert's intermediate dimension is split across the ranks like
the dense MLP's (gate/up rows, down columns), and so is the shared expert's; the router and the shared expert's
gate are replicated, so every rank routes identically, and the block's output is a partial sum the ranks add up
once per layer (``parallel/tensor_model.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvserve.models import fused
from kvserve.models.config import ModelConfig
from kvserve.models.gguf_linear import GGUFWeight
from kvserve.models.layers import Linear, SwiGLU
from kvserve.models.llama import DecoderLayer, LlamaForCausalLM
from kvserve.models.packed_linear import dense_linear
from kvserve.models.qwen3 import QKNormAttention, Qwen3DecoderLayer


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs held stacked: ``gate_up`` (E, 2I, H) with rows [gate | up], ``down`` (E, H, I).
    Parameters are left uninitialised: the checkpoint provides them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Rows per matmul call in the batch-invariant mode (an expert's row count follows the batch); 0: all.
        self.row_tile = 0

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, H), each token's experts (N, k) and float32 routing weights (N, k) -> (N, H)."""
        return grouped_by_expert(x, experts, weights, self.gate_up.shape[0], self.expert_mlp)

    def expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        h = dense_linear(rows, self.gate_up[expert], None, None, self.row_tile)
        h = fused.silu_mul(h, self.intermediate_size)
        return dense_linear(h, self.down[expert], None, None, self.row_tile)


def grouped_by_expert(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, num_experts: int, mlp: Callable
) -> torch.Tensor:
    """The routed experts' outputs summed into their tokens' rows: the (token, expert) pairs sorted by expert, each
    expert with tokens run once over all of them (``mlp(expert, rows)``), the outputs scaled by their routing weights
    in float32 and rounded once to x's dtype."""
    if x.shape[0] == 0:  # every row dropped by the cache: nothing to route
        return torch.zeros_like(x)
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)  # pairs grouped by expert, each group in token order
    tokens = order // k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = x.index_select(0, tokens)
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            outputs.append(mlp(expert, rows[start : start + count]))
            start += count
    scaled = (torch.cat(outputs).float() * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, scaled)


class BlockExperts(nn.Module):
    """``Experts`` with the stacked expert matrices kept as a GGUF file's blocks: gate and up (E, I, H) and down
    (E, H, I) as ``GGUFWeight``; an expert's gate and up run as one fused product over its tokens."""

    _NO_INDEX = torch.empty(0, dtype=torch.long)

    def __init__(self, gate: GGUFWeight, up: GGUFWeight, down: GGUFWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = gate.shape[1]
        self.num_experts = gate.shape[0]
        self.types = [int(gate.qtype), int(up.qtype)], [int(down.qtype)]
        for name, weight in (("gate", gate), ("up", up), ("down", down)):
            self.register_buffer(name, weight.blocks, persistent=False)
        self.act_dtype = dtype

    def code_tensors(self) -> list[torch.Tensor]:
        return [self.gate, self.up, self.down]

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return grouped_by_expert(x, experts, weights, self.num_experts, self.expert_mlp)

    def expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up_types, down_types = self.types
        gate_up = [self.gate[expert], self.up[expert]]
        h = torch.ops.kvserve.gguf_linear(rows.float().contiguous(), gate_up, gate_up_types, self._NO_INDEX)
        h = fused.silu_mul(h, self.intermediate_size)
        return torch.ops.kvserve.gguf_linear(h, [self.down[expert]], down_types, self._NO_INDEX)


class SparseMoE(nn.Module):
    """Router, routed experts and (Qwen2-MoE) a shared expert gated per token by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        if config.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H) -> each token's experts (N, k) and their float32 weights (N, k)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.route(x))
        if "shared_expert" in self._modules:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEDecoderLayer(DecoderLayer):
    """The Llama layer with ``SparseMoE`` as its MLP where ``config.sparse_layers`` says so."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        if layer in config.sparse_layers:
            self.mlp = SparseMoE(config)


class Qwen3MoEDecoderLayer(MoEDecoderLayer):
    NORMS = Qwen3DecoderLayer.NORMS
    attention_class = QKNormAttention


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral and Qwen2-MoE (Llama attention, with q/k/v bias for Qwen2-MoE)."""

    layer_class = MoEDecoderLayer


class Qwen3MoEForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3MoEDecoderLayer


# Where a Hugging Face checkpoint keeps a sparse layer's tensors: the block's prefix under the layer, and its
# names for the gate, up and down projections of expert e (``experts.{e}.{name}.weight``).
_CHECKPOINT_NAMES = {
    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
}


def checkpoint_names(architecture: str) -> tuple[str, tuple[str, str, str]]:
    """The sparse block's prefix and its gate/up/down names in ``architecture``'s Hugging Face checkpoints; a GGUF
    file's stacked ``ffn_*_exps`` read as ``{prefix}experts.{name}.weight`` (no expert number)."""
    return _CHECKPOINT_NAMES[architecture]


def load_sparse_block(weights: object, config: ModelConfig, hf: str, ours: str) -> None:
    """Take one sparse layer's tensors (Hugging Face names under ``hf``, e.g. ``model.layers.3.``) into ``weights``
    (``weights._Weights``) as the state of ``SparseMoE`` at ``ours`` (e.g. ``layers.3.mlp.``). Experts come stacked
    (GGUF) or one matrix per expert (Hugging Face)."""
    prefix, (gate, up, down) = checkpoint_names(config.architecture)
    block = hf + prefix
    weights.state[ours + "gate.weight"] = weights.get(block + "gate.weight")

    def stacked(name: str) -> torch.Tensor:
        whole = f"{block}experts.{name}.weight"
        if whole in weights.names:
            return weights.get(whole)
        return torch.stack([weights.get(f"{block}experts.{e}.{name}.weight") for e in range(config.num_experts)])

    native = [f"{block}experts.{name}.weight" for name in (gate, up, down)]
    if all(name in weights.native for name in native):
        weights.modules[ours + "experts"] = BlockExperts(*(weights.get_native(n) for n in native), weights.dtype)
    else:
        weights.state[ours + "experts.gate_up"] = torch.cat([stacked(gate), stacked(up)], dim=1)
        weights.state[ours + "experts.down"] = stacked(down)
    if config.shared_expert_intermediate_size:
        shared = block + "shared_expert."
        weights.linear(ours + "shared_expert.gate_up_proj", [shared + "gate_proj.weight", shared + "up_proj.weight"])
        weights.linear(ours + "shared_expert.down_proj", [shared + "down_proj.weight"])
        weights.state[ours + "shared_expert_gate.weight"] = weights.get(block + "shared_expert_gate.weight").reshape(
            1, -1
        )
