"""The client engine used inside worker processes (import name `lmcached.client`, folder `client/`).

    from lmcached.client import CacheEngine, KVLayout
    layout = KVLayout("llama-3-8b", num_layers=32, num_kv_heads=8, head_size=128)
    with CacheEngine.connect(layout) as engine:
        engine.store(tokens, kv)
        kv, ret_mask = engine.retrieve(tokens)

What lives here:
    engine.py, builder.py      CacheEngine (store / retrieve / lookup) and one engine per id
    retrieve.py                the read side: pinned chunk runs, pinned lookups, copies out
    daemon_link.py             the one call path to the daemon: sessions, snapshots,
                               reconnects, leases, fill-then-COMMIT
    layout.py, records.py      the key namespace and the chunk records in arena blocks
    hashing.py                 the xxh3_128 prefix chain of chunk hashes
    kv_io.py, views.py         KV formats in and out, zero-copy views of arena blocks
    cuda.py                    page-locking the arena for GPU copies
    hf.py                      Hugging Face integration (the only module here importing
                               transformers)
    vllm/                      the vLLM KV connector (the only code importing vllm)
    adapters/                  the seed's storage backend and KV buffers over the daemon
    vllm_connector.py          the connector's stable module path (re-exports vllm/)

What it may import: `lmcached.shm` and, from the daemon's package, only `lmcached.protocol`,
`lmcached.socket_path`, `lmcached.envs` and `lmcached.logger`. The engine core imports
neither `vllm/` nor `adapters/` nor `hf.py`, so importing `lmcached.client` never
imports vllm or transformers.
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
