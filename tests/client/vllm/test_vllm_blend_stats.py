"""CacheBlend's counters through vLLM's connector stats (client/vllm/blend_stats.py):
each step's increments, once; the workers' of TP rank 0 only; summed and logged by vLLM's
own `KVConnectorLogging` as it does for any connector. tests/client/vllm/test_vllm_blend.py
reads every blend counter of a real vLLM run through this path (tests/vllm_e2e.py).
"""

import logging

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip(
    "vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm"
)

from lmcached.client.serving.guarded_hooks import GuardedHooks  # noqa: E402
from lmcached.client.vllm.blend_stats import (  # noqa: E402
    ConnectorStats,
    CounterDeltas,
    LMCachedConnectorStats,
)
from lmcached.client.vllm.connector import LMCachedConnector  # noqa: E402


def test_deltas_report_each_increment_once():
    deltas = CounterDeltas()
    first = deltas.take({"claimed_requests": 2, "deferred": 0, "refusals": {"unsalted": 1}})
    assert first.data == {"claimed_requests": 2, "refusals": {"unsalted": 1}}
    again = deltas.take({"claimed_requests": 2, "deferred": 0, "refusals": {"unsalted": 1}})
    assert again.data == {} and again.is_empty()
    later = deltas.take({"claimed_requests": 5, "deferred": 1,
                         "refusals": {"unsalted": 1, "bad_params": 2}})
    assert later.data == {"claimed_requests": 3, "deferred": 1, "refusals": {"bad_params": 2}}
    assert not later.is_empty()


def test_aggregate_sums_counts_and_refusals_and_reduce_names_them():
    a = LMCachedConnectorStats(data={"blended_requests": 1, "refusals": {"unsalted": 1}})
    b = LMCachedConnectorStats(data={"blended_requests": 2, "reused_tokens": 64,
                                     "refusals": {"unsalted": 2, "local_hit": 1}})
    total = a.aggregate(b)
    assert total.data == {"blended_requests": 3, "reused_tokens": 64,
                          "refusals": {"unsalted": 3, "local_hit": 1}}
    assert a.data == {"blended_requests": 1, "refusals": {"unsalted": 1}}  # unchanged
    assert total.reduce() == {"blend_blended_requests": 3, "blend_reused_tokens": 64,
                              "blend_refusals_local_hit": 1, "blend_refusals_unsalted": 3}
    total.reset()
    assert total.is_empty()


def test_vllm_logs_the_sum_of_an_intervals_stats():
    """vLLM's stats logger rebuilds the data with the connector's
    `build_kv_connector_stats`, sums the steps and logs one line per interval."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging_ = KVConnectorLogging(KVTransferConfig(
        kv_connector="LMCachedConnector", kv_role="kv_both",
        kv_connector_module_path="lmcached.client.vllm_connector"))
    logging_.observe({"claimed_requests": 1, "refusals": {"unsalted": 1}})
    logging_.observe({"claimed_requests": 2, "blended_requests": 3})
    lines = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: blend_claimed_requests=3, "
                     "blend_refusals_unsalted=1, blend_blended_requests=3"]


class Counting:
    """A blend scheduler or worker as `get_kv_connector_stats` reads it."""

    def __init__(self, **counts) -> None:
        self.counts = counts

    def counters(self) -> dict:
        if self.counts.get("boom"):
            raise OverflowError("Python int too large to convert to C long")
        return dict(self.counts)


def connector(blend_scheduler=None, blend_worker=None, tp_rank=0) -> LMCachedConnector:
    """The attributes `get_kv_connector_stats` reads of a connector of one role."""
    conn = LMCachedConnector.__new__(LMCachedConnector)
    conn.blend_stats = ConnectorStats(blend_scheduler, blend_worker, tp_rank)
    conn.hooks = GuardedHooks()
    conn.hook_guard = conn.hooks.hook_guard
    return conn


def test_the_scheduler_reports_its_counts_once():
    scheduler = Counting(claimed_requests=1, refusals={})
    conn = connector(blend_scheduler=scheduler)
    assert conn.get_kv_connector_stats().data == {"claimed_requests": 1}
    assert conn.get_kv_connector_stats().is_empty()
    scheduler.counts.update(claimed_requests=4, refusals={"one_segment": 1})
    assert conn.get_kv_connector_stats().data == {"claimed_requests": 3,
                                                  "refusals": {"one_segment": 1}}


def test_only_tp_rank_0_reports_the_workers_counts():
    """vLLM sums the workers' stats, and every rank blends the same requests."""
    worker = Counting(blended_requests=2, reused_tokens=32)
    assert connector(blend_worker=worker, tp_rank=1).get_kv_connector_stats() is None
    assert connector(blend_worker=worker).get_kv_connector_stats().data == worker.counts
    assert connector().get_kv_connector_stats() is None  # no CacheBlend in this role


def test_a_failing_count_is_caught_not_raised_into_vllm(caplog):
    conn = connector(blend_scheduler=Counting(boom=1))
    with caplog.at_level(logging.WARNING):
        assert conn.get_kv_connector_stats() is None
    assert conn.hook_guard.failures["get_kv_connector_stats"] == 1


def test_build_kv_connector_stats_copies_the_data():
    data = {"stored_segments": 4}
    stats = LMCachedConnector.build_kv_connector_stats(data)
    assert isinstance(stats, LMCachedConnectorStats) and stats.data == data
    assert stats.data is not data
    assert LMCachedConnector.build_kv_connector_stats().is_empty()
