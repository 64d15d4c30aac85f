"""The daemon as a real process: every request's semantics, sessions, INFO fields."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lmcached.protocol import (
    ALLOCATED,
    EXISTS,
    NOSPACE,
    Abort,
    Acquire,
    Alloc,
    Clear,
    Clients,
    Commit,
    Connection,
    DaemonError,
    Delete,
    Evict,
    Get,
    Hello,
    Layout,
    Lookup,
    Ping,
    Put,
    Release,
    Scan,
    Shutdown,
    hello,
)
from lmcached.shm.janitor import list_segments

MiB = 1 << 20
LAYOUT = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)


def hashes(*ids: int) -> bytes:
    """Chunk hashes for tests: 16 bytes each."""
    return b"".join(i.to_bytes(16, "little") for i in ids)


def connect(daemon, layout: Layout | None = LAYOUT):
    conn = Connection(daemon.socket)
    reply = hello(conn, "test", layout)
    return conn, reply


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def store_chunks(conn, ns: int, ids, nbytes: int = 1000) -> list[int]:
    reply = conn.request(Alloc(ns, hashes(*ids), [nbytes] * len(ids)))
    assert reply.status == [ALLOCATED] * len(ids)
    conn.request(Commit(reply.block_ids))
    return reply.block_ids


def test_hello_sets_block_size_from_first_layout(daemon_factory):
    daemon = daemon_factory("--capacity", "8MiB")
    conn, reply = connect(daemon)
    assert reply.block_bytes == 4096  # chunk_bytes 1000 rounded up to 4 KiB
    assert reply.num_blocks == (8 * MiB - 4096) // 4096
    assert reply.ns == 1 and reply.arena_name == daemon.name
    assert reply.server_pid == daemon.proc.pid
    other, reply2 = connect(daemon, Layout("other", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 9000))
    assert reply2.ns == 2 and reply2.block_bytes == 4096  # fixed for the daemon's life
    conn.close()
    other.close()


def test_chunk_life_cycle_alloc_commit_lookup_acquire_release(daemon):
    conn, hello_reply = connect(daemon)
    ns = hello_reply.ns
    reply = conn.request(Alloc(ns, hashes(1, 2, 3), [MiB, MiB, 5]))
    assert reply.status == [ALLOCATED] * 3 and reply.num_blocks == [1, 1, 1]
    assert conn.request(Lookup(ns, hashes(1, 2, 3))).num_chunks == 0  # WRITING is invisible
    assert daemon.info()["writing_blocks"] == 3
    conn.request(Commit(reply.block_ids))
    assert conn.request(Lookup(ns, hashes(1, 2, 3, 4))).num_chunks == 3
    acquired = conn.request(Acquire(ns, hashes(1, 2, 4, 3)))
    assert acquired.block_ids == reply.block_ids[:2]
    assert acquired.nbytes == [MiB, MiB]
    fields = daemon.info()
    assert fields["pinned_blocks"] == 2 and fields["cached_blocks"] == 3
    assert fields["hits"] == 2 and fields["misses"] == 2 and fields["stores"] == 3
    assert fields["stored_bytes"] == 2 * MiB + 5
    conn.request(Release(acquired.block_ids))
    assert daemon.info()["pinned_blocks"] == 0
    again = conn.request(Alloc(ns, hashes(1, 2, 3, 4), [MiB] * 4))
    assert again.status == [EXISTS, EXISTS, EXISTS, ALLOCATED]
    conn.request(Abort(again.block_ids))
    assert conn.request(Lookup(ns, hashes(1, 2, 3, 4))).num_chunks == 3
    conn.close()


def test_misuse_gets_error_replies_and_daemon_serves_on(daemon):
    conn, hello_reply = connect(daemon)
    ns = hello_reply.ns
    with pytest.raises(DaemonError, match="not_owner"):
        conn.request(Release([0]))
    with pytest.raises(DaemonError, match="not_owner"):
        conn.request(Commit([10**12]))
    with pytest.raises(DaemonError, match="bad_namespace"):
        conn.request(Lookup(ns + 5, hashes(1)))
    with pytest.raises(DaemonError, match="multiple of 16"):
        conn.request(Lookup(ns, b"short"))
    with pytest.raises(DaemonError, match="one positive nbytes per hash"):
        conn.request(Alloc(ns, hashes(1, 2), [10]))
    with pytest.raises(DaemonError, match="already"):
        conn.request(Hello(1, os.getpid(), "again", LAYOUT))
    conn.request(Ping())
    with Connection(daemon.socket) as fresh:
        with pytest.raises(DaemonError, match="no_session"):
            fresh.request(Lookup(1, hashes(1)))
        with pytest.raises(DaemonError, match="version"):
            fresh.request(Hello(999, os.getpid(), "future"))
    fields = daemon.info()
    assert fields["errors_not_owner"] == 2 and fields["errors_bad_request"] == 3
    assert fields["errors_bad_namespace"] == 1 and fields["errors_version"] == 1
    conn.close()


def test_a_session_cannot_touch_another_sessions_blocks(daemon):
    a, hello_a = connect(daemon)
    b, _ = connect(daemon)
    reply = a.request(Alloc(hello_a.ns, hashes(7), [100]))
    with pytest.raises(DaemonError, match="not_owner"):
        b.request(Commit(reply.block_ids))
    with pytest.raises(DaemonError, match="not_owner"):
        b.request(Abort(reply.block_ids))
    a.request(Commit(reply.block_ids))
    pinned = a.request(Acquire(hello_a.ns, hashes(7)))
    with pytest.raises(DaemonError, match="not_owner"):
        b.request(Release(pinned.block_ids))
    a.request(Release(pinned.block_ids))
    with pytest.raises(DaemonError, match="not_owner"):
        a.request(Release(pinned.block_ids))  # only as often as pinned
    a.close()
    b.close()


def test_alloc_evicts_lru_then_answers_nospace(daemon_factory):
    daemon = daemon_factory("--capacity", "8MiB", "--block-size", "1MiB")
    conn, hello_reply = connect(daemon)
    ns, num_blocks = hello_reply.ns, hello_reply.num_blocks
    assert num_blocks == 7
    store_chunks(conn, ns, range(7), MiB)
    # Touch chunks 0-1 so that 2-6 are the least recently used.
    conn.request(Release(conn.request(Acquire(ns, hashes(0, 1))).block_ids))
    store_chunks(conn, ns, [100, 101], MiB)
    assert conn.request(Lookup(ns, hashes(0, 1))).num_chunks == 2
    fields = daemon.info()
    assert fields["evictions"] == 2 and fields["cached_values"] == 7
    pins = conn.request(Acquire(ns, hashes(0, 1)))
    pins2 = conn.request(Acquire(ns, hashes(100, 101)))
    reply = conn.request(Alloc(ns, hashes(200, 201, 202, 203, 204, 205), [MiB] * 6))
    # 3 evictable values left (the pinned 4 stay): 3 allocated, then NOSPACE for the rest.
    assert reply.status == [ALLOCATED] * 3 + [NOSPACE] * 3
    conn.request(Abort(reply.block_ids))
    conn.request(Release(pins.block_ids + pins2.block_ids))
    conn.close()


def test_multi_block_values_span_blocks(daemon):
    conn, hello_reply = connect(daemon)
    ns = hello_reply.ns
    reply = conn.request(Alloc(ns, hashes(1), [3 * MiB + 1]))
    assert reply.num_blocks == [4] and len(set(reply.block_ids)) == 4
    conn.request(Commit(reply.block_ids[:1]))  # any block of a value commits all of it
    got = conn.request(Acquire(ns, hashes(1)))
    assert got.block_ids == reply.block_ids and got.nbytes == [3 * MiB + 1]
    conn.request(Release(got.block_ids))
    conn.close()


def test_namespaces_are_isolated(daemon):
    a, hello_a = connect(daemon)
    other = Layout("tiny-llama", 2, 1, "vllm", "bfloat16", 2, 2, 4, 16, 1000)  # TP rank 1
    b, hello_b = connect(daemon, other)
    assert hello_a.ns != hello_b.ns
    store_chunks(a, hello_a.ns, [1, 2])
    assert b.request(Lookup(hello_b.ns, hashes(1, 2))).num_chunks == 0
    with pytest.raises(DaemonError, match="bad_namespace"):
        b.request(Lookup(hello_a.ns, hashes(1, 2)))
    a.close()
    b.close()


def test_put_get_delete_scan_by_string_key(daemon):
    conn, hello_reply = connect(daemon)
    ns = hello_reply.ns
    first = conn.request(Put(ns, "req-1", 100))
    conn.request(Commit(first.block_ids))
    got = conn.request(Get(ns, "req-1"))
    assert got.block_ids == first.block_ids and got.nbytes == [100]
    second = conn.request(Put(ns, "req-1", 2 * MiB))  # replaces on commit
    conn.request(Commit(second.block_ids))
    assert conn.request(Get(ns, "req-1")).block_ids == second.block_ids
    assert daemon.info()["detached_blocks"] == 1  # the old value, still pinned by us
    conn.request(Release(got.block_ids))
    conn.request(Release(second.block_ids))
    conn.request(Commit(conn.request(Put(ns, "req-2", 10)).block_ids))
    assert sorted(conn.request(Scan(ns, "req-", 10)).keys) == ["req-1", "req-2"]
    assert conn.request(Delete(ns, "req-1")).count == 1
    assert conn.request(Get(ns, "req-1")).block_ids == []
    assert conn.request(Scan(ns, "", 10)).keys == ["req-2"]
    conn.close()


def test_evict_clear_and_clients(daemon):
    conn, hello_reply = connect(daemon)
    ns = hello_reply.ns
    store_chunks(conn, ns, range(5))
    pinned = conn.request(Acquire(ns, hashes(0)))
    assert conn.request(Evict(key=(3).to_bytes(16, "little").hex())).count == 1
    assert conn.request(Evict(lru=1)).count == 1
    assert conn.request(Clear()).count == 2  # chunk 0 is pinned
    assert conn.request(Lookup(ns, hashes(0))).num_chunks == 1
    clients = conn.request(Clients()).clients
    me = [c for c in clients if c["pid"] == os.getpid()]
    assert me and me[0]["pinned_blocks"] == 1 and me[0]["ns"] == ns
    assert me[0]["proc"].startswith("python") and me[0]["rss_bytes"] > 0
    conn.request(Release(pinned.block_ids))
    conn.close()


CHILD_HOLDS_PINS = """
import sys, time
from lmcached.protocol import Acquire, Alloc, Connection, Layout, hello
layout = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)
conn = Connection(sys.argv[1])
ns = hello(conn, "doomed", layout).ns
h = b"".join(i.to_bytes(16, "little") for i in range(3))
conn.request(Acquire(ns, h))
conn.request(Alloc(ns, b"".join(i.to_bytes(16, "little") for i in (50, 51)), [100, 100]))
print("holding", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_sigkilled_client_releases_its_pins_and_writing_blocks(daemon):
    conn, hello_reply = connect(daemon)
    store_chunks(conn, hello_reply.ns, range(3))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_HOLDS_PINS, daemon.socket], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "holding"
        fields = daemon.info()
        assert fields["pinned_blocks"] == 3 and fields["writing_blocks"] == 2
        assert fields["connected_clients"] == 3  # us, the child, and info()'s connection
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        wait_for(lambda: daemon.info()["connected_clients"] == 2, what="session to end")
        fields = daemon.info()
        assert fields["pinned_blocks"] == 0 and fields["writing_blocks"] == 0
        # Every block is reusable again: the whole arena can be allocated.
        total = hello_reply.num_blocks
        reply = conn.request(Alloc(hello_reply.ns, hashes(*range(100, 100 + total)), [MiB] * total))
        assert reply.status == [ALLOCATED] * total
        conn.request(Abort(reply.block_ids))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    conn.close()


def test_sigterm_leaves_no_segment_and_no_socket(daemon):
    conn, _ = connect(daemon)
    assert list_segments(daemon.name)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=15) == 0
    assert list_segments(daemon.name) == []
    assert not os.path.exists(daemon.socket)
    assert "received SIGTERM: stopping" in daemon.log()
    conn.close()


def test_shutdown_request_stops_gracefully(daemon):
    with Connection(daemon.socket) as conn:
        conn.request(Shutdown())
    assert daemon.proc.wait(timeout=15) == 0
    assert list_segments(daemon.name) == [] and not os.path.exists(daemon.socket)


def test_second_daemon_on_the_same_socket_refuses_to_start(daemon, short_tmp):
    proc = subprocess.run(
        [sys.executable, "-m", "lmcached.cli", "serve", "--name", daemon.name + "-2",
         "--socket", daemon.socket, "--capacity", "8MiB"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert "another lmcached daemon is listening" in proc.stderr
    with Connection(daemon.socket) as conn:
        conn.request(Ping())


def test_capacity_beyond_dev_shm_is_refused_clearly(short_tmp):
    proc = subprocess.run(
        [sys.executable, "-m", "lmcached.cli", "serve", "--socket", f"{short_tmp}/x.sock",
         "--capacity", "100TiB"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "more than /dev/shm has free" in proc.stderr


def test_peer_of_another_uid_is_refused(daemon):
    # Let the file system pass the peer, so that SO_PEERCRED is what must refuse it.
    os.chmod(daemon.socket, 0o666)
    os.chmod(os.path.dirname(daemon.socket), 0o711)
    code = textwrap.dedent(
        f"""
        import os
        from lmcached.protocol import Connection, Ping
        os.setgid(65534); os.setuid(65534)
        try:
            with Connection({daemon.socket!r}) as conn:
                conn.request(Ping())
            print("served")
        except (ConnectionError, OSError) as exc:
            print("refused", type(exc).__name__)
        """
    )
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "refused" in out.stdout, out.stdout + out.stderr
    assert daemon.info()["errors_unauthorized"] == 1
