"""Attention backends: how a layer's queries meet the cached keys and values."""

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.attention.paged import PagedKVCache
from kvserve.attention.paged_metadata import PagedAttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "ContiguousKVCache", "PagedAttentionMetadata", "PagedKVCache"]
