"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Phi-3) as a plain ``nn.Module``.

Tokens are flattened across sequences (N tokens in a step), every token carries an explicit
position id, and attention goes through an ``AttentionBackend``: the model knows nothing about
blocks, policies or scheduling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.models import fused
from kvserve.models.config import ModelConfig
from kvserve.models.decode_chain import DecodeChain
from kvserve.models.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU, rope_inverse_frequencies
from kvserve.models.longrope import longrope_rotary
from kvserve.models.packed_linear import dense_linear, prepack


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        # q, k and v fused in one matmul: rows [q | k | v].
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.qk_size = config.q_size + config.kv_size
        self.qkv_sizes = (config.q_size, config.kv_size, config.kv_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        metadata: AttentionMetadata,
        next_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``next_rope``: the next layer's rotary tables where they differ from this one's (Gemma 3)."""
        n = x.shape[0]
        backend.observe_input(self.layer, x, rope if next_rope is None else next_rope, metadata)
        q, k, v = self.project(x, rope)
        out = backend.forward(self.layer, q, k, v, metadata)  # (N, H, D)
        return self.o_proj(out.reshape(n, -1))

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, hidden) -> rotated q (N, H, D), rotated k and v (N, Hkv, D)."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k are adjacent rows of the fused projection: rotate them in one go (in place: qkv is ours).
        qk = qkv[:, : self.qk_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = fused.rotate_(qk, rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)  # (N, H, D), (N, Hkv, D)
        v = qkv[:, self.qk_size :].view(n, self.num_kv_heads, self.head_dim)
        return q, k, v


class DecoderLayer(nn.Module):
    # Per-layer norm weights a checkpoint provides (Hugging Face names under model.layers.{i}.).
    NORMS = ("input_layernorm", "post_attention_layernorm")
    attention_class = Attention

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, backend, metadata)
        rows = backend.surviving_rows(self.self_attn.layer, metadata)
        if rows is not None:  # the cache dropped these tokens: the MLP and deeper layers skip them
            x = x.index_select(0, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    layer_class = DecoderLayer

    def __init__(self, config: ModelConfig, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        # Uninitialised like Linear: the checkpoint provides every weight.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.rope_scaling is not None and config.rope_scaling.rope_type == "longrope":
            self.rotary = longrope_rotary(config)
        else:
            scaling = config.rope_scaling
            inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, scaling, rope_freq_factors)
            self.rotary = RotaryEmbedding(inv_freq, config.max_position_embeddings)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied_head_packed: torch.Tensor | None = None  # see prepack()
        self.head_row_tile = 0  # the tied head's rows per call in the batch-invariant mode; 0: all at once
        # The layers as one call for plain decode steps (decode_chain.py): made at the first forward, once the
        # loader is done replacing modules (quantised weights, tensor-parallel wrappers); False until then.
        self.decode_chain: DecodeChain | None | bool = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids and positions (N,) -> final hidden states (N', hidden); N' < N only when the backend
        drops rows (``AttentionBackend.surviving_rows``)."""
        x = self.embed(input_ids)
        rope = self.rotary.table(positions, x.dtype)  # (cos, sin) of this step's tokens, for every layer
        if self.decode_chain is False:
            self.decode_chain = DecodeChain.of(self.layers, DecoderLayer)
        if self.decode_chain is not None and self.decode_chain.runs(x):
            decode = backend.in_place_decode(metadata)
            if decode is not None:
                x, weights = self.decode_chain(x, rope, decode)
                backend.finish_in_place_decode(metadata, weights)
                return self.norm(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, backend, metadata)
            if x.shape[0] != rope[0].shape[0]:
                rows = backend.surviving_rows(i, metadata)
                rope = (rope[0].index_select(0, rows), rope[1].index_select(0, rows))
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' input embeddings (N, hidden)."""
        return self.embed_tokens(input_ids)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> LlamaForCausalLM:
        self.decode_chain = False  # .to(), .float(), ...: the chain's tensors would be the old ones
        return super()._apply(fn, recurse)

    def prepack(self) -> None:
        """Reorder dense bfloat16 weights once for oneDNN on CPU (``packed_linear``); call after loading."""
        for module in self.modules():
            if module is not self and hasattr(module, "prepack"):
                module.prepack()
        if "lm_head" not in self._modules and isinstance(self.embed_tokens, nn.Embedding):
            self.tied_head_packed = prepack(self.embed_tokens.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (M, hidden) -> float32 logits (M, vocab). Call it on the rows you sample from only."""
        if "lm_head" in self._modules:  # untied, or a tied embedding whose head runs quantised
            return self.lm_head(hidden).float()
        return dense_linear(hidden, self.embed_tokens.weight, self.tied_head_packed, None, self.head_row_tile).float()
