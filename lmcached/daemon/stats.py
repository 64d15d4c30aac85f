"""The daemon's counters: plain ints off the hot path, one typed snapshot for readers.

Why this file exists: the service and the block pools count on every request, and INFO
(`info.py`) and the metrics (`metrics.py`) read the counts. Every counter is declared
here (`DaemonStats`, `PoolStats`, `RequestLatency`), and readers get one typed
`StatsSnapshot`, so a renamed counter breaks where it is read, not an INFO field at run
time. The counting imports no exporter (prometheus_client is loaded only with
--metrics-port). docs/architecture.md, "Performance rules": stats stay off the hot path.
The demotion and L2 counters stay with their owners (`Demoter.stats`, `L2Tier.stats`),
reported through INFO's `stats` and `l2` sections.
"""

import bisect
import dataclasses

# Upper bounds (seconds) of the request latency buckets. A handler takes microseconds
# (a LOOKUP of a few chunks) to milliseconds (an ACQUIRE of thousands of chunks, a CLEAR).
LATENCY_BUCKETS_S = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                     1e-2, 2.5e-2, 0.1, 1.0)


class _LatencyRow:
    """Latency observations of one request type: per-bucket counts (not cumulative; the
    last one is +Inf) and their sum in seconds."""

    __slots__ = ("label", "counts", "sum_s")

    def __init__(self, label: str) -> None:
        self.label = label
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.sum_s = 0.0


class RequestLatency:
    """How long the daemon takes to answer each request type: a histogram in plain ints.

    Observed on the loop thread only (no lock); copied by `take_snapshot` on that thread.
    prometheus_client's own `Histogram` would take a lock per observation and per label
    lookup; `python -m benchmarks.engine.bench_engine --metrics-cost` times both.

    Args:
        request_types: the request Structs; each is labelled by its wire tag
            (`Lookup` -> "lookup", `ConfigGet` -> "config_get").
    """

    def __init__(self, request_types) -> None:
        self._rows = {t: _LatencyRow(t.__struct_config__.tag) for t in request_types}

    def observe(self, request_type: type, seconds: float) -> None:
        """Count one request of `request_type` that took `seconds` (wall clock).

        Raises:
            KeyError: `request_type` was not given at construction (a bug).
        """
        row = self._rows[request_type]
        row.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        row.sum_s += seconds

    def copy(self) -> dict[str, tuple[list[int], float]]:
        """{wire tag: (per-bucket counts, sum of seconds)} of the types seen so far."""
        return {row.label: (row.counts[:], row.sum_s) for row in self._rows.values()
                if row.sum_s or any(row.counts)}


class PoolStats:
    """The counters of one block pool (one tier), updated by `BlockPool` and `TierSet`.

    Attributes:
        hits / misses: chunks found / not found by `acquire_prefix` (and GET).
        evictions: values removed from the index by pressure or by `evict*`.
    """

    __slots__ = ("hits", "misses", "evictions")

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.evictions = 0


# Tenants (fingerprints of salted chains' roots, wire `tenant`) counted apart; later ones
# count under OTHER, so that neither the table nor the metrics' `tenant` label grows with
# what clients send. First come, never dropped: no label comes and goes.
MAX_TENANTS = 64
# Fingerprints one session may be counted under: 70 made-up fingerprints from one client
# take at most this many of the MAX_TENANTS rows, the rest count under "other".
MAX_TENANTS_PER_SESSION = 8
UNSALTED = "unsalted"
OTHER = "other"
_OTHER_KEY = b"other"  # never a fingerprint (those are TENANT_BYTES long)


@dataclasses.dataclass(slots=True)
class TenantRow:
    """One tenant's counters (loop thread only). Each field is INFO field
    `tenant_<name>_<field>` (`info.tenant_fields`) and a sample, labelled `tenant`, of
    the counter family its metadata names (`metrics.metric_families`)."""

    hits: int = dataclasses.field(default=0, metadata={
        "metric": "lmcached_tenant_hit_chunks", "doc": "Chunks found by ACQUIRE"})
    misses: int = dataclasses.field(default=0, metadata={
        "metric": "lmcached_tenant_miss_chunks", "doc": "Chunks ACQUIRE did not find"})
    lookups: int = dataclasses.field(default=0, metadata={
        "metric": "lmcached_tenant_lookups", "doc": "LOOKUP requests"})


class TenantStats:
    """Chunks hit and missed by ACQUIRE and LOOKUPs, per tenant fingerprint, in a table
    of at most MAX_TENANTS fingerprints plus "unsalted" and "other" (LMCache counts per
    cache salt; the bound is ours: a client chooses the fingerprints it sends).

    Rows are `TenantRow`s; `row` is the one lookup per request. LOOKUPs of clients of
    before fingerprints (no `salted` flag there) count as unsalted.
    """

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: dict[bytes, TenantRow] = {b"": TenantRow(), _OTHER_KEY: TenantRow()}

    def row(self, tenant: bytes, salted: bool = False) -> TenantRow:
        """The counters of `tenant` (b"": unsalted, or "other" when `salted`: a client
        of before fingerprints), made on first sight while fewer than MAX_TENANTS are
        tracked, "other"'s otherwise."""
        row = self._rows.get(tenant if tenant or not salted else _OTHER_KEY)
        if row is None:
            if len(self._rows) - 2 >= MAX_TENANTS:
                return self._rows[_OTHER_KEY]
            row = self._rows[tenant] = TenantRow()
        return row

    def other(self) -> TenantRow:
        """The counters of "other" (`row`'s answer past a bound)."""
        return self._rows[_OTHER_KEY]

    def copy(self) -> dict[str, TenantRow]:
        """{"unsalted" | "other" | 16 hex digits: a copy of its row}, unsalted and other
        first, then the fingerprints in the order first seen."""
        names = {b"": UNSALTED, _OTHER_KEY: OTHER}
        return {names.get(key) or key.hex(): dataclasses.replace(row)
                for key, row in self._rows.items()}


class DaemonStats:
    """Every counter of the daemon's request semantics, in one place (Redis's
    `server.stat_*`); plain ints, updated on the loop thread only.

    Attributes:
        requests, connections, lookups, stores: requests answered, connections
            accepted, LOOKUPs, values committed.
        stored_bytes / served_bytes: bytes of the values committed / pinned for readers.
        writing_expired: values aborted after --writing-timeout.
        invalidated: chunks dropped by INVALIDATE.
        errors: refusals and drops by error code.
        tenants: the chunks of `ns_hits` / `ns_misses`, and the LOOKUPs, per tenant
            fingerprint (`TenantStats`); the daemon never sees a salt.
        ns_hits / ns_misses: chunks (and GET values) found / not found, by namespace id,
            of the namespaces alive; with `freed_namespaces` they add up to the pools'
            hits / misses.
        freed_namespaces: namespaces freed since start ("namespaces") and the hits and
            misses they had, in chunks and in tokens.
    """

    def __init__(self) -> None:
        self.requests = 0
        self.connections = 0
        self.lookups = 0
        self.stores = 0
        self.stored_bytes = 0
        self.served_bytes = 0
        self.writing_expired = 0
        self.invalidated = 0
        self.errors: dict[str, int] = {}
        self.tenants = TenantStats()
        self.ns_hits: dict[int, int] = {}
        self.ns_misses: dict[int, int] = {}
        self.freed_namespaces = dict.fromkeys(
            ("namespaces", "hit_chunks", "miss_chunks", "hit_tokens", "miss_tokens"), 0)

    def snapshot(self, pools: list[PoolStats | None]) -> "StatsSnapshot":
        """The counters now, with the pools' (one per tier, None for a tier without
        a pool yet) summed; loop thread."""
        made = [p for p in pools if p is not None]
        return StatsSnapshot(
            requests=self.requests,
            connections_received=self.connections,
            lookups=self.lookups,
            stores=self.stores,
            hits=sum(p.hits for p in made),
            misses=sum(p.misses for p in made),
            tenants=self.tenants.copy(),
            evictions=sum(p.evictions for p in made),
            total_stored_bytes=self.stored_bytes,
            total_served_bytes=self.served_bytes,
            writing_expired=self.writing_expired,
            invalidated_chunks=self.invalidated,
            errors=dict(self.errors),
            tier_hits=tuple(p.hits if p is not None else 0 for p in pools),
        )


@dataclasses.dataclass(frozen=True)
class StatsSnapshot:
    """The daemon's counters at one instant, typed: INFO's `stats` section
    (`info_fields`) and the metrics (`metrics.metric_families`) both read it, so a
    renamed counter fails where it is read, not as a missing INFO field.

    Attributes are named as their INFO fields; `errors` by code (INFO errors_<code>),
    `tier_hits` by tier id (INFO tier<i>_hits for device tiers i >= 1), `tenants` by
    tenant (`TenantStats.copy`, INFO section `tenants`).
    """

    requests: int
    connections_received: int
    lookups: int
    stores: int
    hits: int
    misses: int
    evictions: int
    total_stored_bytes: int
    total_served_bytes: int
    writing_expired: int
    invalidated_chunks: int
    errors: dict[str, int]
    tier_hits: tuple[int, ...]
    tenants: dict[str, TenantRow]

    @property
    def salted_hits(self) -> int:
        """Chunks hit by salted requests: every tenant's but "unsalted"."""
        return sum(row.hits for name, row in self.tenants.items() if name != UNSALTED)

    @property
    def salted_misses(self) -> int:
        """Chunks missed by salted requests."""
        return sum(row.misses for name, row in self.tenants.items() if name != UNSALTED)

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses), 4 digits; 0.0 before any lookup."""
        total = self.hits + self.misses
        return round(self.hits / total, 4) if total else 0.0
