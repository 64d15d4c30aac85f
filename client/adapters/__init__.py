"""The seed's adapters over the daemon (import name `lmcached.client.adapters`).

What lives here: code written against the seed's key-value interfaces runs on lmcached
unchanged, with values in the daemon's shared memory.

- `tensor_store.py`: `TensorStore`, tensors by string key (PUT / GET / DELETE / SCAN),
  the layer both adapters below are built on.
- `backend.py`: the seed's storage-backend interface and `DaemonBackend`.
- `buffers.py`: the disaggregated-prefill buffers (`KVStoreBuffer`, `KVLookupBuffer`)
  and vLLM's abstract bases for them, defined here under vLLM's names.

What it may import: the engine core of `lmcached.client` (chain, daemon_link, records, hashing),
`lmcached.wire.protocol` and `lmcached.wire.logger`. Never vllm or transformers, and never
`lmcached.client.vllm`: the adapters run in any process.
"""
