"""The client engine used inside worker processes (chunking, hashing, zero-copy views).

    from lmcached.client import CacheEngine, KVLayout
    layout = KVLayout("llama-3-8b", num_layers=32, num_kv_heads=8, head_size=128)
    with CacheEngine.connect(layout) as engine:
        engine.store(tokens, kv)
        kv, ret_mask = engine.retrieve(tokens)
"""

from lmcached.client.builder import CacheEngineBuilder
from lmcached.client.daemon_link import CacheUnavailable
from lmcached.client.engine import CacheEngine
from lmcached.client.hashing import hash_block_tokens, hash_request_tokens
from lmcached.client.layout import KVLayout
from lmcached.client.views import RetrievedViews

__all__ = [
    "CacheEngine",
    "CacheEngineBuilder",
    "CacheUnavailable",
    "KVLayout",
    "RetrievedViews",
    "hash_block_tokens",
    "hash_request_tokens",
]
