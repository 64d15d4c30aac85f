"""Prometheus metrics of the daemon: a collector over its own counters, served by a thread.

Why this file exists: operators scrape lmcached with Prometheus, as they scrape vLLM and
LMCache (`lmcached serve --metrics-port PORT`; docs/metrics.md lists every metric). The
daemon already counts what INFO shows (`info.py`), so this module exports those numbers
through a custom collector (prometheus_client's `Collector` protocol) instead of keeping
a second set of counters. The one thing only the loop can measure is how long a request
takes, so `stats.RequestLatency` is observed there, with plain ints (docs/architecture.md,
"Performance rules": stats stay off the hot path).

Threads, and why a scrape's numbers agree with each other::

    HTTP thread (metrics_http.py)                 selector loop (server.py)
    GET /metrics -> DaemonCollector.collect
      SnapshotChannel.request(): the latest
      snapshot if younger than SNAPSHOT_MAX_AGE_S;
      else queue a slot,
      write a byte to the loop's wakeup socket ---> wakes up; after serving the clients
      wait (SNAPSHOT_TIMEOUT_S)                     of this pass, serve_pending():
                                                    take_snapshot(service), a copy of
      <-------------------------------------------- plain values, into every slot
      build the metric families from the copy,
      encode the text (all off the loop)

The snapshot is taken on the loop thread between two requests, so it is consistent:
blocks by state add up to the arena's blocks, a request's hits come with its misses, and
the counters equal INFO's at that instant. The alternative, a lock taken by every counter
update, would put a lock on every request for a scrape every few seconds. The loop's
share of a scrape is the copy: INFO's fields plus one row per namespace and per request
type.

Any local process can open the port, so a scrape's cost to the daemon is bounded
(docs/metrics.md, "Limits"): a snapshot younger than SNAPSHOT_MAX_AGE_S answers later
scrapes without waking the loop, so a flood costs the loop at most one copy per
interval; the HTTP server (`metrics_http.py`) bounds connections, their threads, their
rate, their size and their time.
"""

import collections
import dataclasses
import heapq
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from lmcached.daemon.info import (
    INFO_SECTIONS,
    DeviceTierRow,
    InfoFields,
    demotion_stats,
    device_tier_rows,
    info_sections,
)
from lmcached.daemon.stats import LATENCY_BUCKETS_S, StatsSnapshot, TenantRow
from lmcached.daemon.demotion import DemotionStats
from lmcached.daemon.disk.counters import DiskStats
from lmcached.daemon.l2.counters import ERRORS as L2_ERRORS, ERROR_SAMPLES as L2_ERROR_SAMPLES
from lmcached.daemon.l2.counters import L2Stats
from lmcached.daemon.spill.counters import (
    LabelledFamily,
    counter_families,
    info_fields,
    labelled_families,
)
from lmcached.wire.logger import init_logger
from lmcached.daemon.metrics_http import ScrapeServer

logger = init_logger(__name__)

SNAPSHOT_TIMEOUT_S = 2.0  # a scrape waits this long for the loop, then reports lmcached_up 0
SNAPSHOT_MAX_AGE_S = 0.5  # a snapshot this young answers later scrapes without the loop
# Namespaces with rows of their own in a scrape, the busiest (hits + misses) first; the
# others, and the namespaces freed since start, add up in one row labelled "other".
MAX_NAMESPACE_ROWS = 64
OTHER_NAMESPACES = "other"


@dataclasses.dataclass(frozen=True)
class NamespaceRow:
    """Hit and miss counts of one namespace (one layout: a model, a TP rank, a format),
    or of every namespace without a row of its own (`ns` and `model` OTHER_NAMESPACES).
    Tokens are chunks x the namespace's chunk size."""

    ns: str
    model: str
    hit_chunks: int
    miss_chunks: int
    hit_tokens: int
    miss_tokens: int


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The daemon's numbers at one instant between two requests (plain values only).

    Attributes:
        info: INFO's sections (`info.info_sections`).
        stats: the counters INFO's `stats` section shows, typed (`stats.StatsSnapshot`).
        namespaces: a row per namespace, by id, for the MAX_NAMESPACE_ROWS busiest
            namespaces alive, then the OTHER_NAMESPACES row of the rest (present once
            a namespace was left out or freed).
        latency: `RequestLatency.copy()`, or {} when latency is not observed.
        start_time_s: when the daemon started (Unix time).
        device_tiers: a row per device tier (`info.device_tier_rows`), [] without.
        demotion: the demotion counters (`info.demotion_stats`), None without device
            tiers.
    """

    info: dict[str, InfoFields]
    stats: StatsSnapshot
    namespaces: list[NamespaceRow]
    latency: dict[str, tuple[list[int], float]]
    start_time_s: float
    device_tiers: list[DeviceTierRow] = dataclasses.field(default_factory=list)
    demotion: DemotionStats | None = None


def take_snapshot(service) -> Snapshot:
    """Copy the numbers of `service` (a `CacheService`); on the loop thread only."""
    latency = service.latency.copy() if service.latency is not None else {}
    counters = service.stats.snapshot([p.stats if p else None for p in service.tiers.pools])
    return Snapshot(info_sections(service, counters), counters, namespace_rows(service),
                    latency, service.started_at, device_tier_rows(service, counters),
                    demotion_stats(service))


def namespace_rows(service) -> list[NamespaceRow]:
    """The namespace rows of a snapshot (`Snapshot.namespaces`): bounded, so that a
    scrape's size and cost do not grow with the namespaces clients register.

    The OTHER_NAMESPACES row keeps every counter's sum over rows equal to its INFO twin,
    and monotonic: a namespace that loses its own row or is freed moves its counts there.
    """
    hits, misses = service.stats.ns_hits, service.stats.ns_misses
    alive = [(hits[ns] + misses[ns], -ns, ns, layout) for layout, ns in service.namespaces.items()]
    busiest = heapq.nlargest(MAX_NAMESPACE_ROWS, alive)
    rows = [NamespaceRow(str(ns), layout.model_name, hits[ns], misses[ns],
                         hits[ns] * layout.chunk_size, misses[ns] * layout.chunk_size)
            for _, _, ns, layout in sorted(busiest, key=lambda entry: entry[2])]
    freed = service.stats.freed_namespaces
    if len(alive) > len(busiest) or freed["namespaces"]:
        other = dict(freed)
        kept = {entry[2] for entry in busiest}
        for _, _, ns, layout in alive:
            if ns not in kept:
                other["hit_chunks"] += hits[ns]
                other["miss_chunks"] += misses[ns]
                other["hit_tokens"] += hits[ns] * layout.chunk_size
                other["miss_tokens"] += misses[ns] * layout.chunk_size
        rows.append(NamespaceRow(OTHER_NAMESPACES, OTHER_NAMESPACES, other["hit_chunks"],
                                 other["miss_chunks"], other["hit_tokens"],
                                 other["miss_tokens"]))
    return rows


class SnapshotChannel:
    """Hands snapshots from the loop thread to scrape threads (see the module docstring).

    `attach` once the loop runs; `close` when it stops. Until attached and after closed,
    `request` returns None at once. A snapshot younger than `max_age_s` answers later
    requests without waking the loop, so a scrape flood costs the loop at most one
    snapshot per `max_age_s`.

    Args:
        max_age_s: how long a snapshot is reused, in seconds (0: never).
    """

    def __init__(self, max_age_s: float = SNAPSHOT_MAX_AGE_S) -> None:
        self.pending: collections.deque = collections.deque()  # [event, snapshot] slots
        self.max_age_s = max_age_s
        self._lock = threading.Lock()  # attach / close against request
        self._take: Callable[[], Snapshot] | None = None
        self._wake: Callable[[], None] | None = None
        self._latest: tuple[float, Snapshot] | None = None  # (monotonic time taken, snapshot)

    def attach(self, take: Callable[[], Snapshot], wake: Callable[[], None]) -> None:
        """The loop runs: `take()` makes a snapshot (loop thread), `wake()` (any thread)
        makes the loop call `serve_pending` soon."""
        with self._lock:
            self._take, self._wake = take, wake

    def request(self, timeout_s: float = SNAPSHOT_TIMEOUT_S) -> Snapshot | None:
        """A snapshot from the loop (scrape thread), the latest one if it is younger than
        `max_age_s`; None when the loop is not serving or did not answer within
        `timeout_s`."""
        slot = [threading.Event(), None]
        with self._lock:
            if self._wake is None:
                return None
            latest = self._latest
            if latest is not None and time.monotonic() - latest[0] < self.max_age_s:
                return latest[1]
            self.pending.append(slot)
            wake = self._wake
        wake()
        if not slot[0].wait(timeout_s):
            logger.warning("metrics: the daemon's loop did not answer a scrape within %.1f s",
                           timeout_s)
            return None
        return slot[1]

    def serve_pending(self) -> None:
        """Answer every waiting scrape with one snapshot (loop thread)."""
        snapshot = self._take()
        self._latest = (time.monotonic(), snapshot)
        while self.pending:
            slot = self.pending.popleft()
            slot[1] = snapshot
            slot[0].set()

    def close(self) -> None:
        """The loop stops: waiting and later scrapes get None."""
        with self._lock:
            self._take = self._wake = self._latest = None
            while self.pending:
                self.pending.popleft()[0].set()


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _labelled(family: LabelledFamily, samples: tuple[tuple[str, str], ...],
              section: InfoFields) -> CounterMetricFamily:
    """`family` with one sample per (label value, INFO field of `section`)."""
    metric = CounterMetricFamily(family.metric, family.doc, labels=[family.label])
    for value, field in samples:
        metric.add_metric([value], section[field])
    return metric


def labelled_counter_families(section: InfoFields, stats_type,
                              prefix: str) -> Iterator[CounterMetricFamily]:
    """The labelled families the fields of a stats dataclass name (`counter(family=)`),
    read from its INFO section (`prefix` as `spill.counters.info_fields`')."""
    for family, samples in labelled_families(stats_type, prefix):
        yield _labelled(family, samples, section)


# INFO l2 field -> (metric, help, divisor) of the L2 tier's counters (docs/l2.md,
# "Counters"): those of `L2Stats` that name a metric, and the store's reconnects.
L2_COUNTERS = {
    **{field: (name, doc, divisor)
       for field, name, doc, divisor in counter_families(L2Stats, "l2_")},
    "l2_reconnects": ("lmcached_l2_reconnects", "Times L2 answered again after an outage.", 1),
}

# INFO disk field -> (metric, help, divisor) of the disk tier's counters
# (docs/operator.md): those of `DiskStats` that name a metric, and the index's evictions.
DISK_COUNTERS = {
    **{field: (name, doc, divisor)
       for field, name, doc, divisor in counter_families(DiskStats, "disk_")},
    "disk_evictions": ("lmcached_disk_evictions", "Chunks evicted from the disk tier (LRU).",
                       1),
}


def _scaled(value: int, divisor: float) -> float:
    """A counter in its metric's unit (`counter(divisor=)`: microseconds -> seconds)."""
    return value / divisor if divisor != 1 else value


def disk_families(disk: InfoFields) -> Iterator[Metric]:
    """The lmcached_disk_* families of INFO's `disk` section; none without a disk tier."""
    if not disk.get("disk_enabled"):
        return
    for field, (name, doc, divisor) in DISK_COUNTERS.items():
        yield _counter(name, doc, _scaled(disk[field], divisor))
    yield _gauge("lmcached_disk_used_slots", "Slots of the disk tier holding a chunk.",
                 disk["disk_used_slots"])
    yield _gauge("lmcached_disk_slots", "Slots of the disk tier.", disk["disk_slots"])
    yield _gauge("lmcached_disk_stored_bytes", "Bytes of the chunks on disk.",
                 disk["disk_stored_bytes"])
    yield from labelled_counter_families(disk, DiskStats, "disk_")


def l2_families(l2: InfoFields) -> Iterator[Metric]:
    """The lmcached_l2_* families of INFO's `l2` section; none when L2 is off."""
    if not l2.get("l2_enabled"):
        return
    yield _gauge("lmcached_l2_up", "1 when the last L2 operation succeeded, 0 when L2 is "
                 "down or not reached yet.", 1 if l2["l2_state"] == "up" else 0)
    for field, (name, doc, divisor) in L2_COUNTERS.items():
        yield _counter(name, doc, _scaled(l2[field], divisor))
    yield _gauge("lmcached_l2_queue_bytes", "Bytes of chunks waiting to be written to L2.",
                 l2["l2_queue_bytes"])
    yield _gauge("lmcached_l2_queue_values", "Chunks waiting to be written to L2.",
                 l2["l2_queue_values"])
    yield from labelled_counter_families(l2, L2Stats, "l2_")
    yield _labelled(L2_ERRORS, L2_ERROR_SAMPLES, l2)


# The `code` of INFO's errors_demotion (`DemotionStats.errors_demotion`) in lmcached_errors.
DEMOTION_ERROR_CODE = "demotion"
# INFO stats field -> (metric, help, divisor) of the demotion counters
# (lmcached/daemon/demotion.py).
DEMOTION_COUNTERS = {field: (name, doc, divisor)
                     for field, name, doc, divisor in counter_families(DemotionStats, "")}


def device_tier_families(rows: list[DeviceTierRow],
                         demotion: DemotionStats | None) -> Iterator[Metric]:
    """The lmcached_tier_* and lmcached_demotion* families of the device tiers (`rows`)
    and the demotion counters; none without device tiers."""
    if not rows:
        return
    labels = ["tier", "device"]
    capacity = GaugeMetricFamily("lmcached_tier_capacity_bytes", "Size of a device tier.",
                                 labels=labels)
    cached = GaugeMetricFamily("lmcached_tier_cached_bytes", "Bytes of the values in a "
                               "device tier's index now.", labels=labels)
    up = GaugeMetricFamily("lmcached_tier_up", "1 while a device tier takes new chunks, 0 "
                           "after a device error.", labels=labels)
    by_state = GaugeMetricFamily("lmcached_tier_blocks", "Blocks of a device tier by state "
                                 "(free, cached, pinned, writing, detached, demoting).",
                                 labels=[*labels, "state"])
    hits = CounterMetricFamily("lmcached_tier_hit_chunks", "Chunks a device tier served to "
                               "ACQUIRE.", labels=labels)
    for row in rows:
        tier_labels = [str(row.tier_id), str(row.device)]
        capacity.add_metric(tier_labels, row.capacity_bytes)
        cached.add_metric(tier_labels, row.stored_bytes)
        up.add_metric(tier_labels, 0 if row.failed else 1)
        for state, count in row.blocks.items():
            by_state.add_metric([*tier_labels, state], count)
        hits.add_metric(tier_labels, row.hits)
    yield from (capacity, cached, up, by_state, hits)
    counts = info_fields(demotion if demotion is not None else DemotionStats(), "")
    for field, (name, doc, divisor) in DEMOTION_COUNTERS.items():
        yield _counter(name, doc, _scaled(counts[field], divisor))
    yield from labelled_counter_families(counts, DemotionStats, "")


# INFO stats field -> (metric, help, counter?) of the chunk event feed (docs/kv-events.md).
EVENT_FIELDS = {
    "events_published": ("lmcached_events_published", "Chunk events the feed published "
                         "(stored in or removed from the arena or the disk tier).", True),
    "events_lost": ("lmcached_events_lost", "Events subscribers lost: they fell off the "
                    "feed's ring before the subscriber read them.", True),
    "events_snapshot_sent": ("lmcached_events_snapshot_sent", "Stored events sent from "
                             "SUBSCRIBE snapshots (chunks cached before the subscriber "
                             "came).", True),
    "events_subscribers": ("lmcached_event_subscribers", "Sessions subscribed to the feed.",
                           False),
    "events_subscribers_lagging": ("lmcached_event_subscribers_lagging", "Subscribers whose "
                                   "cursor the ring has overwritten (they will lose events).",
                                   False),
}


def event_families(stats: InfoFields) -> Iterator[Metric]:
    """The chunk event feed's families, from INFO's `stats` section."""
    for field, (name, doc, is_counter) in EVENT_FIELDS.items():
        yield (_counter if is_counter else _gauge)(name, doc, stats[field])


def metric_families(snap: Snapshot) -> Iterator[Metric]:
    """The lmcached_* metric families of a snapshot (docs/metrics.md, in that order)."""
    server, memory, blocks, clients, stats = (snap.info[name] for name in INFO_SECTIONS[:5])
    counters = snap.stats
    yield InfoMetricFamily("lmcached", "The daemon: version, name, arena generation.", value={
        "version": str(server["version"]), "name": str(server["name"]),
        "generation": str(server["generation"]),
        "protocol_version": str(server["protocol_version"])})
    yield _gauge("lmcached_start_time_seconds", "When the daemon started (Unix time).",
                 snap.start_time_s)
    yield _counter("lmcached_requests", "Requests answered, every type (INFO requests).",
                   counters.requests)
    yield _counter("lmcached_connections", "Connections accepted (INFO connections_received).",
                   counters.connections_received)
    yield _gauge("lmcached_connected_clients", "Sessions open now.", clients["connected_clients"])
    yield _gauge("lmcached_namespaces", "Namespaces alive: used by an open session or a "
                 "cached value (INFO namespaces).", clients["namespaces"])
    yield _gauge("lmcached_namespaces_sglang", "Namespaces alive of SGLang HiCache pages "
                 "(INFO namespaces_sglang).", clients["namespaces_sglang"])
    yield _counter("lmcached_lookups", "LOOKUP requests answered.", counters.lookups)
    for field in dataclasses.fields(TenantRow):
        family = CounterMetricFamily(field.metadata["metric"], f"{field.metadata['doc']}, by "
                                     "tenant (a salt's fingerprint, unsalted, other; INFO "
                                     "tenants).", labels=["tenant"])
        for tenant, row in counters.tenants.items():
            family.add_metric([tenant], getattr(row, field.name))
        yield family
    yield _counter("lmcached_stores", "Values committed: chunks and PUT values (INFO stores).",
                   counters.stores)
    yield _counter("lmcached_evictions", "Values evicted, by pressure or on request.",
                   counters.evictions)
    yield _counter("lmcached_writing_expired", "Values allocated and not committed within "
                   "--writing-timeout, aborted by the daemon (INFO writing_expired).",
                   counters.writing_expired)
    yield _counter("lmcached_invalidated_chunks", "Chunks a reader found corrupt and "
                   "dropped from the index by INVALIDATE (INFO invalidated_chunks).",
                   counters.invalidated_chunks)
    yield _counter("lmcached_stored_bytes", "Bytes of the values committed (INFO "
                   "total_stored_bytes).", counters.total_stored_bytes)
    yield _counter("lmcached_served_bytes", "Bytes of the values pinned for readers by "
                   "ACQUIRE and GET (INFO total_served_bytes).", counters.total_served_bytes)
    per_ns = {
        ("hit_chunks", "Chunks found by ACQUIRE and values by GET."):
            lambda r: r.hit_chunks,
        ("miss_chunks", "Chunks and values asked for by ACQUIRE and GET and not found."):
            lambda r: r.miss_chunks,
        ("hit_tokens", "hit_chunks x the namespace's chunk size (a shorter last chunk "
         "counts whole)."): lambda r: r.hit_tokens,
        ("miss_tokens", "miss_chunks x the namespace's chunk size."):
            lambda r: r.miss_tokens,
    }
    for (name, doc), value in per_ns.items():
        family = CounterMetricFamily(f"lmcached_{name}", doc, labels=["namespace", "model"])
        for row in snap.namespaces:
            family.add_metric([row.ns, row.model], value(row))
        yield family
    errors = CounterMetricFamily("lmcached_errors", "Refused requests and dropped connections, "
                                 "by error code (INFO errors_<code>).", labels=["code"])
    for code in sorted(counters.errors):  # INFO's order (`info.stats_fields`)
        errors.add_metric([code], counters.errors[code])
    if snap.demotion is not None:  # INFO's errors_demotion, with device tiers
        errors.add_metric([DEMOTION_ERROR_CODE], snap.demotion.errors_demotion)
    yield errors
    yield from event_families(stats)
    yield _gauge("lmcached_arena_capacity_bytes", "Size of the arena segment.",
                 memory["capacity_bytes"])
    yield _gauge("lmcached_block_size_bytes", "Size of one block; 0 until the first layout "
                 "(or --block-size) sets it.", memory["block_bytes"])
    yield _gauge("lmcached_arena_blocks", "Blocks in the arena; 0 until the block size is set.",
                 blocks["num_blocks"])
    pinned_indexed = blocks["cached_blocks"] - blocks["evictable_blocks"]
    by_state = GaugeMetricFamily("lmcached_blocks", "Blocks by state; the states add up to "
                                 "lmcached_arena_blocks.", labels=["state"])
    for state, value in (("free", blocks["free_blocks"]), ("ready", blocks["evictable_blocks"]),
                         ("pinned", pinned_indexed), ("detached", blocks["detached_blocks"]),
                         ("writing", blocks["writing_blocks"])):
        by_state.add_metric([state], value)
    yield by_state
    yield _gauge("lmcached_cached_values", "Values in the index now.", blocks["cached_values"])
    yield _gauge("lmcached_used_bytes", "Bytes of the blocks in use (READY, WRITING, detached).",
                 memory["used_bytes"])
    yield _gauge("lmcached_cached_bytes", "Bytes of the values in the index now (INFO "
                 "stored_bytes).", memory["stored_bytes"])
    yield _gauge("lmcached_arena_fill_ratio", "Cached bytes / bytes of their blocks "
                 "(INFO fill_ratio).", memory["fill_ratio"])
    yield from device_tier_families(snap.device_tiers, snap.demotion)
    yield from l2_families(snap.info["l2"])
    yield from disk_families(snap.info["disk"])
    latency = HistogramMetricFamily("lmcached_request_duration_seconds", "Time the daemon's "
                                    "loop spent answering a request, by type.", labels=["type"])
    bounds = [floatToGoString(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]
    for label, (counts, sum_s) in sorted(snap.latency.items()):
        cumulative, running = [], 0
        for bound, count in zip(bounds, counts):
            running += count
            cumulative.append((bound, running))
        latency.add_metric([label], cumulative, sum_s)
    yield latency


class DaemonCollector:
    """prometheus_client collector of the daemon's metrics, read at scrape time.

    Args:
        channel: where the snapshots come from.
    """

    def __init__(self, channel: SnapshotChannel) -> None:
        self.channel = channel

    def collect(self) -> Iterator[Metric]:
        """lmcached_up, then (when the loop answered) every family of `metric_families`."""
        snapshot = self.channel.request()
        yield _gauge("lmcached_up", "1 when the daemon's loop answered this scrape; 0 while "
                     "it starts or stops, or when it did not answer in time.",
                     0 if snapshot is None else 1)
        if snapshot is not None:
            yield from metric_families(snapshot)


class MetricsExporter:
    """The HTTP endpoint: its own registry (lmcached_* and process_*), prometheus_client's
    WSGI app, served by a `ScrapeServer` (metrics_http.py: bounded connections, threads,
    rate, size and time) on a thread of its own.

    Args:
        host: address to listen on (e.g. "127.0.0.1", "::").
        port: TCP port.

    Raises:
        OSError: the address cannot be bound (errno EADDRINUSE: the port is in use).
    """

    def __init__(self, host: str, port: int) -> None:
        self.channel = SnapshotChannel()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(self.channel))
        ProcessCollector(registry=self.registry)
        self._httpd = ScrapeServer(host, port)
        self._httpd.set_app(make_wsgi_app(self.registry))
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics",
                                        daemon=True)
        self._thread.start()
        self.port = self._httpd.server_port
        logger.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        """Answer waiting scrapes with lmcached_up 0, stop the server, join its thread."""
        self.channel.close()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)
