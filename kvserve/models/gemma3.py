"""Gemma 3 text decoder (Gemma Team, 2025, https://arxiv.org/abs/2503.19786) as a plain ``nn.Module``.

Differences from the Llama block: the embedding is scaled by sqrt(hidden); RMSNorm multiplies by
(1 + weight) (GGUF files store the 1 + weight already: kvserve keeps that form); q and k are
RMS-normalised per head before RoPE; norms sit before *and* after attention and the MLP; the MLP is
GeGLU with tanh-approximated GELU; sliding-window layers alternate with global ones (five to one),
each kind with its own RoPE base. A layer's window reaches attention as metadata
(``ModelConfig.layer_windows``): the model never branches on blocks or windows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.models.config import SLIDING, ModelConfig
from kvserve.models.layers import Linear, RotaryEmbedding, rope_inverse_frequencies
from kvserve.models.llama import Attention, LlamaForCausalLM


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * weight, all in float32 and cast back, with ``weight`` holding Gemma's 1 + w."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), self.weight.shape, eps=self.eps) * self.weight.float()).to(x.dtype)


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), with gate and up fused in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


def query_scale(config: ModelConfig) -> float:
    """What Gemma's queries are multiplied by: attention scales by 1/sqrt(head_dim), Gemma asks for
    1/sqrt(query_pre_attn_scalar)."""
    return math.sqrt(config.head_dim / (config.query_pre_attn_scalar or config.head_dim))


class Gemma3Attention(Attention):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.q_scale = query_scale(config)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = RotaryEmbedding.apply(self.q_norm(q.view(n, self.num_heads, self.head_dim)), rope)  # (N, H, D)
        k = RotaryEmbedding.apply(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), rope)  # (N, Hkv, D)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, k, v.view(n, self.num_kv_heads, self.head_dim)


class Gemma3DecoderLayer(nn.Module):
    NORMS = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "self_attn.q_norm",
        "self_attn.k_norm",
    )
    attention_class = Gemma3Attention

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.sliding = config.layer_windows[layer] is not None
        # The next layer's kind: its rotary tables go to the backend with this layer's input (InfiniGen's rehearsal).
        following = config.layer_windows[layer + 1 : layer + 2]
        self.next_sliding = following[0] is not None if following else self.sliding
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = self.attention_class(config, layer)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = GeGLU(config.hidden_size, config.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), ropes[self.sliding], backend, metadata, ropes[self.next_sliding])
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Same interface as ``LlamaForCausalLM`` (forward, compute_logits, prepack); tied embeddings."""

    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__(config, rope_freq_factors)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        if SLIDING in config.layer_types:  # sliding layers rotate with their own base and no scaling
            local = rope_inverse_frequencies(config.head_dim, config.rope_local_theta or config.rope_theta, None)
            self.rotary_local = RotaryEmbedding(local, config.max_position_embeddings)
        self.embed_scale = math.sqrt(config.hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # scaled in the activation dtype, as the reference

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids and positions (N,) -> final hidden states (N, hidden)."""
        x = self.embed(input_ids)
        ropes = {False: self.rotary.table(positions, x.dtype)}
        if "rotary_local" in self._modules:
            ropes[True] = self.rotary_local.table(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, ropes, backend, metadata)
        return self.norm(x)
