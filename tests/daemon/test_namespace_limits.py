"""Namespaces are bounded and freed: a flood of HELLOs with distinct
layouts, each session closed, leaves the daemon's memory and its metrics scrape bounded.

A real daemon process with the metrics endpoint; RSS is INFO's `rss_private_bytes` (the
arena is shared memory).
"""

import socket
import time
import urllib.request

from raw_frames import connect, recv_reply
from lmcached.daemon.metrics import SNAPSHOT_MAX_AGE_S
from lmcached.wire.connection import Connection, hello
from lmcached.wire.frames import encode_frame
from lmcached.wire.protocol import (
    HASH_BYTES,
    PROTOCOL_VERSION,
    Alloc,
    Commit,
    Hello,
    HelloReply,
    Layout,
    Lookup,
)

NUM_HELLOS = 10_000
LAYOUTS_PER_HELLO = 16  # distinct in every HELLO: 160,000 layouts in all
KEPT = Layout("kept-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)
# Today's main grew by more than these (see the test's print).
RSS_GROWTH_BOUND_BYTES = 16 << 20
SCRAPE_BOUND_BYTES = 256 << 10


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape_bytes(port: int) -> bytes:
    time.sleep(SNAPSHOT_MAX_AGE_S)  # a younger snapshot would be reused
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as reply:
        return reply.read()


def flood_layouts(i: int) -> list[Layout]:
    return [Layout(f"flood-{i}", LAYOUTS_PER_HELLO, rank, "vllm", "bfloat16", 2, 2, 4, 16, 1000)
            for rank in range(LAYOUTS_PER_HELLO)]


def hello_and_close(socket_path: str, layouts: list[Layout]) -> HelloReply:
    """One connection: HELLO, its reply, close (a raw socket: the fastest way)."""
    with connect(socket_path, timeout_s=30) as sock:
        sock.sendall(encode_frame(Hello(PROTOCOL_VERSION, 0, "flood", layouts)))
        return recv_reply(sock)


def test_ten_thousand_hellos_of_distinct_layouts_leave_rss_and_scrapes_bounded(daemon_factory):
    port = free_port()
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "64KiB",
                            "--metrics-port", str(port))
    with Connection(daemon.socket) as writer:  # a namespace with a cached chunk outlives
        (kept_ns,) = hello(writer, "writer", [KEPT]).namespaces  # its session
        chunk = (7).to_bytes(HASH_BYTES, "little")
        writer.request(Commit(writer.request(Alloc(kept_ns, chunk, [1000])).block_ids))
    rss_before = daemon.info()["rss_private_bytes"]
    scrape_before = len(scrape_bytes(port))
    started = time.monotonic()
    for i in range(NUM_HELLOS):
        reply = hello_and_close(daemon.socket, flood_layouts(i))
        assert isinstance(reply, HelloReply), reply
    flood_s = time.monotonic() - started
    fields = daemon.info()
    rss_after = fields["rss_private_bytes"]
    scrape = scrape_bytes(port)
    print(f"{NUM_HELLOS} HELLOs x {LAYOUTS_PER_HELLO} layouts in {flood_s:.1f} s: daemon RSS "
          f"(private) {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB, scrape "
          f"{scrape_before} -> {len(scrape)} bytes, namespaces {fields['namespaces']}")
    assert rss_after - rss_before < RSS_GROWTH_BOUND_BYTES
    assert len(scrape) < SCRAPE_BOUND_BYTES
    assert fields["namespaces"] <= 1 + LAYOUTS_PER_HELLO  # the kept one, maybe one flood
    with Connection(daemon.socket) as reader:  # the kept namespace and its chunk are intact
        assert hello(reader, "reader", [KEPT]).namespaces == [kept_ns]
        assert reader.request(Lookup([kept_ns], chunk)).num_chunks == 1
