"""Gemma 2 decoder (Gemma Team, 2024, https://arxiv.org/abs/2408.00118) as a plain ``nn.Module``.

Gemma 3's block (``gemma3.py``: the embedding scaled by sqrt(hidden), RMSNorm by 1 + weight, norms before and
after attention and the MLP, GeGLU with tanh GELU, queries scaled by 1/sqrt(query_pre_attn_scalar)) without q/k
norms, with one RoPE base for every layer, sliding-window and global layers alternating, and two soft caps:
attention logits become cap * tanh(logits / cap) before the mask and softmax (``ModelConfig.attention_softcap``:
``AttentionMetadata.softcap`` for the paged, contiguous and Prompt Cache paths, as windows are; the compressed and
offloaded caches, which build their own metadata, hold it from construction), and the LM head's logits likewise
with the final cap.
"""

from __future__ import annotations

import math

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.models.config import ModelConfig
from kvserve.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM, GemmaRMSNorm, query_scale
from kvserve.models.llama import Attention, LlamaForCausalLM


class Gemma2Attention(Attention):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.q_scale = query_scale(config)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x, rope)
        return (q * self.q_scale if self.q_scale != 1.0 else q), k, v


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's layer with Gemma 2's attention (no q/k norms), one rotary table for every layer, and the rows a
    cache drops skipped by the MLP as in the Llama layer."""

    NORMS = Gemma3DecoderLayer.NORMS[:4]  # no q/k norms
    attention_class = Gemma2Attention

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, backend, metadata))
        rows = backend.surviving_rows(self.self_attn.layer, metadata)
        if rows is not None:  # the cache dropped these tokens: the MLP and deeper layers skip them
            x = x.index_select(0, rows)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Same interface as ``LlamaForCausalLM`` (forward, compute_logits, prepack)."""

    layer_class = Gemma2DecoderLayer

    def __init__(self, config: ModelConfig, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__(config, rope_freq_factors)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = math.sqrt(config.hidden_size)
        self.final_softcap = config.final_logit_softcapping or 0.0

    embed = Gemma3ForCausalLM.embed  # scaled by sqrt(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
