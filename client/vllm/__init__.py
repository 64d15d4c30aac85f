"""The vLLM KV connector (import name `lmcached.client.vllm`, folder `client/vllm/`).

What lives here, after vLLM's NixlConnector split into roles:

- `connector.py`: `LMCachedConnector`, the KV connector V1 class vLLM instantiates
  (users name it by the stable path `lmcached.client.vllm_connector`).
- `scheduler.py`: the scheduler role (LOOKUP / ACQUIRE / RELEASE per request).
- `worker.py`: the worker role (copies vLLM's paged blocks to and from arena records).
- `specs.py`: what the scheduler sends its workers, and their shared settings.
- CacheBlend inside vLLM (docs/cacheblend.md, "Inside vLLM"): `blend_plugin.py` (the
  `vllm.general_plugins` entry point), `blend_models.py` (the `LMCached*ForCausalLM`
  classes that hand the connector their model), `blend_params.py` (what a request asks,
  why one is refused), `blend_config.py` (which engines can blend, the documents'
  namespace), `blend_scheduler.py` (which prompts to claim), `blend_worker.py`
  and `blend_layers.py` (the blend in `start_load_kv`, the document stores).

What it may import: the engine core of `lmcached.client` (chain, daemon_link, records, layout,
hashing, cuda), `lmcached.client.blend`, `lmcached.wire.protocol`, `lmcached.shm`, and vllm.
Only `connector.py`, `blend_config.py`, `blend_models.py` and `blend_plugin.py` (inside
`register`) import vllm (absolute imports: `import vllm` here is the real vLLM, never this
package), so the scheduler and worker roles import and test without vllm installed. This `__init__`
imports nothing, for the same reason.
"""
