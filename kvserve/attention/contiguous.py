"""Contiguous KV cache: one pre-allocated (layers, seqs, Hkv, max_len, D) buffer per K and V.

The simple reference layout: exact, easy to read, and what paged attention is tested against.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.attention.masks import causal_mask, window_binds
from kvserve.attention.softcap import sdpa


class ContiguousKVCache(AttentionBackend):
    def __init__(
        self,
        num_layers: int,
        num_seqs: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_seqs, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        outputs = []
        start = 0
        for seq, q_len, ctx_len in zip(metadata.seq_ids, metadata.query_lens, metadata.context_lens, strict=True):
            end = ctx_len + q_len
            if end > self.max_len:
                raise ValueError(f"sequence {seq} needs {end} cache slots, the cache holds {self.max_len}")
            rows = slice(start, start + q_len)
            self.k[layer, seq, :, ctx_len:end] = k[rows].transpose(0, 1)
            self.v[layer, seq, :, ctx_len:end] = v[rows].transpose(0, 1)
            keys, values = self.k[layer, seq, :, :end], self.v[layer, seq, :, :end]
            outputs.append(self._attend(q[rows], keys, values, ctx_len, metadata.window_of(layer), metadata.softcap))
            start += q_len
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    @staticmethod
    def _attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, window: int | None = None, softcap: float = 0.0
    ) -> torch.Tensor:
        """q (T, H, D) over k, v (Hkv, ctx_len + T, D) -> (T, H, D)."""
        q_len = q.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, T, D)
        kh, vh = k.unsqueeze(0), v.unsqueeze(0)
        if window_binds(window, ctx_len + q_len):
            mask = causal_mask(q_len, ctx_len, window, q.device)  # (T, ctx + T)
            out = sdpa(qh, kh, vh, attn_mask=mask, softcap=softcap, enable_gqa=True)
        elif q_len == 1 or ctx_len == 0:
            # One query sees everything; a fresh prompt is plain causal.
            out = sdpa(qh, kh, vh, is_causal=q_len > 1, softcap=softcap, enable_gqa=True)
        else:
            mask = causal_mask(q_len, ctx_len, device=q.device)  # (T, ctx + T)
            out = sdpa(qh, kh, vh, attn_mask=mask, softcap=softcap, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)  # (T, H, D)
