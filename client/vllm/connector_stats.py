"""The connector's counters through vLLM's own connector stats and Prometheus output.

Why this file exists: the connector's guarded hooks (`GuardedHooks.counters`), the blend
scheduler and the blend workers count what they do (`BlendScheduler.counters`,
`BlendWorker.counters`), and an operator reads those counts where vLLM shows a
connector's. vLLM asks the connector of each role for the stats of the last interval
every step (`KVConnectorBase_V1.get_kv_connector_stats`: the scheduler's in
`Scheduler.update_from_output`, the workers' in the model runner's output, summed over
the workers), carries them in `SchedulerStats.kv_connector_stats`, and then, in its
front-end process:

- logs each interval's sums (`KVConnectorLogging`, rebuilt with the connector's
  `build_kv_connector_stats`): "KV Transfer metrics: blend_claimed_requests=2,
  claimed_blocks=12, ...", with stats logging on;
- adds each step's counts to the connector's Prometheus counters (`KVConnectorProm`, made
  by the connector's `build_prom_metrics`: `LMCachedPromMetrics` below), on vLLM's own
  `/metrics` endpoint and in `LLM.get_metrics()`, labelled as vLLM labels its engine
  metrics (`model_name`, `engine`).

Every count and the names it is logged and exported under are in `COUNTERS` and
`LABELLED_COUNTERS`. The counts of blocks, tokens and blends are those of TP rank 0 only
(every rank loads and blends the same requests, and vLLM sums the workers' stats); the
exceptions caught in the hooks are every rank's own, summed.

The data (`LMCachedConnectorStats.data`, pickled between vLLM's processes):
`{counter: int, ..., "refusals": {reason: int}, "hook_failures": {hook: int}}`,
increments over the interval, the counters named as `counters()` names them.
"""

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

REFUSALS = "refusals"  # the data's key of the blend refusals by reason
HOOK_FAILURES = "hook_failures"  # the data's key of the exceptions caught by hook

# counter -> (the name vLLM logs it under, its documentation). Prometheus:
# `vllm:lmcached_<logged name>_total`.
COUNTERS: dict[str, tuple[str, str]] = {
    "local_hit_tokens": ("local_hit_tokens", "Tokens of vLLM's own prefix hits at the "
                         "connector's lookups, summed over lookups."),
    "claimed_blocks": ("claimed_blocks", "vLLM blocks lmcached promised to load."),
    "failed_load_blocks": ("failed_load_blocks", "Promised blocks of failed load plans, "
                           "sent to the workers as load errors (vLLM recomputes them)."),
    "load_error_blocks": ("load_error_blocks", "vLLM blocks the workers reported as load "
                          "errors, any cause (vLLM recomputes them); TP rank 0's."),
    "claimed_requests": ("blend_claimed_requests", "CacheBlend requests claimed."),
    "claimed_tokens": ("blend_claimed_tokens", "Tokens of CacheBlend requests claimed."),
    "store_only_requests": ("blend_store_only_requests",
                            "CacheBlend requests that only store their documents."),
    "deferred": ("blend_deferred", "CacheBlend requests deferred to a later step."),
    "blended_requests": ("blend_blended_requests", "Requests blended; TP rank 0's."),
    "reused_tokens": ("blend_reused_tokens", "Tokens reused by blends; TP rank 0's."),
    "recomputed_tokens": ("blend_recomputed_tokens",
                          "Tokens recomputed by blends; TP rank 0's."),
    "stored_segments": ("blend_stored_segments", "Documents stored; TP rank 0's."),
    "skipped_stores": ("blend_skipped_stores", "Document stores skipped; TP rank 0's."),
    "dropped_stores": ("blend_dropped_stores", "Document stores dropped; TP rank 0's."),
    "failed_blends": ("blend_failed_blends", "Blends failed (recomputed); TP rank 0's."),
}
# labelled counter -> (the name vLLM logs it under, with `_<label value>`, the label's
# name, its documentation)
LABELLED_COUNTERS: dict[str, tuple[str, str, str]] = {
    REFUSALS: ("blend_refusals", "reason", "CacheBlend requests refused, by reason."),
    HOOK_FAILURES: ("hook_failures", "hook", "Exceptions caught in the connector's hooks, "
                    "by hook, each served as a miss; every TP rank's."),
}


def _add(into: dict[str, Any], data: dict[str, Any]) -> None:
    """Add the counts of `data` (the data layout above) into `into`."""
    for key, value in data.items():
        if key in LABELLED_COUNTERS:
            labelled = into.setdefault(key, {})
            for label, count in value.items():
                labelled[label] = labelled.get(label, 0) + count
        else:
            into[key] = into.get(key, 0) + value


@dataclasses.dataclass
class LMCachedConnectorStats(KVConnectorStats):
    """The connector's counts over one interval (or the sum of several: `aggregate`).

    Attributes:
        data: the counts, in the data layout of the module docstring.
    """

    def reset(self) -> None:
        """Forget every count."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "LMCachedConnectorStats":
        """These counts plus `other`'s (another worker's, or a later interval's)."""
        total: dict[str, Any] = {}
        _add(total, self.data)
        _add(total, other.data)
        return LMCachedConnectorStats(data=total)

    def reduce(self) -> dict[str, int | float]:
        """The interval's counts as vLLM logs them: each counter under its logged name
        (`COUNTERS`: `blend_<counter>` for CacheBlend's), and `<logged name>_<label>`
        per label of a labelled one (`blend_refusals_<reason>`, `hook_failures_<hook>`)."""
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if key in LABELLED_COUNTERS:
                logged = LABELLED_COUNTERS[key][0]
                out.update({f"{logged}_{label}": count
                            for label, count in sorted(value.items())})
            else:
                out[COUNTERS[key][0] if key in COUNTERS else key] = value
        return out

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(any(value.values()) if key in LABELLED_COUNTERS else value
                       for key, value in self.data.items())


class CounterDeltas:
    """Turns cumulative counters into the increments since the last `take` (vLLM asks a
    connector for the stats collected during the last interval)."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}

    def take(self, counters: dict[str, Any]) -> LMCachedConnectorStats:
        """The increments of `counters` (cumulative, the data layout above) since the
        last call; the counts that did not change are left out."""
        last, delta = self._last, {}
        for key, value in counters.items():
            if key in LABELLED_COUNTERS:
                before = last.get(key, {})
                grown = {label: count - before.get(label, 0)
                         for label, count in value.items() if count != before.get(label, 0)}
                if grown:
                    delta[key] = grown
            elif value != last.get(key, 0):
                delta[key] = value - last.get(key, 0)
        self._last = {key: dict(value) if key in LABELLED_COUNTERS else value
                      for key, value in counters.items()}
        return LMCachedConnectorStats(data=delta)


class ConnectorStats:
    """A connector's `get_kv_connector_stats`, which vLLM calls every step: the counts
    since the last call of this role's guarded hooks and CacheBlend side (the blend
    scheduler's, or the blend worker's of TP rank 0: every rank blends the same
    requests, and vLLM sums the workers'; on other ranks only the hooks' failures).

    Args:
        blend_scheduler / blend_worker: this role's CacheBlend side, None or an object
            with `counters()` (`BlendScheduler.counters`, `BlendWorker.counters`).
        tp_rank: this worker's rank in the TP group (0 on the scheduler).
        hooks: the connector's guarded hooks (`GuardedHooks`), or None.
    """

    def __init__(self, blend_scheduler=None, blend_worker=None, tp_rank: int = 0,
                 hooks=None) -> None:
        self.source = blend_scheduler or (blend_worker if tp_rank == 0 else None)
        self.hooks = hooks
        self.tp_rank = tp_rank
        self._deltas = CounterDeltas()

    def take(self) -> LMCachedConnectorStats | None:
        """The increments since the last call; None when nothing was counted since.

        Raises:
            Whatever a source's `counters()` raises (the connector guards its hook).
        """
        counters: dict[str, Any] = {}
        if self.hooks is not None:
            counters.update(self.hooks.counters(with_blocks=self.tp_rank == 0))
        if self.source is not None:
            counters.update(self.source.counters())
        stats = self._deltas.take(counters)
        return None if stats.is_empty() else stats


class LMCachedPromMetrics(KVConnectorPromMetrics):
    """The connector's counters as Prometheus counters of vLLM's own registry
    (`KVConnectorBase_V1.build_prom_metrics`): `vllm:lmcached_<logged name>_total`
    for each of `COUNTERS` and `LABELLED_COUNTERS` (the latter with their label), every
    one labelled with vLLM's engine labels; `observe` adds one step's counts (the data
    layout of the module docstring). Never raises into vLLM's stats logger: a count of
    an unknown name (a bug) is left out with one warning.
    """

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: self._counter_cls(name=f"vllm:lmcached_{logged}_total",
                                   documentation=f"lmcached connector: {doc}",
                                   labelnames=labelnames)
            for key, (logged, doc) in COUNTERS.items()}
        self.labelled_counters = {
            key: self._counter_cls(name=f"vllm:lmcached_{logged}_total",
                                   documentation=f"lmcached connector: {doc}",
                                   labelnames=[*labelnames, label])
            for key, (logged, label, doc) in LABELLED_COUNTERS.items()}
        self._warned: set[str] = set()

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one step's counts of engine `engine_idx` to the counters."""
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if key in self.labelled_counters:
                for label, count in value.items():
                    if count:
                        self.labelled_counters[key].labels(*labelvalues, label).inc(count)
            elif key in self.counters:
                if value:
                    self.counters[key].labels(*labelvalues).inc(value)
            elif key not in self._warned:
                self._warned.add(key)
                logger.warning("lmcached: the connector stats carry a count no Prometheus "
                               "counter is declared for (%r): it is left out of /metrics; "
                               "declare it in client/vllm/connector_stats.py's COUNTERS", key)
