"""No connector hook raises into vLLM: an exception in lmcached is a counted miss.

A hook of the connector that raises (a bug, an answer out of protocol) is caught at the
boundary (client/vllm/hook_guard.py): 0 tokens matched, or, where vLLM was already
promised tokens, their blocks reported as load errors so that vLLM recomputes them;
never an exception in vLLM's scheduler or forward, never blocks vLLM believes loaded
that hold nothing. Runs vLLM's real Scheduler with the connector (the harness of
test_vllm_connector.py).
"""

import logging

import pytest

from lmcached.client.serving.hook_guard import HookGuard, claimed_block_ids

from test_vllm_connector import (  # noqa: F401 (engine_factory, model_dir are fixtures)
    engine_factory,
    kv_value,
    model_dir,
    pinned_blocks,
    prompt_of,
    store_from_another_instance,
)

pytestmark = pytest.mark.vllm


def boom(*args, **kwargs):
    raise OverflowError("Python int too large to convert to C long")


def test_the_guard_counts_every_failure_and_logs_once_per_interval(caplog):
    guard = HookGuard(log_interval_s=3600)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            guard.caught("build_connector_meta", ValueError("x"), "skipped")
        guard.caught("wait_for_save", ValueError("y"), "skipped")
    assert guard.failures == {"build_connector_meta": 3, "wait_for_save": 1}
    assert guard.num_failures == 4
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "build_connector_meta failed (ValueError: x)" in lines[0]


def test_claimed_block_ids_cover_the_promised_tokens():
    ids = [10, 11, 12, 13, 14, 15]
    assert claimed_block_ids(ids, 16, 64, 16) == [11, 12, 13, 14]
    assert claimed_block_ids(ids, 0, 8, 16) == [10]  # a partial block is still claimed


def test_a_failing_lookup_is_a_miss_and_the_request_runs(engine_factory, daemon):
    tokens = prompt_of(100, seed=21)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    second.connector.scheduler_side.get_num_new_matched_tokens = boom
    request = second.add(tokens)
    output, meta = second.step()  # no exception out of vLLM's schedule()
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0  # a miss
    assert meta.loads == [] and meta.failed_loads == {}
    assert second.connector.hook_guard.failures["get_num_new_matched_tokens"] == 1
    second.run()
    assert request.is_finished()
    assert pinned_blocks(daemon) == 0


@pytest.mark.parametrize("hook", ["update_state_after_alloc", "build_step"])
def test_a_failure_after_the_hit_was_promised_is_recomputed_not_left_empty(
        engine_factory, daemon, hook):
    """vLLM was promised 96 tokens (6 blocks); the hook that plans their load fails: every
    worker reports the 6 blocks as load errors and vLLM recomputes them (nothing is
    served from blocks that were never filled); the pins of the hit are released."""
    tokens = prompt_of(100, seed=22)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    setattr(second.connector.scheduler_side, hook, boom)
    request = second.add(tokens)
    output, meta = second.step()
    blocks = set(second.block_ids(request)[:6])
    assert meta.loads == [] and set(meta.failed_loads[request.request_id]) == blocks
    assert second.outputs[-1].invalid_block_ids == blocks
    assert request.num_computed_tokens == 0  # vLLM recomputes from the first failed block
    guard_hook = "build_connector_meta" if hook == "build_step" else hook
    assert second.connector.hook_guard.failures[guard_hook] >= 1
    del second.connector.scheduler_side.__dict__[hook]  # the next steps work again
    second.run()
    assert request.is_finished()
    assert pinned_blocks(daemon) == 0


def test_a_failing_worker_load_is_a_load_error_and_saves_nothing(engine_factory, daemon):
    tokens = prompt_of(100, seed=23)
    store_from_another_instance(engine_factory, tokens)
    second = engine_factory()
    second.worker.worker_side.load = boom
    request = second.add(tokens)
    saved_before = second.worker.num_saved_chunks
    output, meta = second.step()
    blocks = set(second.block_ids(request)[:6])
    assert len(meta.loads) == 1
    assert second.outputs[-1].invalid_block_ids == blocks
    assert request.num_computed_tokens == 0
    assert second.worker.hook_guard.failures["start_load_kv"] == 1
    assert second.worker.num_saved_chunks == saved_before
    del second.worker.worker_side.__dict__["load"]
    second.run()
    assert request.is_finished()
    assert pinned_blocks(daemon) == 0  # the step's pins went back with the worker's report


def test_failing_worker_bookkeeping_hooks_never_raise(engine_factory, daemon):
    tokens = prompt_of(70, seed=24)
    engine = engine_factory()
    worker = engine.worker.worker_side
    worker.save = worker.request_finished = worker.take_load_errors = boom
    request = engine.add(tokens)
    engine.run()
    assert request.is_finished()
    failures = engine.worker.hook_guard.failures
    assert failures["wait_for_save"] >= 1 and failures["get_finished"] >= 1
    assert failures["get_block_ids_with_load_errors"] >= 1
