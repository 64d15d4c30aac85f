"""KV events through vLLM's `take_events()` hook (docs/kv-events.md): an instance announces,
in its own block hashes, the chunks another instance stored in the daemon, and their
removal after a CLEAR, never `AllBlocksCleared`."""

import time

import pytest

from test_vllm_connector import (
    BLOCK,
    CHUNK,
    create_kv_cache_config,
    create_vllm_config,
    engine_factory,  # noqa: F401 (a fixture)
    model_dir,  # noqa: F401 (a fixture)
    prompt_of,
    store_from_another_instance,
)

pytestmark = pytest.mark.vllm

from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from lmcached.client.vllm.connector import LMCachedConnector  # noqa: E402
from lmcached.wire.connection import Connection  # noqa: E402
from lmcached.wire.protocol import Clear  # noqa: E402


def events_instance(model_dir: str, socket: str, empty: bool = True) -> LMCachedConnector:
    """A scheduler-side connector of an instance started with --kv-events-config
    (`empty`: the daemon holds nothing yet, so its first step announces nothing)."""
    init_none_hash(sha256)
    vllm_config = create_vllm_config(model_dir, socket, kv_events_interval_s=0)
    vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True,
                                                  publisher="null")
    connector = LMCachedConnector(vllm_config, KVConnectorRole.SCHEDULER,
                                  create_kv_cache_config())
    assert connector.event_relay is not None
    if empty:
        assert connector.take_events() == []  # subscribes
    return connector


def take_until(connector, predicate, timeout_s: float = 10.0) -> list:
    events = []
    deadline = time.monotonic() + timeout_s
    while not predicate(events):
        assert time.monotonic() < deadline, events
        events.extend(connector.take_events())
        time.sleep(0.01)
    return events


def own_block_hashes(prompt: list[int], cache_salt: str | None = None) -> list:
    """The block hashes vLLM's own prefix cache computes for `prompt` (published form)."""
    params = SamplingParams(max_tokens=1)
    request = Request(request_id="mine", prompt_token_ids=list(prompt), sampling_params=params,
                      pooling_params=None, mm_features=None, cache_salt=cache_salt,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


def test_an_instance_announces_what_another_stored_in_its_own_block_hashes(
        model_dir, engine_factory, daemon):
    listener = events_instance(model_dir, daemon.socket)
    try:
        prompt = prompt_of(100, seed=11)
        store_from_another_instance(engine_factory, prompt)  # 3 full chunks of 32
        stored = take_until(listener, lambda e: len(e) >= 3)
        assert all(isinstance(e, BlockStored) for e in stored)
        assert [e.medium for e in stored] == ["CPU"] * 3
        assert all(e.block_size == BLOCK for e in stored)
        expected = own_block_hashes(prompt)[:3 * CHUNK // BLOCK]
        assert [h for e in stored for h in e.block_hashes] == expected
        assert [t for e in stored for t in e.token_ids] == prompt[:3 * CHUNK]
        assert stored[0].parent_block_hash is None
        assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
        with Connection(daemon.socket) as admin:
            admin.request(Clear())
        removed = take_until(listener, lambda e: len(e) >= 3)
        assert not any(isinstance(e, AllBlocksCleared) for e in removed)
        assert all(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in removed)
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(expected)
        assert listener.event_relay.num_announced_chunks == 0
    finally:
        listener.shutdown()


def test_an_instance_started_after_the_store_announces_what_the_daemon_holds(
        model_dir, engine_factory, daemon):
    """Instance A stored a prompt before instance B started: B's first steps announce
    it (the daemon's snapshot), in B's block hashes, each block once."""
    prompt = prompt_of(100, seed=13)
    store_from_another_instance(engine_factory, prompt)  # 3 full chunks of 32
    listener = events_instance(model_dir, daemon.socket, empty=False)
    try:
        stored = take_until(listener, lambda e: len(e) >= 3)
        expected = own_block_hashes(prompt)[:3 * CHUNK // BLOCK]
        assert [h for e in stored for h in e.block_hashes] == expected
        assert [e.medium for e in stored] == ["CPU"] * 3
        assert stored[0].parent_block_hash is None
        assert listener.take_events() == []  # announced once
        assert listener.event_relay.stats["snapshot"] == 3
    finally:
        listener.shutdown()


def salted_request(prompt: list[int], salt: str, request_id: str) -> Request:
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, mm_features=None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def test_a_salted_prompt_is_announced_with_the_salt_as_vllm_folds_it(
        model_dir, engine_factory, daemon):
    """The listener served tenant-a (its lookup noted the salt): tenant-a's chunks are
    announced with the salt in the first block's extra keys and vLLM's salted hashes;
    tenant-b's, whose salt it never saw, are not announced, and counted."""
    listener = events_instance(model_dir, daemon.socket)
    try:
        prompt = prompt_of(64, seed=12)
        listener.get_num_new_matched_tokens(salted_request(prompt, "tenant-a", "seen"), 0)
        first = engine_factory()
        first.scheduler.add_request(salted_request(prompt, "tenant-a", "a"))
        first.run()
        stored = take_until(listener, lambda e: len(e) >= 2)
        assert [h for e in stored for h in e.block_hashes] == own_block_hashes(prompt, "tenant-a")
        assert [h for e in stored for h in e.block_hashes] != own_block_hashes(prompt)
        assert stored[0].extra_keys == [("tenant-a",), None]
        assert stored[1].extra_keys is None
        first.scheduler.add_request(salted_request(prompt, "tenant-b", "b"))
        first.run()
        deadline = time.monotonic() + 10
        while listener.event_relay.stats["unresolved_salt"] < 1:
            assert listener.take_events() == []
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        listener.shutdown()
