"""The vLLM KV connector (import name `lmcached.client.vllm`, folder `client/vllm/`).

What lives here, after vLLM's NixlConnector split into roles:

- `connector.py`: `LMCachedConnector`, the KV connector V1 class vLLM instantiates
  (users name it by the stable path `lmcached.client.vllm_connector`).
- `metadata.py`: what the scheduler and the workers send each other once a step.
- `extra_config.py`: the connector's extra config keys, their defaults, its settings.
- `forward_context.py`: the attention layers' backends and bound KV tensors, read from vLLM.
- `scheduler.py`: the scheduler role: vLLM's hooks as calls into the serving core
  (`lmcached.client.serving`: pinned lookups, step pins, epochs, worker reports).
- `worker.py`: the worker role: vLLM's paged blocks (`PagedBlocks`) as the serving core's
  `KVMover` (loads with their checks and TP agreement, saves: the serving core).
- `specs.py`: the serving core's settings and step specs, re-exported for the CacheBlend side.
- `namespaces.py`: the engine's namespaces (one per TP rank) from its configuration alone.
- `tp_group.py`: the workers' collectives over vLLM's TP group (load errors, blend scores).
- `kv_events.py`: the relay's block events as vLLM's `BlockStored` / `BlockRemoved`
  (`take_events()`), vLLM's block hash, media "CPU" and "STORAGE".
- `load_policy.py`: what vLLM does with a chunk that could not be loaded (recompute by
  default; an explicit `fail` is kept).
- CacheBlend inside vLLM (docs/cacheblend.md, "Inside vLLM"): `blend_plugin.py` (the
  `vllm.general_plugins` entry point), `blend_models.py` (the `LMCached*ForCausalLM`
  classes that hand the connector their model), `blend_params.py` (what a request asks,
  why one is refused), `blend_config.py` (which engines can blend, the documents'
  namespace), `blend_scheduler.py` (which prompts to claim), `blend_worker.py`
  and `blend_layers.py` (the blend in `start_load_kv`, the document stores),
  `blend_flash.py` (FlashAttention over the paged cache for the selected rows, CUDA).
- `connector_stats.py`: the connector's counters (its guarded hooks' and CacheBlend's) as
  vLLM's connector stats (`get_kv_connector_stats`) and Prometheus counters.

What it may import: the engine and its core in `lmcached.client` (engine, chain, daemon_link,
records, layout, hashing, cuda, attention), `lmcached.client.serving`, `lmcached.client.blend`, `lmcached.wire`,
`lmcached.shm`, and vllm. Only `connector.py`, `metadata.py`, `kv_events.py`, `namespaces.py`, `blend_models.py`,
`connector_stats.py`, `blend_plugin.py` (inside `register`), and lazily `tp_group.py` and `blend_flash.py`,
import vllm (absolute imports: `import vllm` here is the real vLLM, never this
package), so the scheduler and worker roles import and test without vllm installed. This `__init__`
imports nothing, for the same reason.
"""
