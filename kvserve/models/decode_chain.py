"""A Llama-family model's decoder layers as one compiled call for decode steps (``csrc/decode_layers.cpp``).

At batch 1 the eager layers spend about a third of a float32 step on Python between the kernels (~12 ops a
layer; SmolLM2: 6 of 19 ms). When the cache says the step is decode only (``AttentionBackend.in_place_decode``)
and every layer is a plain ``DecoderLayer`` on the CPU whose projections are float32 (dense or on 4-bit codes,
with or without int8 activations) or bfloat16 (on torch's packed int4 codes, as ``--weights native`` runs
decode-sized batches), ``LlamaForCausalLM`` runs its layers through ``DecodeChain`` instead: the same kernels in
the same order, so the hidden states are bit-identical to the eager layers' (``tests/test_decode_chain.py``).
The paged cache gives one block table for every layer; the compressed cache one per layer, and asks for each
layer's attention probabilities, which it folds into its slot scores afterwards (``finish_in_place_decode``;
``tests/policies/test_compressed_chain.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.backend import InPlaceDecode
from kvserve.models.layers import Linear
from kvserve.models.packed_linear import EXACT_ROWS
from kvserve.models.quant_linear import QuantLinear
from kvserve.platform.cpu_kernels import cpu_kernels_available

_NONE = torch.empty(0)  # an absent bias or consts in the op's weight list
_ANY_ROWS = 1 << 62  # a dense projection's row limit: none


def _projection(module: nn.Module, dtype: torch.dtype, wide: bool) -> tuple[list[torch.Tensor], int] | None:
    """(weight, consts, bias) as the op takes them for activations of ``dtype`` and the most rows it may run at
    once; None if it can't. ``wide``: what the module computes batches above its codes' row limit with (its dense
    copy, plain or reordered for oneDNN), as its forward does."""
    bias = module.bias if getattr(module, "bias", None) is not None else _NONE
    if type(module) is QuantLinear and module.act_dtype == dtype:
        if wide and module.dense_packed is not None:
            return [module.dense_packed, _NONE, bias], EXACT_ROWS  # above it packed_linear pads the rows
        if wide and module.dense is not None:
            return [module.dense, _NONE, bias], _ANY_ROWS
        rows = module.max_rows if module.dense is not None or module.dense_packed is not None else _ANY_ROWS
        if dtype == torch.float32:
            return [module.kernel_codes, module.consts, bias], rows
        if module.packed_weight.shape[0] != module.out_features:  # padded to 16 rows: the op would not slice
            return None
        return [module.packed_weight, module.scales_and_zeros, bias], rows
    if type(module) is not Linear or module.row_tile or module.weight.dtype != dtype:
        return None
    if module.packed is not None:
        return [module.packed, _NONE, bias], EXACT_ROWS
    return [module.weight, _NONE, bias], _ANY_ROWS


def _chain_weights(layers: nn.ModuleList, layer_class: type, dtype: torch.dtype, wide: bool):
    """Every layer's tensors in ``decode_layers``' order, the most rows they take and the norms' eps; None where a
    layer is not ``layer_class`` or a projection is not one the op computes."""
    weights, max_rows, eps = [], _ANY_ROWS, None
    for layer in layers:
        if type(layer) is not layer_class:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if eps is None:
            eps = norms[0].eps
        if any(n.eps != eps or n.weight.dtype != dtype for n in norms):
            return None
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        parts = [_projection(m, dtype, wide) for m in modules]
        if any(p is None for p in parts):
            return None
        (qkv, qkv_rows), (o, o_rows), (gate_up, gu_rows), (down, down_rows) = parts
        max_rows = min(max_rows, qkv_rows, o_rows, gu_rows, down_rows)
        weights += [norms[0].weight, *qkv, *o, norms[1].weight, *gate_up[:2], *down[:2]]
        if gate_up[2].numel() or down[2].numel():  # the MLP has no bias in this family
            return None
    if any(w.device.type != "cpu" for w in weights):
        return None
    return [w.detach() for w in weights], max_rows, eps


class DecodeChain:
    """The weights of every layer in ``decode_layers``' order, and the step's call. ``wide``: the weights for
    batches above ``max_rows`` (the projections' dense copies) and their own row limit, where they differ."""

    def __init__(
        self,
        weights: list[torch.Tensor],
        max_rows: int,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
        dtype: torch.dtype = torch.float32,
        wide: tuple[list[torch.Tensor], int] | None = None,
    ):
        self.weights, self.max_rows, self.dtype, self.wide = weights, max_rows, dtype, wide
        self.num_heads, self.num_kv_heads, self.eps = num_heads, num_kv_heads, eps

    @classmethod
    def of(cls, layers: nn.ModuleList, layer_class: type) -> DecodeChain | None:
        """The chain of ``layers`` (all exactly ``layer_class``, the Llama ``DecoderLayer``), or None where a
        layer is anything else: another projection type (tensor-parallel wrappers, float16), row-tiled weights
        (the batch-invariant mode), or weights off the CPU."""
        if not cpu_kernels_available() or not layers:
            return None
        dtype = layers[0].input_layernorm.weight.dtype  # the activations' dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        narrow = _chain_weights(layers, layer_class, dtype, wide=False)
        if narrow is None:
            return None
        weights, max_rows, eps = narrow
        wide = _chain_weights(layers, layer_class, dtype, wide=True) if max_rows < _ANY_ROWS else None
        first = layers[0].self_attn
        wide = wide[:2] if wide is not None and wide[1] > max_rows else None
        return cls(weights, max_rows, first.num_heads, first.num_kv_heads, eps, dtype, wide)

    def __call__(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], decode: InPlaceDecode
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, hidden) of the chain's dtype, the step's embedded tokens -> the last layer's output (B, hidden), and
        each layer's attention probabilities (L, B, T) where ``decode.want_weights`` asks for them (else None)."""
        cos, sin = rope
        out, weights = torch.ops.kvserve.decode_layers(
            x,
            self.weights if x.shape[0] <= self.max_rows else self.wide[0],
            list(decode.layer_rows),
            decode.k_cache,
            decode.v_cache,
            cos.contiguous(),
            sin.contiguous(),
            decode.slots,
            decode.tables,
            decode.starts,
            decode.ends,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            decode.want_weights,
        )
        return out, (weights if decode.want_weights else None)

    def runs(self, x: torch.Tensor) -> bool:
        """Whether the chain takes this step's hidden states (its dtype, on the CPU, few enough rows)."""
        rows = self.max_rows if self.wide is None else max(self.max_rows, self.wide[1])
        return x.dtype == self.dtype and x.device.type == "cpu" and x.shape[0] <= rows
