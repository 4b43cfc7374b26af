"""Attention backends: how a layer's queries meet the cached keys and values."""

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.attention.contiguous import ContiguousKVCache

__all__ = ["AttentionBackend", "AttentionMetadata", "ContiguousKVCache"]
