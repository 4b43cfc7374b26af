"""Paged KV cache bookkeeping: block pool, prefix hashes, block manager, sizing. No tensors here."""

from kvserve.kv.block_pool import Block, BlockPool, KVCacheError, NoFreeBlocksError
from kvserve.kv.manager import AllocationStatus, KVCacheManager, KVGroupSpec, KVUsage
from kvserve.kv.prefix_cache import hash_block_tokens, hash_prompt_blocks
from kvserve.kv.sizing import kv_block_bytes, kv_blocks_for_memory, parse_memory_size

__all__ = [
    "AllocationStatus",
    "Block",
    "BlockPool",
    "KVCacheError",
    "KVCacheManager",
    "KVGroupSpec",
    "KVUsage",
    "NoFreeBlocksError",
    "hash_block_tokens",
    "hash_prompt_blocks",
    "kv_block_bytes",
    "kv_blocks_for_memory",
    "parse_memory_size",
]
