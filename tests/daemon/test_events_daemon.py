"""The chunk event feed of a real daemon process, with raw clients: a subscriber that
never polls and one that floods EVENTS without reading its replies cost the daemon and
its other clients nothing, and are counted; `lmcached events` tails the feed."""

import json
import os
import subprocess
import sys
import time

from raw_frames import connect
from lmcached.wire.connection import Connection, hello
from lmcached.wire.frames import encode_frame
from lmcached.wire.protocol import (
    ALLOCATED,
    HASH_BYTES,
    Alloc,
    Commit,
    Events,
    Info,
    Layout,
    Ping,
    Subscribe,
)

LAYOUT = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)
CAPACITY = 64


def _store(conn: Connection, first: int, num_chunks: int) -> None:
    """ALLOC + COMMIT of chunks first..first+num_chunks-1 (nothing written: the feed
    does not read records unless asked for token ids)."""
    hashes = b"".join(i.to_bytes(HASH_BYTES, "little") for i in range(first, first + num_chunks))
    reply = conn.request(Alloc(1, hashes, [1000] * num_chunks))
    assert reply.status == [ALLOCATED] * num_chunks, reply
    conn.request(Commit(reply.block_ids))


def _stats(daemon) -> dict:
    with Connection(daemon.socket) as conn:
        return conn.request(Info("stats")).sections["stats"]


def test_subscribers_that_never_read_slow_no_store_and_are_counted(daemon_factory):
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "64KiB",
                            "--events-capacity", str(CAPACITY))
    idle = Connection(daemon.socket)
    hello(idle, "idle", [LAYOUT])
    cursor = idle.request(Subscribe([])).cursor
    flooder = connect(daemon.socket)  # subscribes, then asks and never reads a reply
    flooder.sendall(encode_frame(Subscribe([])))
    for _ in range(2000):
        flooder.sendall(encode_frame(Events(1, 0, True)))
    writer = Connection(daemon.socket)
    hello(writer, "writer", [LAYOUT])
    started = time.monotonic()
    for first in range(0, 600, 50):  # 600 chunks, 255 blocks: evictions too
        _store(writer, first, 50)
    elapsed_s = time.monotonic() - started
    assert elapsed_s < 10.0, elapsed_s  # nothing waits for a subscriber
    writer.request(Ping())
    stats = _stats(daemon)
    num_blocks = daemon.info()["num_blocks"]
    assert stats["events_published"] == 600 + (600 - num_blocks)  # stored, then evicted
    assert stats["events_subscribers"] == 2
    assert stats["events_subscribers_lagging"] >= 1  # the idle one, at least
    reply = idle.request(Events(cursor))
    assert reply.lost == stats["events_published"] - CAPACITY
    assert len(reply.events) == CAPACITY
    assert [e.seq for e in reply.events] == list(range(reply.lost + 1, reply.lost + 1 + CAPACITY))
    assert _stats(daemon)["events_lost"] >= reply.lost
    flooder.close()
    idle.close()
    writer.close()


def test_the_events_command_prints_one_line_per_event(daemon_factory):
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "64KiB")
    writer = Connection(daemon.socket)
    hello(writer, "writer", [LAYOUT])
    tail = subprocess.Popen(
        [sys.executable, "-m", "lmcached.cli", "events", "--socket", daemon.socket,
         "--json", "--count", "3", "--interval", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 20
        while _stats(daemon)["events_subscribers"] == 0:
            assert time.monotonic() < deadline and tail.poll() is None, tail.stderr.read()
            time.sleep(0.02)
        _store(writer, 1, 3)
        out, err = tail.communicate(timeout=20)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()
    assert tail.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(e["kind"], e["medium"], e["ns"], e["chunk_hash"]) for e in lines] == [
        ("stored", "cpu", 1, i.to_bytes(16, "little").hex()) for i in (1, 2, 3)]
    assert lines[1]["parent"] == lines[0]["chunk_hash"]
    writer.close()
