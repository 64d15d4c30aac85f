"""The daemon's counters that the request semantics keep: plain ints off the hot path.

Why this file exists: the service counts on every request, and INFO (`info.py`) and the
metrics (`metrics.py`) read the counts; the counting must not import what exports them
(prometheus_client is loaded only with --metrics-port). docs/architecture.md,
"Performance rules": stats stay off the hot path.
"""

import bisect

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
    lookup; `benchmarks/bench_engine.py --metrics-cost` times both.

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
