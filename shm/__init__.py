"""Shared-memory arena and block pool: pure data structures, no sockets."""

from .arena import Arena, list_segments, segment_name, sweep_orphans
from .block_pool import BlockPool
from .free_queue import BlockHash, BlockState, FreeKVCacheBlockQueue, KVCacheBlock

__all__ = [
    "Arena",
    "BlockHash",
    "BlockPool",
    "BlockState",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "list_segments",
    "segment_name",
    "sweep_orphans",
]
