"""Attention backends: how a layer's queries meet the cached keys and values."""

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.attention.paged import PagedAttentionMetadata, PagedKVCache

__all__ = ["AttentionBackend", "AttentionMetadata", "ContiguousKVCache", "PagedAttentionMetadata", "PagedKVCache"]
