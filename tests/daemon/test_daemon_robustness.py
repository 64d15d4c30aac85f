"""Garbage on the socket never crashes the daemon (hypothesis-generated inputs)."""

import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import is_release_frame
from raw_frames import connect, frame, read_until_eof
from lmcached.wire.connection import Connection, hello
from lmcached.wire.frames import encode_frame, reply_decoder
from lmcached.wire.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Acquire,
    Alloc,
    Clients,
    Commit,
    Hello,
    Info,
    Layout,
    Lookup,
    Ok,
    Ping,
    Release,
)
from lmcached.shm.janitor import list_segments
from test_metrics import free_port

LAYOUT = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)
FUZZ_HELLO = Hello(PROTOCOL_VERSION, 1, "fuzz", [LAYOUT])
TAGS = ["hello", "lookup", "acquire", "release", "alloc", "commit", "abort", "put", "get",
        "delete", "scan", "info", "clients", "evict", "clear", "ping", "config_get", "nope"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=64),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5), max_leaves=12)



PAYLOADS = st.one_of(
    st.binary(max_size=512),  # raw bytes, often an incomplete or huge length prefix
    st.binary(max_size=512).map(frame),  # a well-framed non-msgpack payload
    st.tuples(st.sampled_from(TAGS), st.lists(VALUES, max_size=4)).map(
        lambda t: frame(msgspec.msgpack.encode([t[0], *t[1]]))  # msgpack with wrong types
    ),
    st.integers(min_value=MAX_FRAME_BYTES + 1, max_value=2**32 - 1).map(
        lambda n: frame(b"x" * 16, n)  # oversized frame header
    ),
    # Well-typed v2 requests of the new shapes: RELEASE of any leases (no reply), LOOKUP
    # and ACQUIRE of any namespace lists.
    st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1), max_size=6).map(
        lambda leases: encode_frame(Release(leases))
    ),
    st.tuples(st.sampled_from([Lookup, Acquire]),
              st.lists(st.integers(min_value=-3, max_value=5), max_size=4),
              st.binary(max_size=80)).map(lambda t: encode_frame(t[0](t[1], t[2]))),
)


def send_garbage(path: str, greet: bool, data: bytes) -> None:
    sock = connect(path)
    if greet:
        sock.sendall(encode_frame(FUZZ_HELLO))
        sock.recv(4096)
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):  # the daemon answers what it can, then closes at EOF
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass  # the daemon dropped a connection that sent a bad frame: allowed
    finally:
        sock.close()


@pytest.mark.slow
def test_daemon_survives_garbage_and_releases_everything(daemon):
    admin = Connection(daemon.socket)
    hello(admin, "admin")

    @settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(greet=st.booleans(), chunks=st.lists(PAYLOADS, min_size=1, max_size=4))
    def fuzz(greet, chunks):
        send_garbage(daemon.socket, greet, b"".join(chunks))
        admin.request(Ping())  # still serving

    fuzz()
    deadline = time.monotonic() + 10
    while True:
        sections = admin.request(Info()).sections
        if sections["clients"]["connected_clients"] == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sections["clients"]["connected_clients"] == 1
    assert sections["blocks"]["pinned_blocks"] == 0
    assert sections["blocks"]["writing_blocks"] == 0
    assert sections["stats"]["errors"] > 0
    assert daemon.proc.poll() is None
    admin.close()


def session_names(conn: Connection) -> list[str]:
    """Names of the daemon's sessions (CLIENTS)."""
    return [row["name"] for row in conn.request(Clients()).clients]


@pytest.mark.parametrize("ending", ["close", pytest.param("timeout", marks=pytest.mark.slow)])
def test_a_truncated_frame_closes_that_connection_and_ends_its_session(daemon, ending):
    """A frame cut short, then EOF ("close") or nothing more ("timeout", after
    PARTIAL_FRAME_TIMEOUT_S): the daemon closes that connection, releases what its
    session pinned, and serves the others."""
    admin = Connection(daemon.socket)
    ns = hello(admin, "admin", [LAYOUT]).namespaces[0]
    hashes = b"".join(i.to_bytes(16, "little") for i in range(3))
    admin.request(Commit(admin.request(Alloc(ns, hashes, [1000] * 3)).block_ids))
    victim = Connection(daemon.socket, timeout_s=30)
    hello(victim, "truncated", [LAYOUT])
    assert len(victim.request(Acquire([ns], hashes)).block_ids) == 3  # pins 3 blocks
    assert "truncated" in session_names(admin) and daemon.pins_held() == 3
    sock = victim._sock  # the raw stream: send what no Connection would
    payload = encode_frame(Ping())
    sock.sendall(payload[:-1])
    if ending == "close":
        sock.shutdown(socket.SHUT_WR)
    assert sock.recv(16) == b""  # the daemon closed it: at EOF, or after the timeout
    victim.close()
    stats = admin.request(Info("stats")).sections["stats"]
    assert stats.get("errors_partial_frame_timeout", 0) == int(ending == "timeout")
    assert stats.get("errors_truncated_frame", 0) == int(ending == "close")
    assert session_names(admin) == ["admin"]
    assert daemon.pins_held() == 0 and daemon.info()["pinned_blocks"] == 0
    admin.request(Ping())
    admin.close()


def test_oversized_frame_closes_only_that_connection(daemon):
    other = Connection(daemon.socket)
    sock = connect(daemon.socket)
    sock.sendall(frame(b"", MAX_FRAME_BYTES + 1))
    assert sock.recv(16) == b""  # closed by the daemon
    sock.close()
    other.request(Ping())
    assert other.request(Info("stats")).sections["stats"]["errors_frame_too_large"] == 1
    assert "1048577-byte frame" in daemon.log() and "closing session" in daemon.log()
    other.close()


@pytest.mark.slow
def test_a_stream_of_mutated_frames_through_the_socket_leaves_no_pins(daemon):
    """The in-process fuzzer's frames (tests/daemon/test_frame_fuzz.py), pipelined through a
    real daemon on several connections that then close: it answers each, keeps serving,
    and ends with nothing pinned or being written."""
    import random

    from test_frame_fuzz import chunk_hashes, mutate, seed_requests

    from test_frame_fuzz import RANK0, RANK1

    writer = Connection(daemon.socket)
    ns, _ = hello(writer, "writer", [RANK0, RANK1]).namespaces
    for namespace in (ns, ns + 1):
        stored = writer.request(Alloc(namespace, chunk_hashes(range(8)), [1000] * 8))
        writer.request(Commit(stored.block_ids))
    rng = random.Random(1234)
    num_frames = num_releases = 0
    for _ in range(10):
        sock = connect(daemon.socket, timeout_s=30)
        # Lease ids are daemon-wide and sequential: this connection's first ACQUIRE
        # gets the one after the writer's, so the fuzzed RELEASEs free real pins too.
        first_lease = writer.request(Acquire([ns], chunk_hashes([0]))).lease + 1
        writer.send(Release([first_lease - 1]))
        stream = [encode_frame(Hello(PROTOCOL_VERSION, 1, "fuzz", [RANK0, RANK1]))]
        expected_replies = 1
        for _ in range(500):
            payload = mutate(rng.choice(seed_requests(ns, rng, first_lease)), rng)
            stream.append(frame(payload))
            is_release = is_release_frame(payload)
            num_releases += is_release
            expected_replies += not is_release
        stream.append(encode_frame(Ping()))  # still in step after it all: its Ok comes last
        expected_replies += 1
        sock.sendall(b"".join(stream))
        sock.shutdown(socket.SHUT_WR)
        frames = read_until_eof(sock)
        # One reply per frame but a RELEASE, none lost, none extra, in step to the end.
        assert len(frames) == expected_replies, daemon.log()[-1500:]
        assert isinstance(reply_decoder.decode(frames[-1]), Ok)
        num_frames += len(stream)
        sock.close()
    writer.close()
    admin = Connection(daemon.socket)
    deadline = time.monotonic() + 10
    while admin.request(Info("clients")).sections["clients"]["connected_clients"] > 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    blocks = admin.request(Info("blocks")).sections["blocks"]
    assert blocks["pinned_blocks"] == 0 and blocks["writing_blocks"] == 0
    assert blocks["free_blocks"] + blocks["cached_blocks"] == blocks["num_blocks"]
    assert daemon.proc.poll() is None
    assert num_frames >= 5000 and num_releases > 0
    admin.close()


def allocated_bytes(segment: str) -> int:
    """Bytes of /dev/shm/`segment` backed by pages: how far its prefault has reserved."""
    return os.stat(os.path.join("/dev/shm", segment)).st_blocks * 512


def wait_until_stopped(pid: int, deadline_s: float = 10.0) -> None:
    """Wait until process `pid` is stopped (SIGSTOP is delivered asynchronously)."""
    deadline = time.monotonic() + deadline_s
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


def test_sigterm_during_the_prefault_stops_cleanly_while_scrapes_run(unique_name, short_tmp):
    """A stop while the arena is prefaulted (systemd stops a daemon that is starting;
    Prometheus scrapes it meanwhile and gets lmcached_up 0): exit status 0 within
    seconds, the half-built arena unlinked, the port and socket released. Without the
    handlers installed before the prefault, SIGTERM killed the process and left the
    whole arena in /dev/shm.

    No timing assumption: the daemon is frozen (SIGSTOP) once its prefault has reserved
    part of the arena and not all of it, so at least one prefault step, and the stop
    check after it, still lies ahead when SIGTERM and SIGCONT arrive, however loaded the
    machine. Scrapes start only until then: one that started later could reach another
    process that took the port after the daemon released it."""
    port = free_port()
    socket_path = os.path.join(short_tmp, "d.sock")
    log_path = os.path.join(short_tmp, "d.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmcached.cli", "serve", "--name", unique_name, "--socket",
             socket_path, "--capacity", "2GiB", "--metrics-port", str(port)],
            stdout=log, stderr=subprocess.STDOUT)
    ups = []
    stop_scraping = threading.Event()

    def scrape_while_starting() -> None:
        while not stop_scraping.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=10) as reply:
                    ups.append("lmcached_up 0.0" in reply.read().decode())
            except (OSError, http.client.HTTPException):  # not listening yet, or cut by the exit
                time.sleep(0.01)

    scraper = threading.Thread(target=scrape_while_starting)
    scraper.start()
    try:
        deadline = time.monotonic() + 60
        while True:  # scraped, and the prefault has reserved more than the header's page
            segments = list_segments(unique_name)
            if ups and segments and allocated_bytes(segments[0]) > 1 << 20:
                break
            assert proc.poll() is None, "the daemon exited during its start-up"
            assert time.monotonic() < deadline, "no scrape answered, or no prefault began"
            time.sleep(0.005)
        proc.send_signal(signal.SIGSTOP)
        wait_until_stopped(proc.pid)
        reserved = allocated_bytes(segments[0])
        assert reserved < 2 << 30, "the prefault ended before the daemon was frozen"
        stop_scraping.set()  # a scrape in flight is answered during the stop, or cut
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 10
    finally:
        stop_scraping.set()
        scraper.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with open(log_path) as f:
        log_text = f.read()
    assert "received SIGTERM during start-up: stopped" in log_text, log_text[-2000:]
    assert ups and all(ups)  # every scrape during the start-up said lmcached_up 0
    assert list_segments(unique_name) == []
    assert not os.path.exists(socket_path)
    with socket.socket() as probe:  # nothing listens on the metrics port any more
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
