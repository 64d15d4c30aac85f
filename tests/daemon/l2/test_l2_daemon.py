"""The L2 tier end to end: real daemons, real worker processes, real Redis servers.

Node A (a daemon and its workers) stores prompts; node B (a second daemon with its own
arena, same L2) and a restarted A serve them bit-exact from L2. Redis is stopped and
restarted under running daemons, values are tampered with in Redis, and the counters of
INFO `l2` must say what happened. docs/l2.md describes the behaviour.
"""

import contextlib
import os
import socket as socketlib
import threading
import time

import pytest
import torch

from engine_worker import prompt_kv, small_layout
from raw_frames import connect, recv_reply
from test_engine_multiprocess import run_worker
from test_cli import run_cli
from test_limits import wait_for
from lmcached.client import CacheEngine, KVLayout, hash_request_tokens
from lmcached.daemon.l2.values import l2_key
from lmcached.daemon.spill.envelope import encode_value, namespace_fingerprint
from lmcached.wire.connection import Connection
from lmcached.wire.frames import encode_frame
from lmcached.wire.protocol import PROTOCOL_VERSION, Hello, Info, Lookup, LookupReply, Ok, Ping

pytestmark = pytest.mark.slow

# Workers wait up to 10 s for a reply, and daemons up to 5 s for a fetch: the chunks
# come back whole however loaded the machine is (the default wait, 0.1 s, is for serving).
WORKER_ENV = {**os.environ, "LMCACHED_DATA_TIMEOUT_MS": "10000"}
FETCH_WAIT = ("--l2-fetch-wait", "5")
ARENA = ("--capacity", "16MiB", "--block-size", "64KiB")
NUM_CHUNKS = 7  # 100 tokens of chunk size 16


def l2_info(daemon) -> dict:
    with Connection(daemon.socket) as conn:
        return conn.request(Info("l2")).sections["l2"]


def wait_written(daemon, count: int) -> dict:
    """Wait until `count` chunks were written and nothing is queued or pinned for L2."""
    def done():
        info = daemon.info()
        return info if info["l2_writes"] >= count and info["l2_queue_values"] == 0 else None
    info = wait_for(done, what=f"{count} L2 writes", timeout_s=20)
    assert info["pinned_blocks"] == 0, "written chunks must be unpinned"
    return info


def store(daemon, start: int = 0, length: int = 100) -> None:
    assert run_worker("store", daemon.socket, start, length, 0, 1, env=WORKER_ENV) == {
        "stored": -(-length // 16)}


def retrieve(daemon, start: int = 0, length: int = 100) -> dict:
    return run_worker("retrieve", daemon.socket, start, length, 0, 1, env=WORKER_ENV)


def chunk_keys(start: int = 0, length: int = 100, layout: KVLayout | None = None) -> list[bytes]:
    """The L2 keys of a prompt's chunks, as any node computes them."""
    layout = layout or small_layout()
    fp = namespace_fingerprint(layout.to_wire())
    return [l2_key(fp, h) for h in hash_request_tokens(layout.chunk_size,
                                                       list(range(start, start + length)))]


@pytest.mark.parametrize("servers", ["redis_server", "redis_cluster"])
def test_node_b_and_a_restarted_serve_node_a_prompt_bit_exact(request, servers, daemon_factory):
    l2 = request.getfixturevalue(servers)
    node_a = daemon_factory(*ARENA, "--l2", l2.url, *FETCH_WAIT)
    store(node_a)
    info = wait_written(node_a, NUM_CHUNKS)
    assert info["l2_write_drops_queue_full"] == info["l2_write_drops_down"] == 0
    client = l2.client()
    assert all(client.exists(key) for key in chunk_keys())
    name_a = node_a.name
    node_a.stop()
    restarted_a = daemon_factory(*ARENA, "--l2", l2.url, *FETCH_WAIT, name=name_a)
    node_b = daemon_factory(*ARENA, "--l2", l2.url, *FETCH_WAIT)
    for daemon in (node_b, restarted_a):
        assert daemon.info()["cached_values"] == 0  # an empty arena: every hit is from L2
        assert retrieve(daemon) == {"hit": 100, "mismatches": 0}
        info = daemon.info()
        assert info["l2_fetch_hit_chunks"] == NUM_CHUNKS
        assert info["l2_fetch_bytes"] > 0 and info["pinned_blocks"] == 0
        assert not [k for k, v in info.items() if k.startswith("l2_fetch_verify_") and v]
        # Served from the arena now: no second fetch.
        assert retrieve(daemon) == {"hit": 100, "mismatches": 0}
        assert daemon.info()["l2_fetch_hit_chunks"] == NUM_CHUNKS


def test_l2_killed_mid_run_is_misses_then_hits_again(redis_server, daemon_factory):
    node_a = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    node_b = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    store(node_a, 0)
    wait_written(node_a, NUM_CHUNKS)
    redis_server.stop()
    # Workers go on: stores succeed, lookups miss at once, nothing raises.
    store(node_a, 1000)
    assert retrieve(node_b, 0) == {"hit": 0, "mismatches": 0}
    info_a, info_b = l2_info(node_a), l2_info(node_b)
    # A lookup must not wait out its fetch (--l2-fetch-wait) on a dead L2: the daemon
    # counts each wait that ran out, whatever the time the worker took to start.
    assert info_b["l2_fetch_waits_timed_out"] == 0, info_b
    assert info_a["l2_state"] == "down" and info_b["l2_state"] == "down"
    assert info_a["l2_write_drops_down"] >= 1
    assert info_b["l2_fetch_down"] + info_b["l2_fetches_skipped"] >= 1
    assert sum(v for k, v in info_a.items() if k.startswith("l2_errors_")) >= 1
    assert node_a.info()["pinned_blocks"] == 0  # dropped writes leave no pin behind

    redis_server.start()  # empty: it keeps nothing on disk
    # The daemons reconnect after their back-off (at most 5 s): new stores reach L2 again.
    start = 2000

    def stored_again():
        nonlocal start
        start += 1000
        store(node_a, start)
        return l2_info(node_a)["l2_writes"] > NUM_CHUNKS
    wait_for(stored_again, what="writes after Redis came back", timeout_s=60)
    wait_written(node_a, l2_info(node_a)["l2_writes"])
    # Node B's own back-off may still hold it for a moment: its next lookups hit.
    wait_for(lambda: retrieve(node_b, start) == {"hit": 100, "mismatches": 0},
             what="node B to fetch from Redis again", timeout_s=60)
    info_b = l2_info(node_b)
    assert info_b["l2_state"] == "up" and info_b["l2_fetch_hit_chunks"] == NUM_CHUNKS
    assert info_b["l2_reconnects"] >= 1


def _replace_value(client, key: bytes, value: bytes) -> None:
    ttl = client.pttl(key)
    client.set(key, value, px=ttl if ttl > 0 else None)


@pytest.mark.parametrize("tamper", ["kv_byte", "foreign_namespace", "other_tokens"])
def test_tampered_or_foreign_values_are_counted_misses(redis_server, daemon_factory, tamper):
    node_a = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    store(node_a, 0)
    rank0_of_2 = small_layout(0, 2)
    tokens = list(range(100))
    with CacheEngine.connect(rank0_of_2, socket=node_a.socket, strict=True) as engine:
        assert engine.store(tokens, prompt_kv(rank0_of_2, tokens)) == NUM_CHUNKS
    store(node_a, 5000)  # another prompt, same namespace
    wait_written(node_a, 3 * NUM_CHUNKS)
    client = redis_server.client()
    keys = chunk_keys()
    bad = 3  # chunks 0..2 stay good
    if tamper == "kv_byte":  # one byte of the KV payload, at the end of the value
        value = bytearray(client.get(keys[bad]))
        value[-1] ^= 0xFF
        _replace_value(client, keys[bad], bytes(value))
        reason = "checksum"
    elif tamper == "foreign_namespace":  # rank 0 of 2's value of the same chunk
        _replace_value(client, keys[bad], client.get(chunk_keys(layout=rank0_of_2)[bad]))
        reason = "foreign"
    else:  # a valid envelope around another prompt's record: only the tokens can tell
        other = client.get(chunk_keys(5000)[bad])
        record = other[64:]
        fp = namespace_fingerprint(small_layout().to_wire())
        chunk_hash = hash_request_tokens(16, tokens)[bad]
        _replace_value(client, keys[bad], encode_value(fp, chunk_hash, [record]))
        reason = "tokens"
    node_b = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    assert retrieve(node_b) == {"hit": bad * 16, "mismatches": 0}
    info = l2_info(node_b)
    assert info[f"l2_fetch_verify_{reason}"] == 1
    assert info["l2_fetch_hit_chunks"] == bad
    # Never installed: a second lookup fetches again and fails again, still a miss.
    assert retrieve(node_b) == {"hit": bad * 16, "mismatches": 0}
    assert l2_info(node_b)[f"l2_fetch_verify_{reason}"] == 2


def test_on_evict_spills_only_evicted_chunks_and_fetches_them_back(redis_server, daemon_factory):
    # 1 MiB arena of 64 KiB blocks: 15 blocks, one chunk each.
    daemon = daemon_factory("--capacity", "1MiB", "--block-size", "64KiB", "--l2",
                            redis_server.url, "--l2-policy", "on-evict", *FETCH_WAIT)
    client = redis_server.client()
    store(daemon, 0)
    store(daemon, 1000)
    assert not any(client.exists(k) for k in chunk_keys(0) + chunk_keys(1000)), \
        "on-evict writes nothing before pressure"
    store(daemon, 2000)  # 21 chunks > 15 blocks: the least recently used are evicted
    info = wait_for(lambda: (lambda i: i if i["l2_writes"] >= 6 and not i["l2_queue_values"]
                             else None)(daemon.info()), what="spills", timeout_s=20)
    assert info["evictions"] == info["l2_writes"]
    spilled = [k for k in chunk_keys(0) if client.exists(k)]
    assert len(spilled) == info["l2_writes"] and not any(
        client.exists(k) for k in chunk_keys(2000)), "only evicted chunks are written"
    assert retrieve(daemon, 0) == {"hit": 100, "mismatches": 0}
    assert daemon.info()["l2_fetch_hit_chunks"] == len(spilled)


def test_a_parked_lookup_never_blocks_other_clients(redis_server, daemon_factory):
    daemon = daemon_factory(*ARENA, "--l2", redis_server.url, "--l2-fetch-wait", "1.5")
    layout = small_layout()
    tokens = list(range(100))
    engine = CacheEngine.connect(layout, socket=daemon.socket, strict=True, data_timeout_s=10)
    try:
        assert engine.lookup(tokens) == 0  # Redis answers: a plain miss
        redis_server.client().client_pause(3000)  # Redis stops answering for 3 s
        result = {}
        lookup = threading.Thread(target=lambda: result.setdefault("hit", engine.lookup(
            list(range(7000, 7100)))))
        started = time.monotonic()
        lookup.start()
        time.sleep(0.3)
        with Connection(daemon.socket) as other:
            other.request(Ping())  # answered while the lookup waits for Redis
            assert lookup.is_alive(), "the lookup should still wait for its fetch"
        lookup.join(timeout=10)
        assert result == {"hit": 0}
        assert time.monotonic() - started >= 1.4  # it waited --l2-fetch-wait
        assert l2_info(daemon)["l2_fetch_waits_timed_out"] == 1
    finally:
        engine.close()


def test_a_full_queue_drops_writes_and_never_slows_stores(redis_server, daemon_factory):
    # 512 KiB chunks through a 1 MiB queue while Redis refuses to answer.
    layout = KVLayout("big-chunks", num_layers=4, num_kv_heads=8, head_size=64, chunk_size=64)
    daemon = daemon_factory("--capacity", "64MiB", "--l2", redis_server.url,
                            "--l2-queue", "1MiB")
    redis_server.client().client_pause(2000)
    tokens = list(range(1024))
    kv = torch.randn(layout.chunk_shape(1024)).to(layout.torch_dtype)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True,
                             data_timeout_s=10) as engine:
        assert engine.store(tokens, kv) == 16  # every store succeeds
        info = l2_info(daemon)
        assert info["l2_write_drops_queue_full"] >= 14  # at most 2 chunks fit in the queue
        assert info["l2_queue_bytes"] <= 1 << 20
        kv_back, mask = engine.retrieve(tokens, return_tuple=False)
        assert int(mask.sum()) == 1024 and torch.equal(kv_back, kv)
    info = wait_for(lambda: (lambda i: i if i["l2_queue_values"] == 0 else None)(daemon.info()),
                    what="the queue to drain", timeout_s=20)
    assert info["pinned_blocks"] == 0


def test_l2_down_at_start_is_not_an_error(redis_server, daemon_factory):
    redis_server.stop()
    daemon = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    store(daemon, 0)
    assert retrieve(daemon, 0) == {"hit": 100, "mismatches": 0}
    assert retrieve(daemon, 500) == {"hit": 0, "mismatches": 0}
    info = l2_info(daemon)
    assert info["l2_state"] == "down" and info["l2_writes"] == 0
    assert daemon.info()["pinned_blocks"] == 0


@contextlib.contextmanager
def session_on_paused_redis(daemon, redis_server):
    """A raw socket with a HELLO done, then Redis paused for 2 s: yields (socket, ns)."""
    with connect(daemon.socket) as sock:
        sock.sendall(encode_frame(Hello(PROTOCOL_VERSION, os.getpid(), "raw",
                                        [small_layout().to_wire()])))
        ns = recv_reply(sock).namespaces[0]
        redis_server.client().client_pause(2000)
        yield sock, ns


def test_frames_after_a_parked_request_are_answered_after_it(redis_server, daemon_factory):
    daemon = daemon_factory(*ARENA, "--l2", redis_server.url, "--l2-fetch-wait", "1")
    with session_on_paused_redis(daemon, redis_server) as (sock, ns):
        # One write, two requests: the LOOKUP waits for its fetch, the PING behind it too.
        sock.sendall(encode_frame(Lookup([ns], b"\1" * 32)) + encode_frame(Ping()))
        assert recv_reply(sock) == LookupReply(0)
        assert recv_reply(sock) == Ok()


def test_l2_metrics_equal_info_l2(redis_server, daemon_factory):
    from test_metrics import free_port, fresh_scrape, total

    port = free_port()
    node_a = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT,
                            "--metrics-port", str(port))
    store(node_a, 0)
    info = wait_written(node_a, NUM_CHUNKS)
    assert retrieve(node_a, 9000) == {"hit": 0, "mismatches": 0}  # a miss asks L2 too
    info = l2_info(node_a)
    samples = fresh_scrape(port)
    assert samples[("lmcached_l2_up",)] == 1
    assert total(samples, "lmcached_l2_writes_total") == info["l2_writes"] == NUM_CHUNKS
    assert total(samples, "lmcached_l2_written_bytes_total") == info["l2_write_bytes"] > 0
    assert total(samples, "lmcached_l2_miss_chunks_total") == info["l2_fetch_miss_chunks"] == 7
    assert total(samples, "lmcached_l2_write_drops_total") == 0
    redis_server.stop()
    store(node_a, 1000)
    wait_for(lambda: l2_info(node_a)["l2_write_drops_down"] > 0,
             what="drops while Redis is down", timeout_s=20)
    samples = fresh_scrape(port)
    assert samples[("lmcached_l2_up",)] == 0
    assert total(samples, "lmcached_l2_write_drops_total", reason="down") == \
        l2_info(node_a)["l2_write_drops_down"]


def test_a_client_that_shuts_down_its_side_while_parked_still_gets_its_reply(
        redis_server, daemon_factory):
    daemon = daemon_factory(*ARENA, "--l2", redis_server.url, "--l2-fetch-wait", "1")
    with session_on_paused_redis(daemon, redis_server) as (sock, ns):
        sock.sendall(encode_frame(Lookup([ns], b"\2" * 32)))
        time.sleep(0.2)  # parked by now
        sock.shutdown(socketlib.SHUT_WR)  # EOF while the LOOKUP waits for its fetch
        assert recv_reply(sock) == LookupReply(0)
        assert sock.recv(1) == b"", "then the daemon closes"
    assert daemon.info()["pinned_blocks"] == 0


def test_clear_makes_every_daemon_on_the_l2_stop_serving_the_cleared_chunks(
        redis_server, daemon_factory):
    node_a = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    node_b = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    store(node_a)
    wait_written(node_a, NUM_CHUNKS)
    assert retrieve(node_b) == {"hit": 100, "mismatches": 0}  # from L2, before the CLEAR
    node_c = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)  # an empty arena
    result = run_cli("clear", "--yes", "--socket", node_a.socket)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"evicted {NUM_CHUNKS}" and lines[1].startswith(
        f"l2: cleared for every daemon on {redis_server.url}"), result.stdout
    info = l2_info(node_a)
    assert info["l2_generation"] == 1 and info["l2_clear_pending"] == 0
    assert all(redis_server.client().exists(key) for key in chunk_keys()), \
        "old keys stay until their TTL: nothing is deleted one by one"
    for daemon in (node_a, node_c):
        assert retrieve(daemon) == {"hit": 0, "mismatches": 0}, "a cleared chunk was served"
        info = l2_info(daemon)
        assert info["l2_fetch_hit_chunks"] == 0 and info["l2_generation"] == 1
    # Chunks stored after the CLEAR are shared again, under the new generation.
    store(node_a, 5000)
    wait_for(lambda: retrieve(node_c, 5000) == {"hit": 100, "mismatches": 0},
             what="node C to fetch what node A stored after the CLEAR", timeout_s=30)
