"""The connector's counters (its guarded hooks' and CacheBlend's) through vLLM's
connector stats and Prometheus output (client/vllm/connector_stats.py): each step's
increments, once; the workers' blocks and blends of TP rank 0 only, every rank's hook
failures; summed and logged by vLLM's own `KVConnectorLogging`, and added to vLLM's
Prometheus registry by its own `KVConnectorProm`, as it does for any connector. A real
vLLM instance reports them (`test_a_vllm_instance_exports_the_connector_counters`);
tests/client/vllm/test_vllm_blend.py reads every blend counter of a real vLLM run
through this path (tests/vllm_e2e.py).
"""

import json
import logging
import os
import subprocess
import sys

import numpy as np

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip(
    "vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm"
)

from lmcached.client.serving.guarded_hooks import GuardedHooks  # noqa: E402
from lmcached.client.vllm.connector_stats import (  # noqa: E402
    COUNTERS,
    LABELLED_COUNTERS,
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
    logging_.observe({"claimed_requests": 2, "blended_requests": 3, "claimed_blocks": 2,
                      "hook_failures": {"wait_for_save": 1}})
    lines = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: blend_claimed_requests=3, "
                     "blend_refusals_unsalted=1, blend_blended_requests=3, claimed_blocks=2, "
                     "hook_failures_wait_for_save=1"]


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
    conn.hooks = GuardedHooks()
    conn.hook_guard = conn.hooks.hook_guard
    conn.connector_stats = ConnectorStats(blend_scheduler, blend_worker, tp_rank, hooks=conn.hooks)
    return conn


def test_the_scheduler_reports_its_counts_once():
    scheduler = Counting(claimed_requests=1, refusals={})
    conn = connector(blend_scheduler=scheduler)
    assert conn.get_kv_connector_stats().data == {"claimed_requests": 1}
    assert conn.get_kv_connector_stats() is None  # nothing new: vLLM carries nothing
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
    conn.connector_stats.source = None  # the failure itself is counted at the next call
    assert conn.get_kv_connector_stats().data == {
        "hook_failures": {"get_kv_connector_stats": 1}}


def test_the_guarded_hooks_counts_reach_the_stats_blocks_from_rank_0_only():
    """Local hits, claims, failed plans and load errors are the same on every TP rank
    (ranks agree on failures): rank 0's; a hook failure is each rank's own."""
    conn = connector()
    hooks = conn.hooks
    hooks.note_local_hit("r1", 32)
    hooks.claim("r1", [4, 5, 6])
    hooks.fail_claim("r1")
    hooks.count_failed_loads(hooks.failed_loads)
    hooks.count_load_errors({4, 5, 6})
    hooks.guarded("wait_for_save", Counting(boom=1).counters)
    assert conn.get_kv_connector_stats().data == {
        "local_hit_tokens": 32, "claimed_blocks": 3, "failed_load_blocks": 3,
        "load_error_blocks": 3, "hook_failures": {"wait_for_save": 1}}
    assert conn.get_kv_connector_stats() is None
    rank1 = connector(tp_rank=1)
    rank1.hooks.claim("r1", [4, 5, 6])
    rank1.hooks.guarded("wait_for_save", Counting(boom=1).counters)
    assert rank1.get_kv_connector_stats().data == {"hook_failures": {"wait_for_save": 1}}


def test_every_counter_a_source_reports_is_declared():
    """A count without a declared name would be logged raw and left out of Prometheus."""
    from lmcached.client.vllm.blend_scheduler import BlendScheduler
    from lmcached.client.vllm.blend_worker import BlendWorker

    scheduler = BlendScheduler.__new__(BlendScheduler)
    scheduler.num_claimed_requests = scheduler.num_claimed_tokens = 0
    scheduler.num_store_only_requests = scheduler.num_deferred = 0
    scheduler.refusals = {}
    worker = BlendWorker.__new__(BlendWorker)
    for name in ("blended_requests", "reused_tokens", "recomputed_tokens", "stored_segments",
                 "skipped_stores", "dropped_stores", "failed_blends"):
        setattr(worker, f"num_{name}", 0)
    names = {*scheduler.counters(), *worker.counters(), *GuardedHooks().counters()}
    assert names == set(COUNTERS) | set(LABELLED_COUNTERS)


def test_vllm_exports_each_steps_counts_to_its_prometheus_registry():
    """vLLM's own `KVConnectorProm` asks the connector for its metrics
    (`build_prom_metrics`) and adds every step's stats data; the counters carry vLLM's
    engine labels."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    config = SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector="LMCachedConnector", kv_role="kv_both",
        kv_connector_module_path="lmcached.client.vllm_connector"))
    unregister_vllm_metrics()
    try:
        prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
        prom.observe({"claimed_blocks": 3, "hook_failures": {"wait_for_save": 1}}, 0)
        prom.observe({"claimed_blocks": 4, "claimed_requests": 2,
                      "refusals": {"unsalted": 1}}, 0)
        prom.observe({"claimed_blocks": 5}, 1)
        prom.observe({"a_count_nobody_declared": 1}, 0)  # left out, never raised

        def value(name, **labels):
            return REGISTRY.get_sample_value(name, {"model_name": "m", **labels})

        assert value("vllm:lmcached_claimed_blocks_total", engine="0") == 7
        assert value("vllm:lmcached_claimed_blocks_total", engine="1") == 5
        assert value("vllm:lmcached_blend_claimed_requests_total", engine="0") == 2
        assert value("vllm:lmcached_blend_refusals_total", engine="0", reason="unsalted") == 1
        assert value("vllm:lmcached_hook_failures_total", engine="0", hook="wait_for_save") == 1
    finally:
        unregister_vllm_metrics()


def test_build_kv_connector_stats_copies_the_data():
    data = {"stored_segments": 4}
    stats = LMCachedConnector.build_kv_connector_stats(data)
    assert isinstance(stats, LMCachedConnectorStats) and stats.data == data
    assert stats.data is not data
    assert LMCachedConnector.build_kv_connector_stats().is_empty()


# ------------------------------------------------------------------ end to end
from test_vllm_connector import E2E_SCRIPT, E2E_TIMEOUT_S, run_instance  # noqa: E402

NUM_SHARED = 3  # prompts whose 512-token prefix (2 chunks of 256) instance A stores


@pytest.mark.slow
@pytest.mark.timeout(3 * E2E_TIMEOUT_S + 60)
def test_a_vllm_instance_exports_the_connector_counters(tmp_path, daemon_factory):
    """Instance A stores three prompts' prefixes; instance B (in-process) hits them, its
    connector's plan of the first hit fails once (the scheduler side's
    `update_state_after_alloc` raises), and a repeat of one prompt hits vLLM's own prefix
    cache. B's counters, as vLLM's Prometheus registry holds them, are B's exact counts
    and the sums of the connector stats vLLM's logger received."""
    tmp = str(tmp_path)
    model = os.path.join(tmp, "model")
    subprocess.run([sys.executable, E2E_SCRIPT, "build-model", model], check=True,
                   timeout=E2E_TIMEOUT_S, capture_output=True)
    rng = np.random.default_rng(7)
    prefixes = [rng.integers(3, 1000, 520).tolist() for _ in range(NUM_SHARED)]
    prompts_a = [p + rng.integers(3, 1000, 40).tolist() for p in prefixes]
    prompts_b = [p + rng.integers(3, 1000, 40).tolist() for p in prefixes]
    daemon = daemon_factory("--capacity", "256MiB")
    run_instance(tmp, "a", model, prompts_a, daemon.socket)
    assert daemon.info()["stores"] == NUM_SHARED * 2
    # the repeat comes in a second generate(): vLLM's own cache then holds it
    b = run_instance(tmp, "b", model, prompts_b + prompts_b[:1], daemon.socket,
                     extra_args=("--batch", str(NUM_SHARED),
                                 "--fail-once", "update_state_after_alloc"))
    chunk_blocks = 512 // b["block_size"]
    local_hit = b["num_cached_tokens"][-1]
    assert local_hit >= 512  # the repeat: vLLM's own hit, nothing beyond it from lmcached
    labels = {"model_name": model, "engine": "0"}
    exported = {(name, tuple(sorted((k, v) for k, v in got.items() if k not in labels))): value
                for name, got, value in b["prometheus"]
                if {k: got.get(k) for k in labels} == labels}
    expected = {
        ("vllm:lmcached_local_hit_tokens", ()): local_hit,
        ("vllm:lmcached_claimed_blocks", ()): NUM_SHARED * chunk_blocks,
        ("vllm:lmcached_failed_load_blocks", ()): chunk_blocks,
        ("vllm:lmcached_load_error_blocks", ()): chunk_blocks,
        ("vllm:lmcached_hook_failures", (("hook", "update_state_after_alloc"),)): 1,
    }
    assert {key: exported.get(key, 0) for key in expected} == expected, b["prometheus"]
    stats = b["connector_stats"]  # what vLLM's stats logger was given: the same sums
    assert stats["hook_failures"] == {"update_state_after_alloc": 1}
    for counter in ("local_hit_tokens", "claimed_blocks", "failed_load_blocks",
                    "load_error_blocks"):
        assert exported.get((f"vllm:lmcached_{counter}", ()), 0) == stats.get(counter, 0)
    assert "ended holding" not in daemon.log()  # the failed plan's pins went back
