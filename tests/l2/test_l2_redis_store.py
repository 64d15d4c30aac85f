"""The L2 store on real Redis servers (lmcached/daemon/l2/redis_store.py).

Standalone and 3-master cluster servers are started by the fixtures of redis_servers.py
(killed by pid after each test). What is asserted: bytes that come back equal the bytes
written, in order, from several threads at once; keys land on every master of a
cluster; TTLs reach Redis; a full Redis refuses SETs that are counted, not raised; a
killed or silent server is an L2Unavailable, then back-off refuses calls without
touching the network (checked with the server back up), then one probe reconnects.
The back-off's clock is replaced by a fake one where time matters, so nothing here
depends on how fast the machine is.
"""

import statistics
import threading
import time

import numpy as np
import psutil
import pytest

from lmcached.daemon.l2 import redis_store
from lmcached.daemon.l2.redis_store import L2Unavailable, RedisL2, parse_l2_url
from lmcached.daemon.l2.values import l2_key
from lmcached.wire.record_format import ROOT_HASH, hash_block_tokens
from redis_servers import command, running_redis

FP = bytes(range(16))
SERVERS = ["redis_server", "redis_cluster"]
NO_ERRORS = dict.fromkeys(redis_store.ERROR_KINDS, 0)


def chain_keys(num: int, start: int = 0) -> list[bytes]:
    """The L2 keys of `num` chained chunks (as a prompt's chunks are keyed)."""
    keys, parent = [], ROOT_HASH
    for i in range(start, start + num):
        parent = hash_block_tokens(parent, np.arange(16 * i, 16 * i + 16, dtype="<i8"))
        keys.append(l2_key(FP, parent))
    return keys


def payload(num_bytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(num_bytes)


def store_for(servers, **kwargs) -> RedisL2:
    kwargs.setdefault("ttl_s", None)
    return RedisL2(parse_l2_url(servers.url), **kwargs)


class FakeClock:
    """The back-off's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------------ URLs
def test_parse_l2_url_accepts_servers_in_order():
    assert parse_l2_url("redis://10.0.0.5:6379") == [("10.0.0.5", 6379)]
    assert parse_l2_url("valkey://a:1,b:2,[::1]:7000") == [("a", 1), ("b", 2), ("::1", 7000)]


@pytest.mark.parametrize("url, fix", [
    ("http://h:1", "redis://HOST:PORT"), ("redis://h", "HOST:PORT"), ("redis://h:0", "1..65535"),
    ("redis://h:x", "HOST:PORT"), ("redis://:6379", "HOST:PORT"), ("redis://h:1,", "HOST:PORT"),
    ("redis://:pw@h:1", "credentials"), ("redis://h:1/0", "database"),
    ("redis://h:1,h:1", "listed twice")])
def test_parse_l2_url_refuses_anything_else_with_the_fix(url, fix):
    with pytest.raises(ValueError, match=fix.replace(".", r"\.")):
        parse_l2_url(url)


@pytest.mark.parametrize("kwargs", [{"addresses": []}, {"ttl_s": 0}, {"timeout_s": 0}])
def test_store_refuses_bad_arguments(kwargs):
    args = {"addresses": [("127.0.0.1", 1)], "ttl_s": None, **kwargs}
    with pytest.raises(ValueError):
        RedisL2(args.pop("addresses"), **args)


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("servers", SERVERS)
def test_round_trip_of_small_and_large_values(servers, request):
    servers = request.getfixturevalue(servers)
    store = store_for(servers)
    assert (store.mode, store.state) == ("unknown", "unknown"), "no connection in __init__"
    keys = chain_keys(26)
    values = [payload(4 << 20 if i in (3, 17) else 1024, i) for i in range(len(keys))]
    items = list(zip(keys, values))
    items[5] = (keys[5], memoryview(values[5]))  # memoryviews are sent as they are
    assert store.set_many(items) == len(keys)
    assert store.mode == ("cluster" if servers.cluster else "standalone")
    assert store.state == "up"
    missing = l2_key(FP, b"\xee" * 16)
    got = store.get_many(keys[:10] + [missing] + keys[10:])
    assert got[10] is None
    assert got[:10] + got[11:] == values
    assert store.exists_prefix(keys) == len(keys)
    assert store.errors == NO_ERRORS
    if servers.cluster:  # no hash tag: a prompt's chunks spread over every master
        per_node = [servers.node_client(i).dbsize() for i in range(3)]
        assert all(per_node) and sum(per_node) == len(keys), per_node
    assert store.set_many([]) == 0 and store.get_many([]) == [] and store.exists_prefix([]) == 0
    store.close()


def test_ttl_reaches_redis_as_milliseconds(redis_server):
    client = redis_server.client()
    key_30s, key_half_s, key_none = chain_keys(3)
    assert store_for(redis_server, ttl_s=30).set_many([(key_30s, b"v")]) == 1
    assert store_for(redis_server, ttl_s=0.5).set_many([(key_half_s, b"v")]) == 1
    assert store_for(redis_server, ttl_s=None).set_many([(key_none, b"v")]) == 1
    assert 0 < client.pttl(key_30s) <= 30_000
    assert 0 < client.pttl(key_half_s) <= 500
    assert client.pttl(key_none) == -1  # exists, no expiry


def test_exists_prefix_stops_at_the_first_missing_key(redis_server):
    store = store_for(redis_server)
    keys = chain_keys(6)
    assert store.set_many([(k, b"v") for i, k in enumerate(keys) if i != 3]) == 5
    assert store.exists_prefix(keys) == 3, "keys 4 and 5 exist but follow a gap"
    assert store.exists_prefix(keys[3:]) == 0
    assert store.exists_prefix(keys[:3]) == 3


def test_value_lengths_are_strlen_and_0_for_missing_keys(redis_server):
    store = store_for(redis_server)
    keys = chain_keys(4)
    assert store.set_many([(keys[0], b"v" * 10), (keys[2], b"w" * 70000)]) == 2
    assert store.value_lengths(keys) == [10, 0, 70000, 0]
    assert store.value_lengths([]) == []


def test_a_full_redis_refuses_sets_that_are_counted_not_raised(redis_server):
    redis_server.client().config_set("maxmemory-policy", "noeviction")
    redis_server.client().config_set("maxmemory", "1mb")
    store = store_for(redis_server)
    keys = chain_keys(8)
    values = [payload(256 << 10, i) for i in range(8)]
    stored = store.set_many(list(zip(keys, values)))
    assert stored < 8
    assert store.errors == {**NO_ERRORS, "full": 8 - stored}
    assert store.state == "up", "a full L2 is not an outage"
    got = store.get_many(keys)
    assert sum(v is not None for v in got) == stored
    assert all(v == values[i] for i, v in enumerate(got) if v is not None)


# --------------------------------------------------------------------- outages
@pytest.mark.parametrize("servers", SERVERS)
def test_killed_servers_are_unavailable_then_back_after_the_backoff(servers, request):
    servers = request.getfixturevalue(servers)
    store = store_for(servers)
    keys = chain_keys(12)
    assert store.set_many([(k, b"v") for k in keys]) == len(keys)
    servers.stop()
    with pytest.raises(L2Unavailable):
        store.get_many(keys)
    assert store.state == "down" and store.errors["connection"] == 1
    servers.start()  # empty: nothing is saved
    deadline = time.monotonic() + 20
    while True:
        try:
            assert store.get_many(keys) == [None] * len(keys)
            break
        except L2Unavailable:
            assert time.monotonic() < deadline, "no reconnect within 20 s"
            time.sleep(0.02)
    assert store.state == "up" and store.num_reconnects == 1
    assert store.set_many([(k, b"w") for k in keys]) == len(keys)
    assert store.get_many(keys) == [b"w"] * len(keys)


def test_calls_during_backoff_fail_fast_without_the_network(redis_server, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(redis_store, "_now", clock)
    store = store_for(redis_server)
    keys = chain_keys(4)
    assert store.set_many([(k, b"v") for k in keys]) == 4
    redis_server.stop()
    with pytest.raises(L2Unavailable):
        store.set_many([(keys[0], b"x")])
    redis_server.start()  # the server answers again, but the store is backing off
    assert command(redis_server.ports[0], "PING") == b"PONG"
    durations = []
    for call in (lambda: store.get_many(keys), lambda: store.exists_prefix(keys),
                 lambda: store.set_many([(keys[0], b"x")])) * 4:
        started = time.perf_counter()
        with pytest.raises(L2Unavailable, match="next try in 0.10 s"):
            call()
        durations.append(time.perf_counter() - started)
    assert statistics.median(durations) < 0.05
    # Had any of them reached the server, it would have succeeded (and reconnected).
    assert store.errors["connection"] == 1 and store.num_reconnects == 0
    assert command(redis_server.ports[0], "DBSIZE") == b"0"
    clock.now += redis_store.BACKOFF_MIN_S
    assert store.get_many(keys) == [None] * 4
    assert (store.state, store.num_reconnects) == ("up", 1)


def test_backoff_doubles_up_to_its_cap_and_resets_after_a_success(redis_server, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(redis_store, "_now", clock)
    store = store_for(redis_server)
    redis_server.stop()
    waits = [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    for probe, wait_s in enumerate(waits, start=1):
        with pytest.raises(L2Unavailable, match="Connection refused|connecting"):
            store.exists_prefix([b"k"])  # the first call or a probe: the network
        assert store.errors["connection"] == probe
        failed_at = clock.now
        clock.now = failed_at + wait_s - 0.001
        with pytest.raises(L2Unavailable, match="next try in 0.00 s"):
            store.exists_prefix([b"k"])  # still backing off: no network, not counted
        assert store.errors["connection"] == probe
        clock.now = failed_at + wait_s
    redis_server.start()
    assert store.exists_prefix([b"k"]) == 0
    assert store.num_reconnects == 1
    redis_server.stop()
    with pytest.raises(L2Unavailable):
        store.exists_prefix([b"k"])
    clock.now += 0.1  # reset to the first wait by the success
    redis_server.start()
    assert store.exists_prefix([b"k"]) == 0 and store.num_reconnects == 2


def test_a_silent_server_is_a_timeout_and_one_probe_at_a_time(redis_server, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(redis_store, "_now", clock)
    store = store_for(redis_server, timeout_s=0.3)
    assert store.set_many([(b"k", b"v")]) == 1
    pause = redis_server.client()
    pause.client_pause(600)  # Redis stops answering clients for 0.6 s
    with pytest.raises(L2Unavailable, match="Timeout"):
        store.get_many([b"k"])
    assert (store.state, store.errors["timeout"]) == ("down", 1)
    time.sleep(0.6)
    store = store_for(redis_server, timeout_s=5.0)
    redis_server.stop()
    with pytest.raises(L2Unavailable):
        store.get_many([b"k"])
    redis_server.start()
    redis_server.client().client_pause(1000)
    clock.now += 1.0
    probe = threading.Thread(target=store.get_many, args=([b"k"],))
    probe.start()  # blocks until the pause ends
    deadline = time.monotonic() + 10
    while not store._probing:  # the probe is in flight
        assert time.monotonic() < deadline and probe.is_alive()
        time.sleep(0.005)
    started = time.perf_counter()
    with pytest.raises(L2Unavailable, match="down"):
        store.get_many([b"k"])
    assert time.perf_counter() - started < 0.05, "a second caller waits for no probe"
    probe.join(10)
    assert (store.state, store.num_reconnects) == ("up", 1)


def test_several_addresses_of_a_standalone_server_is_a_config_error(redis_server):
    store = RedisL2([("127.0.0.1", redis_server.ports[0]), ("127.0.0.1", 1)], ttl_s=None)
    for _ in range(2):  # detected once, then refused without the network
        with pytest.raises(ValueError, match="only for a cluster"):
            store.get_many([b"k"])
    assert store.mode == "unknown"


def test_nothing_listening_is_unavailable_and_closed_stores_refuse(redis_server):
    port = redis_server.ports[0]
    redis_server.stop()
    store = RedisL2([("127.0.0.1", port)], ttl_s=None)
    with pytest.raises(L2Unavailable):
        store.set_many([(b"k", b"v")])
    assert (store.mode, store.state, store.errors["connection"]) == ("unknown", "down", 1)
    store.close()
    with pytest.raises(L2Unavailable, match="closed"):
        store.get_many([b"k"])


# --------------------------------------------------------------------- threads
@pytest.mark.parametrize("servers", SERVERS)
def test_threads_sharing_one_store_get_their_own_bytes(servers, request):
    servers = request.getfixturevalue(servers)
    store = store_for(servers)
    failures: list[str] = []

    def worker(thread_id: int) -> None:
        try:
            for step in range(12):
                keys = chain_keys(8, start=1000 * thread_id + 10 * step)
                values = [payload(1024 + 997 * i * (thread_id + 1), thread_id * 100 + step + i)
                          for i in range(8)]
                if store.set_many(list(zip(keys, values))) != 8:
                    failures.append(f"thread {thread_id} step {step}: not all stored")
                if store.get_many(keys) != values or store.exists_prefix(keys) != 8:
                    failures.append(f"thread {thread_id} step {step}: other bytes came back")
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            failures.append(f"thread {thread_id}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == []
    assert store.errors == NO_ERRORS
    assert store.num_reconnects == 0


# --------------------------------------------------------------------- fixtures
def test_servers_are_killed_by_the_finalizer_even_when_the_test_fails(tmp_path):
    with pytest.raises(RuntimeError, match="the test failed"):
        with running_redis(str(tmp_path), cluster=False) as servers:
            pids, port = servers.pids, servers.ports[0]
            assert len(pids) == 1 and psutil.Process(pids[0]).is_running()
            raise RuntimeError("the test failed")
    assert not any(psutil.pid_exists(pid) for pid in pids), "redis-server left running"
    with pytest.raises(OSError):
        command(port, "PING")
