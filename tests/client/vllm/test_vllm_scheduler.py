"""The vLLM connector's scheduler side against a real daemon, without vLLM.

LMCachedConnectorScheduler is vllm-free: it reads vLLM's Request, KVCacheBlocks and
SchedulerOutput through a few attributes, which small stand-ins provide here. What is
checked is protocol v2's promise for the scheduler: one synchronous round trip per
request whatever the TP size (one ACQUIRE over every rank's namespace), pins held from
lookup to load and always given back, and misses (not exceptions) without a daemon.
"""

import time
import types

import numpy as np
import pytest
import torch

from lmcached.client import CacheEngine, KVLayout
from lmcached.client.hashing import tenant_fingerprint
from lmcached.client.vllm.scheduler import LMCachedConnectorScheduler
from lmcached.client.serving.specs import ConnectorSettings

BLOCK_SIZE = 4
CHUNK = 2 * BLOCK_SIZE
TP = 4


def rank_layouts(world_size: int = TP) -> list[KVLayout]:
    return [KVLayout("sched-test", num_layers=2, num_kv_heads=1, head_size=8, dtype="uint8",
                     chunk_size=CHUNK, world_size=world_size, worker_id=rank)
            for rank in range(world_size)]


def make_settings(socket: str, world_size: int = TP) -> ConnectorSettings:
    return ConnectorSettings(layouts=rank_layouts(world_size), chunk_size=CHUNK,
                             block_size=BLOCK_SIZE, world_size=world_size, socket=socket,
                             daemon_name="unused", timeout_s=5.0)


def fake_request(request_id: str, tokens) -> types.SimpleNamespace:
    """The attributes of vllm.v1.request.Request the scheduler side reads."""
    return types.SimpleNamespace(request_id=request_id, prompt_token_ids=list(tokens),
                                 lora_request=None, mm_features=None, cache_salt=None,
                                 num_computed_tokens=0)


def fake_blocks(block_ids) -> types.SimpleNamespace:
    """vLLM's KVCacheBlocks: one KV cache group."""
    return types.SimpleNamespace(get_block_ids=lambda: ([*block_ids],))


def step_output(request) -> types.SimpleNamespace:
    """A SchedulerOutput that schedules the whole prompt of `request`, saving nothing."""
    return types.SimpleNamespace(
        num_scheduled_tokens={request.request_id: len(request.prompt_token_ids)},
        kv_connector_block_state=None)


def store_in_ranks(socket: str, tokens, ranks, cache_salt: str | None = None) -> None:
    """Store `tokens`' chunks in the namespaces of `ranks` (as that many workers would)."""
    layouts = rank_layouts()
    for rank in ranks:
        with CacheEngine.connect(layouts[rank], socket=socket, strict=True) as engine:
            kv = torch.zeros(layouts[rank].chunk_shape(len(tokens)), dtype=torch.uint8)
            engine.store(tokens, kv, cache_salt=cache_salt)


@pytest.fixture
def scheduler(daemon):
    sched = LMCachedConnectorScheduler(make_settings(daemon.socket))
    yield sched
    sched.shutdown()


def test_a_request_costs_one_round_trip_at_tp4_and_its_pins_are_released(scheduler, daemon,
                                                                        monkeypatch):
    tokens = np.arange(1000, 1000 + 5 * CHUNK + 3)  # 5 full chunks and 3 more tokens
    store_in_ranks(daemon.socket, tokens, range(TP))
    sent = []
    request_fn = scheduler._link.request
    monkeypatch.setattr(scheduler._link, "request",
                        lambda msg, *a: sent.append(type(msg).__name__) or request_fn(msg, *a))
    request = fake_request("r1", tokens)
    before = daemon.info()["requests"]
    assert scheduler.get_num_new_matched_tokens(request, 0) == 5 * CHUNK
    assert sent == ["Acquire"]  # one request for the 4 ranks' namespaces
    assert daemon.info()["requests"] - before == 2  # that ACQUIRE, then this INFO
    assert daemon.pins_held() == 5 * TP  # pinned from lookup to load
    scheduler.update_state_after_alloc(request, fake_blocks(range(100, 111)), 5 * CHUNK)
    step, loads, _ = scheduler.build_step(step_output(request))
    assert sent == ["Acquire"]  # the allocation asked nothing more
    (load,) = loads
    assert [len(rank_spans) for rank_spans in load.spans] == [5] * TP
    assert len({tuple(map(tuple, rank_spans)) for rank_spans in load.spans}) == TP
    assert load.block_ids[0] == [100, 101] and load.block_ids[4] == [108, 109]
    scheduler.on_worker_report({step: TP - 1}, {})
    assert daemon.pins_held() == 5 * TP  # one rank has not loaded yet
    scheduler.on_worker_report({step: 1}, {})
    assert sent == ["Acquire", "Release"]  # RELEASE: sent, no reply awaited
    assert daemon.pins_held() == 0


def test_the_hit_is_the_prefix_ready_in_every_rank(scheduler, daemon):
    tokens = np.arange(5 * CHUNK + 1)
    store_in_ranks(daemon.socket, tokens, range(TP))
    store_in_ranks(daemon.socket, np.arange(7 * CHUNK + 1), [0, 1, 2])  # rank 3 lacks 5, 6
    request = fake_request("r", np.arange(7 * CHUNK + 1))
    assert scheduler.get_num_new_matched_tokens(request, 0) == 5 * CHUNK
    assert daemon.pins_held() == 5 * TP
    scheduler.request_finished(request)
    assert daemon.pins_held() == 0


def test_a_retried_lookup_and_an_unscheduled_request_release_their_pins(scheduler, daemon):
    tokens = np.arange(4 * CHUNK + 1)
    store_in_ranks(daemon.socket, tokens, range(TP))
    request = fake_request("r", tokens)
    for _ in range(3):  # vLLM could not allocate: it asks again next step
        assert scheduler.get_num_new_matched_tokens(request, 0) == 4 * CHUNK
        assert daemon.pins_held() == 4 * TP
    # vLLM's own cache holds the first 2 chunks now: the lookup starts after them
    assert scheduler.get_num_new_matched_tokens(request, 2 * CHUNK) == 2 * CHUNK
    assert daemon.pins_held() == 2 * TP
    scheduler.update_state_after_alloc(request, fake_blocks(range(9)), 0)  # takes none
    assert daemon.pins_held() == 0
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.request_finished(request)  # finished (aborted) before it was allocated
    assert daemon.pins_held() == 0


def test_an_allocation_for_another_prefix_acquires_it(scheduler, daemon):
    tokens = np.arange(4 * CHUNK + 1)
    store_in_ranks(daemon.socket, tokens, range(TP))
    request = fake_request("r", tokens)
    assert scheduler.get_num_new_matched_tokens(request, 0) == 4 * CHUNK
    # vLLM's local hit grew between the lookup and the allocation (another request)
    scheduler._requests["r"].num_local_tokens = CHUNK
    scheduler.update_state_after_alloc(request, fake_blocks(range(9)), 3 * CHUNK)
    assert daemon.pins_held() == 3 * TP  # the lookup's 4 chunks were released
    step, (load,), _ = scheduler.build_step(step_output(request))
    assert load.first_chunk == 1 and [len(s) for s in load.spans] == [3] * TP
    scheduler.on_worker_report({step: TP}, {})
    assert daemon.pins_held() == 0


def test_without_a_daemon_every_lookup_is_a_miss(short_tmp):
    scheduler = LMCachedConnectorScheduler(make_settings(f"{short_tmp}/none.sock"))
    try:
        request = fake_request("r", np.arange(3 * CHUNK + 1))
        assert scheduler.get_num_new_matched_tokens(request, 0) == 0
        scheduler.update_state_after_alloc(request, fake_blocks(range(7)), 0)
        scheduler.request_finished(request)
    finally:
        scheduler.shutdown()


def wait_for_pins(daemon, expected: int, deadline_s: float = 10.0) -> int:
    deadline = time.monotonic() + deadline_s
    while (held := daemon.pins_held()) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return held


@pytest.mark.parametrize("lost", ["before_alloc", "before_step"])
def test_a_load_sent_to_the_workers_names_only_blocks_pinned_now(scheduler, daemon, lost):
    # The scheduler's session ends (a timed-out request drops it) between the lookup and
    # the allocation, or between the allocation and the step: the daemon releases its
    # pins, so the blocks the plan names may be handed to another writer. The load the
    # workers get must name blocks pinned in the scheduler's open session.
    tokens = np.arange(3 * CHUNK + 1)
    store_in_ranks(daemon.socket, tokens, range(TP))
    request = fake_request("r", tokens)
    assert scheduler.get_num_new_matched_tokens(request, 0) == 3 * CHUNK
    if lost == "before_alloc":
        scheduler._link.mark_down("test: a request timed out")
        assert wait_for_pins(daemon, 0) == 0
        time.sleep(0.1)  # past the link's first back-off: it may reconnect
    scheduler.update_state_after_alloc(request, fake_blocks(range(7)), 3 * CHUNK)
    if lost == "before_step":
        scheduler._link.mark_down("test: a request timed out")
        assert wait_for_pins(daemon, 0) == 0
        time.sleep(0.1)  # past the link's first back-off: it may reconnect
    step, (load,), _ = scheduler.build_step(step_output(request))
    assert scheduler.num_stale_pins == 1
    session = scheduler._link.hello_reply
    assert load.generations == [session.generation] * TP
    assert [len(spans) for spans in load.spans] == [3] * TP
    assert daemon.pins_held() == 3 * TP  # every block of the plan, pinned now
    scheduler.on_worker_report({step: TP}, {})
    assert wait_for_pins(daemon, 0) == 0


def test_a_salted_request_matches_its_own_salt_only(scheduler, daemon):
    tokens = np.arange(3000, 3000 + 4 * CHUNK + 1)
    store_in_ranks(daemon.socket, tokens, range(TP), cache_salt="tenant-a")
    matched = {}
    for salt in ("tenant-a", "tenant-b", None):
        request = fake_request(f"req-{salt}", tokens)
        request.cache_salt = salt
        matched[salt] = scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.request_finished(request)
    assert matched == {"tenant-a": 4 * CHUNK, "tenant-b": 0, None: 0}
    fields = daemon.info()
    assert (fields["salted_hits"], fields["salted_misses"]) == (4 * TP, 4 * TP)
    a, b = (tenant_fingerprint(salt).hex() for salt in ("tenant-a", "tenant-b"))
    assert (fields[f"tenant_{a}_hits"], fields[f"tenant_{a}_misses"]) == (4 * TP, 0)
    assert (fields[f"tenant_{b}_hits"], fields[f"tenant_{b}_misses"]) == (0, 4 * TP)
    assert (fields["tenant_unsalted_hits"], fields["tenant_unsalted_misses"]) == (0, 4 * TP)
    assert daemon.pins_held() == 0
