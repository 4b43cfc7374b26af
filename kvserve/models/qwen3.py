"""Qwen3 (Qwen Team, 2025, https://arxiv.org/abs/2505.09388): the Llama block with q and k RMS-normalised per head
before RoPE (QK-norm, in place of Qwen2's q/k/v bias)."""

from __future__ import annotations

import torch

from kvserve.models import fused
from kvserve.models.config import ModelConfig
from kvserve.models.layers import RMSNorm
from kvserve.models.llama import Attention, DecoderLayer, LlamaForCausalLM


class QKNormAttention(Attention):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        # Normalised over each head's D values: (N * heads, D) rows through the fused norm.
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(n, self.num_kv_heads, self.head_dim)
        return fused.rotate_(q, rope), fused.rotate_(k, rope), v.view(n, self.num_kv_heads, self.head_dim)


class Qwen3DecoderLayer(DecoderLayer):
    NORMS = (*DecoderLayer.NORMS, "self_attn.q_norm", "self_attn.k_norm")
    attention_class = QKNormAttention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
