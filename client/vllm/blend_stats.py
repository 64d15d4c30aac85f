"""CacheBlend's counters through vLLM's own connector stats (`KVConnectorStats`).

Why this file exists: the blend scheduler and the blend workers count what they do
(`BlendScheduler.counters`, `BlendWorker.counters`), and an operator reads those counts
where vLLM shows a connector's: vLLM asks the connector of each role for the stats of
the last interval every step (`KVConnectorBase_V1.get_kv_connector_stats`: the
scheduler's in `Scheduler.update_from_output`, the workers' in the model runner's
output, summed over the workers), carries them in `SchedulerStats.kv_connector_stats`,
rebuilds them with the connector's `build_kv_connector_stats` and logs each interval's
sums (`KVConnectorLogging`: "KV Transfer metrics: blend_claimed_requests=2, ...", with
stats logging on). The workers' counters are those of TP rank 0 only: every rank blends
the same requests, and vLLM sums the workers' stats.

The data (`LMCachedConnectorStats.data`, pickled between vLLM's processes):
`{counter: int, ..., "refusals": {reason: int}}`, increments over the interval, the
counters named as `counters()` names them.
"""

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

REFUSALS = "refusals"  # the data's key of the refusals by reason


def _add(into: dict[str, Any], data: dict[str, Any]) -> None:
    """Add the counts of `data` (the data layout above) into `into`."""
    for key, value in data.items():
        if key == REFUSALS:
            refusals = into.setdefault(REFUSALS, {})
            for reason, count in value.items():
                refusals[reason] = refusals.get(reason, 0) + count
        else:
            into[key] = into.get(key, 0) + value


@dataclasses.dataclass
class LMCachedConnectorStats(KVConnectorStats):
    """CacheBlend's counts over one interval (or the sum of several: `aggregate`).

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
        """The interval's counts as vLLM logs them: `blend_<counter>`, and
        `blend_refusals_<reason>` per reason."""
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if key == REFUSALS:
                out.update({f"blend_refusals_{reason}": count
                            for reason, count in sorted(value.items())})
            else:
                out[f"blend_{key}"] = value
        return out

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(value for key, value in self.data.items() if key != REFUSALS) \
            and not any(self.data.get(REFUSALS, {}).values())


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
            if key == REFUSALS:
                before = last.get(REFUSALS, {})
                grown = {reason: count - before.get(reason, 0)
                         for reason, count in value.items() if count != before.get(reason, 0)}
                if grown:
                    delta[REFUSALS] = grown
            elif value != last.get(key, 0):
                delta[key] = value - last.get(key, 0)
        self._last = {key: dict(value) if key == REFUSALS else value
                      for key, value in counters.items()}
        return LMCachedConnectorStats(data=delta)


class ConnectorStats:
    """A connector's `get_kv_connector_stats`, which vLLM calls every step: the counts
    since the last call of this role's CacheBlend side (the blend scheduler's, or the
    blend worker's of TP rank 0: every rank blends the same requests, and vLLM sums the
    workers'); nothing without CacheBlend in this role.

    Args:
        blend_scheduler / blend_worker: this role's CacheBlend side, None or an object
            with `counters()` (`BlendScheduler.counters`, `BlendWorker.counters`).
        tp_rank: this worker's rank in the TP group (0 on the scheduler).
    """

    def __init__(self, blend_scheduler=None, blend_worker=None, tp_rank: int = 0) -> None:
        self.source = blend_scheduler or (blend_worker if tp_rank == 0 else None)
        self._deltas = CounterDeltas()

    def take(self) -> LMCachedConnectorStats | None:
        """The source's increments since the last call; None without a source.

        Raises:
            Whatever the source's `counters()` raises (the connector guards its hook).
        """
        if self.source is None:
            return None
        return self._deltas.take(self.source.counters())
