"""The daemon as a real process: every request's semantics, sessions, INFO fields.

Protocol v2 throughout: RELEASE has no reply, so a test that must know a RELEASE was
handled sends a PING after it and waits for its Ok (replies come in request order).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest

import raw_frames
from lmcached.wire.connection import Connection, DaemonError, hello
from lmcached.wire.frames import encode_frame
from lmcached.wire.protocol import (
    ALLOCATED,
    EXISTS,
    NOSPACE,
    PROTOCOL_VERSION,
    Abort,
    Acquire,
    Alloc,
    BlocksReply,
    Clear,
    Clients,
    Commit,
    Delete,
    Error,
    Evict,
    Get,
    Hello,
    Layout,
    Lookup,
    LookupReply,
    Ok,
    Ping,
    Put,
    Release,
    Scan,
    Shutdown,
)
from lmcached.shm.janitor import list_segments

MiB = 1 << 20
LAYOUT = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)
# The two tensor parallel ranks of one model: one namespace each.
RANK0 = Layout("tiny-llama", 2, 0, "vllm", "bfloat16", 2, 1, 4, 16, 1000)
RANK1 = Layout("tiny-llama", 2, 1, "vllm", "bfloat16", 2, 1, 4, 16, 1000)
# Chunk records of up to 4 MiB: ALLOC refuses a record larger than its layout's.
MIB_LAYOUT = Layout("tiny-llama-mib", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 4 * MiB)


def hashes(*ids: int) -> bytes:
    """Chunk hashes for tests: 16 bytes each."""
    return b"".join(i.to_bytes(16, "little") for i in ids)


def connect(daemon, layouts=(LAYOUT,), name: str = "test"):
    """A Connection that said HELLO with `layouts` (empty: an admin session)."""
    conn = Connection(daemon.socket)
    reply = hello(conn, name, layouts)
    return conn, reply


def release(conn: Connection, *leases: int) -> None:
    """RELEASE `leases` and wait until the daemon handled it: RELEASE has no reply, so
    a PING follows it, and its Ok (replies come in order) comes after the release."""
    conn.send(Release(list(leases)))
    assert isinstance(conn.request(Ping()), Ok)


class RawClient:
    """A bare socket that sends frames and reads reply frames one by one, so a test
    sees exactly which frames the daemon sent (Connection pairs requests with replies)."""

    def __init__(self, path: str, timeout_s: float = 10.0):
        self.sock = raw_frames.connect(path, timeout_s)

    def send(self, *messages) -> None:
        """Send every message in one write (pipelined)."""
        self.sock.sendall(b"".join(encode_frame(m) for m in messages))

    def send_payload(self, payload: bytes) -> None:
        """Send one frame of a hand-built payload."""
        raw_frames.send_payload(self.sock, payload)

    def read(self):
        """The next reply frame, decoded."""
        return raw_frames.recv_reply(self.sock)

    def assert_nothing_more(self, wait_s: float = 0.3) -> None:
        """No further byte arrives within `wait_s` seconds."""
        self.sock.settimeout(wait_s)
        try:
            data = self.sock.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            return
        finally:
            self.sock.settimeout(10.0)
        raise AssertionError(f"an unexpected reply frame (or EOF) arrived: {data!r}")

    def close(self) -> None:
        self.sock.close()


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def store_chunks(conn, ns: int, ids, num_bytes: int = 1000) -> list[int]:
    reply = conn.request(Alloc(ns, hashes(*ids), [num_bytes] * len(ids)))
    assert reply.status == [ALLOCATED] * len(ids)
    conn.request(Commit(reply.block_ids))
    return reply.block_ids


def test_hello_sets_block_size_from_first_layout(daemon_factory):
    daemon = daemon_factory("--capacity", "8MiB")
    conn, reply = connect(daemon)
    assert reply.block_bytes == 4096  # record_bytes 1000 rounded up to 4 KiB
    assert reply.num_blocks == (8 * MiB - 4096) // 4096
    assert reply.namespaces == [1] and reply.arena_name == daemon.name
    assert reply.server_pid == daemon.proc.pid
    other, reply2 = connect(daemon, [Layout("other", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 9000)])
    assert reply2.namespaces == [2] and reply2.block_bytes == 4096  # fixed for the daemon's life
    admin, reply3 = connect(daemon, [])
    assert reply3.namespaces == [] and reply3.num_blocks == reply.num_blocks
    conn.close()
    other.close()
    admin.close()


def test_chunk_life_cycle_alloc_commit_lookup_acquire_release(daemon):
    conn, hello_reply = connect(daemon, [MIB_LAYOUT])
    (ns,) = hello_reply.namespaces
    reply = conn.request(Alloc(ns, hashes(1, 2, 3), [MiB, MiB, 5]))
    assert reply.status == [ALLOCATED] * 3 and reply.span_lengths == [1, 1, 1]
    assert conn.request(Lookup([ns], hashes(1, 2, 3))).num_chunks == 0  # WRITING is invisible
    assert daemon.info()["writing_blocks"] == 3
    conn.request(Commit(reply.block_ids))
    assert conn.request(Lookup([ns], hashes(1, 2, 3, 4))).num_chunks == 3
    acquired = conn.request(Acquire([ns], hashes(1, 2, 4, 3)))
    assert acquired.block_ids == reply.block_ids[:2] and acquired.lease > 0
    assert acquired.num_bytes == [MiB, MiB] and acquired.span_lengths == [1, 1]
    fields = daemon.info()
    assert fields["pinned_blocks"] == 2 and fields["cached_blocks"] == 3
    assert fields["hits"] == 2 and fields["misses"] == 2 and fields["stores"] == 3
    assert fields["stored_bytes"] == 2 * MiB + 5
    release(conn, acquired.lease)
    assert daemon.info()["pinned_blocks"] == 0
    missed = conn.request(Acquire([ns], hashes(9)))
    assert missed == BlocksReply(0, [], [], [])  # nothing pinned: lease 0
    again = conn.request(Alloc(ns, hashes(1, 2, 3, 4), [MiB] * 4))
    assert again.status == [EXISTS, EXISTS, EXISTS, ALLOCATED]
    conn.request(Abort(again.block_ids))
    assert conn.request(Lookup([ns], hashes(1, 2, 3, 4))).num_chunks == 3
    conn.close()


def test_misuse_gets_error_replies_and_daemon_serves_on(daemon):
    conn, hello_reply = connect(daemon)
    (ns,) = hello_reply.namespaces
    conn.send(Release([1]))  # no such lease: counted, no reply
    assert isinstance(conn.request(Ping()), Ok)
    with pytest.raises(DaemonError, match="not_owner"):
        conn.request(Commit([3]))  # a block this session never allocated
    with pytest.raises(DaemonError, match="bad_request"):
        conn.request(Commit([10**12]))  # beyond every tier's block refs: refused by the schema
    with pytest.raises(DaemonError, match="bad_namespace"):
        conn.request(Lookup([ns + 5], hashes(1)))
    with pytest.raises(DaemonError, match="multiple of 16"):
        conn.request(Lookup([ns], b"short"))
    with pytest.raises(DaemonError, match="one positive num_bytes per hash"):
        conn.request(Alloc(ns, hashes(1, 2), [10]))
    with pytest.raises(DaemonError, match="already"):
        conn.request(Hello(PROTOCOL_VERSION, os.getpid(), "again", [LAYOUT]))
    conn.request(Ping())
    with Connection(daemon.socket) as fresh:
        with pytest.raises(DaemonError, match="no_session"):
            fresh.request(Lookup([1], hashes(1)))
        with pytest.raises(DaemonError, match="version"):
            fresh.request(Hello(999, os.getpid(), "future"))
    fields = daemon.info()
    assert fields["errors_not_owner"] == 2 and fields["errors_bad_request"] == 4
    assert fields["errors_bad_namespace"] == 1 and fields["errors_version"] == 1
    conn.close()


def test_a_session_cannot_touch_another_sessions_blocks(daemon):
    a, hello_a = connect(daemon, name="a")
    b, _ = connect(daemon, name="b")
    (ns,) = hello_a.namespaces
    reply = a.request(Alloc(ns, hashes(7), [100]))
    with pytest.raises(DaemonError, match="not_owner"):
        b.request(Commit(reply.block_ids))
    with pytest.raises(DaemonError, match="not_owner"):
        b.request(Abort(reply.block_ids))
    a.request(Commit(reply.block_ids))
    pinned = a.request(Acquire([ns], hashes(7)))
    release(b, pinned.lease)  # not b's lease: refused, a's pin stays
    assert daemon.info()["pinned_blocks"] == 1
    release(a, pinned.lease)
    assert daemon.info()["pinned_blocks"] == 0
    release(a, pinned.lease)  # only once
    fields = daemon.info()
    assert fields["errors_not_owner"] == 4 and fields["pinned_blocks"] == 0
    a.close()
    b.close()


def test_alloc_evicts_lru_then_answers_nospace(daemon_factory):
    daemon = daemon_factory("--capacity", "8MiB", "--block-size", "1MiB",
                            "--max-session-share", "100")
    conn, hello_reply = connect(daemon, [MIB_LAYOUT])
    (ns,), num_blocks = hello_reply.namespaces, hello_reply.num_blocks
    assert num_blocks == 7
    store_chunks(conn, ns, range(7), MiB)
    # Touch chunks 0-1 so that 2-6 are the least recently used.
    release(conn, conn.request(Acquire([ns], hashes(0, 1))).lease)
    store_chunks(conn, ns, [100, 101], MiB)
    assert conn.request(Lookup([ns], hashes(0, 1))).num_chunks == 2
    fields = daemon.info()
    assert fields["evictions"] == 2 and fields["cached_values"] == 7
    pins = conn.request(Acquire([ns], hashes(0, 1)))
    pins2 = conn.request(Acquire([ns], hashes(100, 101)))
    reply = conn.request(Alloc(ns, hashes(200, 201, 202, 203, 204, 205), [MiB] * 6))
    # 3 evictable values left (the pinned 4 stay): 3 allocated, then NOSPACE for the rest.
    assert reply.status == [ALLOCATED] * 3 + [NOSPACE] * 3
    conn.request(Abort(reply.block_ids))
    release(conn, pins.lease, pins2.lease)
    assert daemon.info()["pinned_blocks"] == 0
    conn.close()


def test_multi_block_values_span_blocks(daemon):
    conn, hello_reply = connect(daemon, [MIB_LAYOUT])
    (ns,) = hello_reply.namespaces
    reply = conn.request(Alloc(ns, hashes(1), [3 * MiB + 1]))
    assert reply.span_lengths == [4] and len(set(reply.block_ids)) == 4
    assert reply.spans() == [reply.block_ids]
    conn.request(Commit(reply.block_ids[:1]))  # any block of a value commits all of it
    got = conn.request(Acquire([ns], hashes(1)))
    assert got.block_ids == reply.block_ids and got.num_bytes == [3 * MiB + 1]
    assert got.span_lengths == [4] and daemon.info()["pinned_blocks"] == 4
    release(conn, got.lease)
    assert daemon.info()["pinned_blocks"] == 0
    conn.close()


def test_namespaces_are_isolated(daemon):
    a, hello_a = connect(daemon)
    b, hello_b = connect(daemon, [RANK1])
    (ns_a,), (ns_b,) = hello_a.namespaces, hello_b.namespaces
    assert ns_a != ns_b
    store_chunks(a, ns_a, [1, 2])
    assert b.request(Lookup([ns_b], hashes(1, 2))).num_chunks == 0
    with pytest.raises(DaemonError, match="bad_namespace"):
        b.request(Lookup([ns_a], hashes(1, 2)))
    a.close()
    b.close()


def test_put_get_delete_scan_by_string_key(daemon):
    conn, hello_reply = connect(daemon)
    (ns,) = hello_reply.namespaces
    first = conn.request(Put(ns, "req-1", 100))
    conn.request(Commit(first.block_ids))
    got = conn.request(Get(ns, "req-1"))
    assert got.block_ids == first.block_ids and got.num_bytes == [100] and got.lease > 0
    second = conn.request(Put(ns, "req-1", 2 * MiB))  # replaces on commit
    conn.request(Commit(second.block_ids))
    got_second = conn.request(Get(ns, "req-1"))
    assert got_second.block_ids == second.block_ids and got_second.span_lengths == [2]
    assert daemon.info()["detached_blocks"] == 1  # the old value, still pinned by us
    release(conn, got.lease, got_second.lease)
    fields = daemon.info()
    assert fields["detached_blocks"] == 0 and fields["pinned_blocks"] == 0
    conn.request(Commit(conn.request(Put(ns, "req-2", 10)).block_ids))
    assert sorted(conn.request(Scan(ns, "req-", 10)).keys) == ["req-1", "req-2"]
    assert conn.request(Delete(ns, "req-1")).count == 1
    assert conn.request(Get(ns, "req-1")) == BlocksReply(0, [], [], [])
    assert conn.request(Scan(ns, "", 10)).keys == ["req-2"]
    conn.close()


def test_evict_clear_and_clients(daemon):
    conn, hello_reply = connect(daemon)
    (ns,) = hello_reply.namespaces
    store_chunks(conn, ns, range(5))
    pinned = conn.request(Acquire([ns], hashes(0)))
    assert conn.request(Evict(key=(3).to_bytes(16, "little").hex())).count == 1
    assert conn.request(Evict(lru=1)).count == 1
    assert conn.request(Clear()).count == 3  # chunk 0 too: pinned, kept for its reader
    assert conn.request(Lookup([ns], hashes(0))).num_chunks == 0
    clients = conn.request(Clients()).clients
    me = [c for c in clients if c["pid"] == os.getpid()]
    assert me and me[0]["pinned_blocks"] == 1 and me[0]["ns"] == str(ns)
    assert me[0]["proc"].startswith("python") and me[0]["rss_bytes"] > 0
    release(conn, pinned.lease)
    conn.close()


# ------------------------------------------------------------------ protocol v2
V1_LAYOUT_FIELDS = ["tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000]
V1_LAYOUT_NAMES = ["model_name", "world_size", "worker_id", "fmt", "dtype", "num_layers",
                   "num_kv_heads", "head_size", "chunk_size", "chunk_bytes"]


@pytest.mark.parametrize("v1_layout", [
    V1_LAYOUT_FIELDS,  # the layout as an array of its 10 fields
    dict(zip(V1_LAYOUT_NAMES, V1_LAYOUT_FIELDS)),  # as a v1 client encoded it: a map
    None,  # a v1 admin tool (no layout)
], ids=["layout_array", "layout_map", "no_layout"])
def test_a_v1_client_gets_a_version_error_naming_both_versions(daemon, v1_layout):
    """A v1 HELLO does not decode as a v2 one (its fields differ), yet the client is told
    why, not just `bad_request`; everyone else is served on."""
    other, other_hello = connect(daemon, name="v2")
    (ns,) = other_hello.namespaces
    store_chunks(other, ns, [1])
    old = RawClient(daemon.socket)
    old.send_payload(msgspec.msgpack.encode(["hello", 1, os.getpid(), "v1-client", v1_layout]))
    reply = old.read()
    assert isinstance(reply, Error) and reply.code == "version", reply
    numbers = set(re.findall(r"\b\d+\b", reply.message))
    assert {"1", str(PROTOCOL_VERSION)} <= numbers, reply.message
    old.close()
    assert other.request(Lookup([ns], hashes(1))).num_chunks == 1
    late, _ = connect(daemon, name="late")
    assert late.request(Lookup([ns], hashes(1))).num_chunks == 1
    fields = daemon.info()
    assert fields["errors_version"] == 1 and "errors_bad_request" not in fields
    assert daemon.proc.poll() is None
    other.close()
    late.close()


def test_release_has_no_reply_the_next_frame_is_the_next_requests(daemon):
    """RELEASE, PING, LOOKUP in one write: the first frame back is PING's Ok, the second
    LOOKUP's reply, and nothing else comes; the release was done before the PING."""
    raw = RawClient(daemon.socket)
    raw.send(Hello(PROTOCOL_VERSION, os.getpid(), "raw", [LAYOUT]))
    (ns,) = raw.read().namespaces
    raw.send(Alloc(ns, hashes(1, 2), [100, 100]))
    stored = raw.read()
    raw.send(Commit(stored.block_ids))
    assert isinstance(raw.read(), Ok)
    raw.send(Acquire([ns], hashes(1, 2)))
    acquired = raw.read()
    assert acquired.lease > 0 and acquired.block_ids == stored.block_ids
    assert daemon.info()["pinned_blocks"] == 2
    raw.send(Release([acquired.lease]), Ping(), Lookup([ns], hashes(1, 2)))
    assert isinstance(raw.read(), Ok)
    assert raw.read() == LookupReply(2)
    raw.assert_nothing_more()
    fields = daemon.info()
    assert fields["pinned_blocks"] == 0 and fields["errors"] == 0
    raw.close()


def test_bad_releases_get_no_reply_are_counted_and_change_nothing(daemon):
    """A RELEASE of an unknown lease, of another session's lease, of a lease twice (in
    one frame or in two): no reply, `errors_not_owner` counted, every pin intact."""
    owner, hello_owner = connect(daemon, name="owner")
    (ns,) = hello_owner.namespaces
    store_chunks(owner, ns, [1, 2, 3])
    held = owner.request(Acquire([ns], hashes(1, 2, 3)))  # 3 pins, owner's
    other, _ = connect(daemon, name="other")
    mine = other.request(Acquire([ns], hashes(1)))  # 1 pin, other's, on a pinned block
    assert daemon.info()["pinned_blocks"] == 3
    other.send(Release([held.lease + mine.lease + 1000]))  # unknown
    other.send(Release([held.lease]))  # another session's
    other.send(Release([mine.lease, held.lease]))  # partly another session's: all refused
    other.send(Release([mine.lease, mine.lease]))  # twice in one frame: all refused
    assert isinstance(other.request(Ping()), Ok)  # no reply came to any RELEASE
    fields = daemon.info()
    assert fields["errors_not_owner"] == 4 and fields["pinned_blocks"] == 3
    rows = {row["name"]: row for row in other.request(Clients()).clients}
    assert rows["owner"]["pinned_blocks"] == 3 and rows["other"]["pinned_blocks"] == 1
    other.send(Release([mine.lease]))
    other.send(Release([mine.lease]))  # again, in a second frame: no longer held
    assert isinstance(other.request(Ping()), Ok)
    fields = daemon.info()
    assert fields["errors_not_owner"] == 5 and fields["pinned_blocks"] == 3
    rows = {row["name"]: row for row in other.request(Clients()).clients}
    assert rows["owner"]["pinned_blocks"] == 3 and rows["other"]["pinned_blocks"] == 0
    assert owner.request(Lookup([ns], hashes(1, 2, 3))).num_chunks == 3
    release(owner, held.lease)  # the owner's lease still works
    assert daemon.info()["pinned_blocks"] == 0
    assert daemon.proc.poll() is None
    owner.close()
    other.close()


def test_one_frame_looks_up_and_acquires_every_tensor_parallel_rank(daemon):
    """One session, two layouts (TP ranks 0 and 1): LOOKUP and ACQUIRE of both
    namespaces in one frame answer the prefix READY in both; the values come
    namespace-major with the block ids each namespace's own ACQUIRE gives; one RELEASE
    frees them all."""
    conn, hello_reply = connect(daemon, [RANK0, RANK1], name="scheduler")
    ns_a, ns_b = hello_reply.namespaces
    assert ns_a != ns_b
    stored_a = store_chunks(conn, ns_a, [1, 2, 3])
    stored_b = store_chunks(conn, ns_b, [1, 2])
    chain = hashes(1, 2, 3)
    assert conn.request(Lookup([ns_a], chain)).num_chunks == 3
    assert conn.request(Lookup([ns_b], chain)).num_chunks == 2
    assert conn.request(Lookup([ns_a, ns_b], chain)).num_chunks == 2
    assert conn.request(Lookup([ns_b, ns_a], chain)).num_chunks == 2

    own_a = conn.request(Acquire([ns_a], hashes(1, 2)))
    own_b = conn.request(Acquire([ns_b], hashes(1, 2)))
    assert own_a.block_ids == stored_a[:2] and own_b.block_ids == stored_b
    release(conn, own_a.lease, own_b.lease)  # two leases in one RELEASE
    assert daemon.info()["pinned_blocks"] == 0

    both = conn.request(Acquire([ns_a, ns_b], chain))
    assert both.lease > 0
    assert both.spans() == [[b] for b in own_a.block_ids + own_b.block_ids]  # ns-major
    assert both.span_lengths == [1] * 4 and both.num_bytes == [1000] * 4
    assert daemon.info()["pinned_blocks"] == 4
    release(conn, both.lease)  # one lease for every namespace's pins
    assert daemon.info()["pinned_blocks"] == 0

    reversed_order = conn.request(Acquire([ns_b, ns_a], chain))
    assert reversed_order.block_ids == own_b.block_ids + own_a.block_ids
    release(conn, reversed_order.lease)
    assert daemon.info()["pinned_blocks"] == 0
    conn.close()


def test_a_namespace_not_in_hello_or_listed_twice_is_refused_and_pins_nothing(daemon):
    conn, hello_reply = connect(daemon, [RANK0, RANK1], name="both")
    ns_a, ns_b = hello_reply.namespaces
    store_chunks(conn, ns_a, [1, 2])
    store_chunks(conn, ns_b, [1, 2])
    rank0_only, hello_rank0 = connect(daemon, [RANK0], name="rank0")
    assert hello_rank0.namespaces == [ns_a]  # the same layout: the same namespace
    chain = hashes(1, 2)
    for request in (Lookup([ns_a, ns_b], chain), Acquire([ns_a, ns_b], chain),
                    Acquire([ns_b], chain), Lookup([ns_a, ns_b + 7], chain)):
        with pytest.raises(DaemonError, match="bad_namespace"):
            rank0_only.request(request)
    for request in (Lookup([ns_a, ns_a], chain), Acquire([ns_a, ns_b, ns_a], chain),
                    Acquire([], chain)):
        with pytest.raises(DaemonError, match="bad_request"):
            conn.request(request)
    fields = daemon.info()
    assert fields["errors_bad_namespace"] == 4 and fields["errors_bad_request"] == 3
    assert fields["pinned_blocks"] == 0 and fields["hits"] == 0  # nothing half-acquired
    assert rank0_only.request(Lookup([ns_a], chain)).num_chunks == 2
    conn.close()
    rank0_only.close()


def test_a_session_that_ends_holding_leases_leaves_no_pinned_block(daemon):
    writer, hello_writer = connect(daemon, [RANK0, RANK1], name="writer")
    ns_a, ns_b = hello_writer.namespaces
    store_chunks(writer, ns_a, [1, 2, 3])
    store_chunks(writer, ns_b, [1, 2, 3])
    writer.request(Commit(writer.request(Put(ns_a, "value", 3 * MiB)).block_ids))
    holder, _ = connect(daemon, [RANK0, RANK1], name="holder")
    holder.request(Acquire([ns_a, ns_b], hashes(1, 2, 3)))  # 6 pins
    holder.request(Acquire([ns_a], hashes(1)))  # a second pin on a pinned block
    holder.request(Get(ns_a, "value"))  # 3 blocks
    holder.request(Alloc(ns_b, hashes(50), [100]))  # and one being written
    fields = daemon.info()
    assert fields["pinned_blocks"] == 9 and fields["writing_blocks"] == 1
    rows = {row["name"]: row for row in writer.request(Clients()).clients}
    assert rows["holder"]["pinned_blocks"] == 10  # pins, counting a block pinned twice twice
    holder.close()  # no RELEASE: the socket closes
    wait_for(lambda: daemon.info()["connected_clients"] == 2, what="the session to end")
    fields = daemon.info()
    assert fields["pinned_blocks"] == 0 and fields["writing_blocks"] == 0
    assert fields["cached_values"] == 7  # nothing lost: the pins only were dropped
    writer.close()


CHILD_HOLDS_PINS = """
import sys, time
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Acquire, Alloc, Layout
layout = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)
conn = Connection(sys.argv[1])
(ns,) = hello(conn, "doomed", [layout]).namespaces
h = b"".join(i.to_bytes(16, "little") for i in range(3))
conn.request(Acquire([ns], h))
conn.request(Alloc(ns, b"".join(i.to_bytes(16, "little") for i in (50, 51)), [100, 100]))
print("holding", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_sigkilled_client_releases_its_pins_and_writing_blocks(daemon_factory):
    daemon = daemon_factory("--capacity", "64MiB", "--block-size", "1MiB",
                            "--max-session-share", "100")
    conn, hello_reply = connect(daemon)
    (ns,) = hello_reply.namespaces
    store_chunks(conn, ns, range(3))
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
        reply = conn.request(Alloc(ns, hashes(*range(100, 100 + total)), [1000] * total))
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


def test_a_second_stop_signal_during_a_slow_stop_leaves_no_segment(daemon_factory):
    """SIGTERM, then SIGTERM (or SIGINT) again while the graceful stop drains a write to an
    L2 that never answers (a listener that accepts nothing: each Redis call waits out its
    2 s timeout): the stop signals stay caught until the arena is unlinked."""
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(16)
    try:
        for second in (signal.SIGTERM, signal.SIGINT):
            node = daemon_factory("--capacity", "8MiB", "--block-size", "64KiB",
                                  "--l2", f"redis://127.0.0.1:{blackhole.getsockname()[1]}")
            conn, reply = connect(node)
            store_chunks(conn, reply.namespaces[0], [1])  # write-through: an L2 write waits
            conn.close()
            node.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "received SIGTERM: stopping" in node.log(), what="the first stop")
            node.proc.send_signal(second)
            assert node.proc.wait(timeout=30) == 0, node.log()
            assert list_segments(node.name) == [], node.log()
            assert not os.path.exists(node.socket)
    finally:
        blackhole.close()


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
    assert proc.returncode == 1, proc.stderr
    # One line: what was asked, where it came from, what /dev/shm has, and the fix.
    match = re.fullmatch(
        r"Error: capacity 100TiB \(--capacity\) is more than /dev/shm has free "
        r"\(([0-9.]+)((?:[KMGT]i)?B)\); ask for less, or enlarge /dev/shm\n", proc.stderr)
    assert match, proc.stderr
    free_bytes = float(match[1]) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30,
                                    "TiB": 1 << 40}[match[2]]
    assert 0 < free_bytes <= shutil.disk_usage("/dev/shm").total
    assert not os.path.exists(f"{short_tmp}/x.sock")


def test_peer_of_another_uid_is_refused(daemon):
    # Let the file system pass the peer, so that SO_PEERCRED is what must refuse it.
    os.chmod(daemon.socket, 0o666)
    os.chmod(os.path.dirname(daemon.socket), 0o711)
    code = textwrap.dedent(
        f"""
        import os
        from lmcached.wire.connection import Connection
        from lmcached.wire.protocol import Ping
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
