"""The metrics endpoint against a hostile local process (`metrics_http.py`, the snapshot
reuse of `metrics.py`), on real daemons.

Any local process can open the metrics port. What it sends there (a flood of scrapes,
idle or half-open connections, junk) must not cost the daemon's clients their service,
must not stop legitimate scrapes for long, and must not keep the daemon from stopping.
Each test checks the daemon afterwards: bytes stored come back equal, counters agree
with INFO, threads and descriptors are back within their bounds.
"""

import errno
import re
import resource
import signal
import socket
import threading
import time

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcached.client import CacheEngine
from lmcached.daemon.metrics import SNAPSHOT_MAX_AGE_S, SnapshotChannel
from lmcached.daemon.metrics_http import (
    MAX_REQUEST_BYTES,
    MAX_SCRAPE_CONNECTIONS,
    MAX_SCRAPES_PER_S,
    SCRAPE_IO_TIMEOUT_S,
)
from lmcached.wire.connection import Connection
from lmcached.wire.protocol import Ping
from lmcached.shm.janitor import list_segments
from test_metrics import LAYOUT, PROMPT_TOKENS, free_port, fresh_scrape, make_kv, scrape

FLOOD_THREADS = 8
FLOOD_S = 3.0


def store_and_read_back(engine: CacheEngine, seed: int) -> None:
    """Store one prompt's KV and read it back: the bytes are equal."""
    tokens = torch.arange(PROMPT_TOKENS) + 1000 * seed
    kv = make_kv(PROMPT_TOKENS, seed)
    engine.store(tokens, kv)
    got, hit = engine.retrieve(tokens, return_tuple=False)
    assert bool(hit.all()) and torch.equal(got, kv)


def assert_counts_agree_with_info(daemon, port: int) -> None:
    info = daemon.info()
    samples = fresh_scrape(port)
    assert samples[("lmcached_up",)] == 1
    assert samples[("lmcached_requests_total",)] == info["requests"]
    assert samples[("lmcached_connections_total",)] == info["connections_received"]
    assert samples[("lmcached_stores_total",)] == info["stores"]
    assert "Traceback" not in daemon.log()


# ------------------------------------------------------------------ (a) a flood
def test_a_snapshot_is_reused_by_every_scrape_while_younger_than_its_max_age():
    """Eight threads scraping at once cost the loop one snapshot, not one each; once the
    snapshot is older than max_age_s the next scrape gets a new one."""
    channel = SnapshotChannel(max_age_s=SNAPSHOT_MAX_AGE_S)
    taken = []
    woken = threading.Event()
    stop = threading.Event()

    def loop() -> None:  # what server.py does: serve pending scrapes when woken
        while not stop.is_set():
            if woken.wait(0.01):
                woken.clear()
            if channel.pending:
                channel.serve_pending()

    channel.attach(lambda: taken.append(object()) or taken[-1], woken.set)
    loop_thread = threading.Thread(target=loop)
    loop_thread.start()
    got = []
    try:
        scrapers = [threading.Thread(target=lambda: got.extend(channel.request() for _ in range(10)))
                    for _ in range(FLOOD_THREADS)]
        started = time.monotonic()
        for t in scrapers:
            t.start()
        for t in scrapers:
            t.join()
        assert time.monotonic() - started < SNAPSHOT_MAX_AGE_S, "too slow to tell"
        assert len(got) == 10 * FLOOD_THREADS and set(map(id, got)) == {id(taken[0])}
        time.sleep(SNAPSHOT_MAX_AGE_S)
        assert channel.request() is taken[1] and len(taken) == 2
    finally:
        stop.set()
        loop_thread.join()
        channel.close()


def test_a_scrape_flood_costs_the_loop_one_snapshot_per_interval_and_clients_keep_working(
        daemon_factory):
    port = free_port()
    daemon = daemon_factory("--capacity", "1MiB", "--block-size", "4KiB",
                            "--metrics-port", str(port))
    engine = CacheEngine.connect(LAYOUT, socket=daemon.socket, strict=True)
    stop = threading.Event()
    seen = []  # (lmcached_up, lmcached_requests_total) of every scrape the flood got

    def flood() -> None:
        while not stop.is_set():
            try:
                samples = scrape(port)
            except OSError:  # closed or reset under the flood: allowed
                continue
            seen.append((samples[("lmcached_up",)], samples[("lmcached_requests_total",)]))

    threads = [threading.Thread(target=flood) for _ in range(FLOOD_THREADS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    round_trips = 0
    try:
        while time.monotonic() - started < FLOOD_S:
            store_and_read_back(engine, round_trips)
            round_trips += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    elapsed_s = time.monotonic() - started
    engine.close()
    assert round_trips > 0 and seen
    assert all(up == 1 for up, _ in seen)  # the loop answered every scrape
    # The client's requests move the counter all along; the scrapes saw at most one
    # snapshot per SNAPSHOT_MAX_AGE_S, and at least two.
    snapshots = {requests for _, requests in seen}
    assert 2 <= len(snapshots) <= elapsed_s / SNAPSHOT_MAX_AGE_S + 2, (len(snapshots), len(seen))
    # the HTTP server took at most MAX_SCRAPES_PER_S connections a second
    assert len(seen) <= MAX_SCRAPES_PER_S * elapsed_s + 5, len(seen)
    assert_counts_agree_with_info(daemon, port)


# ------------------------------------------------- (b) idle and half-open connections
def low_fd_limit() -> None:
    """In the daemon's child, before exec: 64 descriptors (the daemon lowers max_clients
    to fit)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def test_idle_connections_to_the_metrics_port_cannot_take_the_descriptors_of_clients(
        daemon_factory):
    """More idle and half-open connections than the daemon has descriptors: it keeps
    MAX_SCRAPE_CONNECTIONS of them (a thread each), closing the oldest for each newer,
    so its clients connect and a scrape gets through."""
    port = free_port()
    daemon = daemon_factory("--capacity", "1MiB", "--block-size", "4KiB",
                            "--metrics-port", str(port), preexec_fn=low_fd_limit)
    proc = psutil.Process(daemon.proc.pid)
    base_threads = proc.num_threads()
    idle = []
    try:
        for i in range(80):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))  # the kernel completes it in the background
            idle.append(sock)
        time.sleep(1.0)
        for sock in idle[::2]:  # half of them send half a request line
            try:
                sock.send(b"GET /metr")
            except OSError:  # not connected yet, or already closed by the daemon
                pass
        with Connection(daemon.socket, timeout_s=10) as conn:
            conn.request(Ping())
        engine = CacheEngine.connect(LAYOUT, socket=daemon.socket, strict=True)
        store_and_read_back(engine, 1)
        engine.close()
        assert scrape(port)[("lmcached_up",)] == 1
        assert proc.num_threads() <= base_threads + MAX_SCRAPE_CONNECTIONS + 1
        assert proc.num_fds() < 64 - 8
    finally:
        for sock in idle:
            sock.close()
    assert_counts_agree_with_info(daemon, port)


def test_a_connection_that_stops_mid_request_is_closed_after_the_timeout_quietly(
        daemon_factory):
    port = free_port()
    daemon = daemon_factory("--capacity", "1MiB", "--metrics-port", str(port))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x")
        sock.settimeout(SCRAPE_IO_TIMEOUT_S + 30)
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed by the daemon, no answer
        assert time.monotonic() - started > SCRAPE_IO_TIMEOUT_S / 2
    assert_counts_agree_with_info(daemon, port)  # and no traceback in its log


# ------------------------------------------------------------------------ (c) junk
def exchange(port: int, data: bytes) -> bytes:
    """Send `data` on a new connection; what came back before the daemon closed it
    (b"" when it reset the connection first)."""
    reply = b""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:  # a reset: what came before it may still be read
            assert exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN), exc
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    return reply


HUGE_HEADERS = b"GET /metrics HTTP/1.1\r\n" + b"".join(
    b"X-%d: %s\r\n" % (i, b"a" * 65000) for i in range(99)) + b"\r\n"
JUNK = {  # request -> the error codes it may get
    "post": (b"POST /metrics HTTP/1.1\r\nContent-Length: 100000000\r\n\r\nxx", {405}),
    "delete": (b"DELETE / HTTP/1.0\r\n\r\n", {405}),
    "random bytes": (bytes(range(256)) * 20 + b"\r\n\r\n", {400}),
    "long request line": (b"GET /" + b"a" * 70000 + b" HTTP/1.0\r\n\r\n", {414, 431}),
    "one long header": (b"GET / HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n", {431}),
    # 6.4 MB of headers, each line under http.client's 64 KiB limit: refused after
    # MAX_REQUEST_BYTES, before the header parser holds the GIL for them
    "huge headers": (HUGE_HEADERS, {431}),
}


def test_a_refused_request_still_being_sent_gets_its_whole_error_reply(daemon_factory):
    """The daemon answers a junk request line at once; the client goes on sending the
    rest of its request (under load it arrives after the daemon's first read). The
    daemon drains it before closing (a close with unread input resets the connection:
    the client's shutdown fails with ENOTCONN and its kernel may drop the reply), so the
    client sends, shuts down and reads the whole reply with no error."""
    port = free_port()
    daemon_factory("--capacity", "1MiB", "--block-size", "4KiB", "--metrics-port", str(port))
    data, _ = JUNK["random bytes"]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        sock.sendall(data[:100])  # the junk request line, and some more
        deadline = time.monotonic() + 30
        while b"Error code: 400" not in sock.recv(65536, socket.MSG_PEEK):
            assert time.monotonic() < deadline, "no error reply"
            time.sleep(0.01)
        time.sleep(0.1)  # the daemon's handler has closed its side (FIN after the reply)
        sock.sendall(data[100:])
        sock.shutdown(socket.SHUT_WR)  # ENOTCONN here if the daemon reset the connection
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert b"Error code: 400" in reply and reply.rstrip().endswith(b"</html>"), reply[-200:]


@pytest.mark.parametrize("name", JUNK)
def test_junk_http_gets_an_error_and_changes_nothing_in_the_daemon(daemon_factory, name):
    port = free_port()
    daemon = daemon_factory("--capacity", "1MiB", "--block-size", "4KiB",
                            "--metrics-port", str(port))
    data, codes = JUNK[name]
    reply = exchange(port, data)
    assert not reply.startswith(b"HTTP/1.0 200"), reply[:200]
    if reply:  # a reset may come before the answer once the daemon stopped reading
        code = re.search(rb"(?:^HTTP/1\.0 |Error code: )(\d{3})", reply)
        assert code and int(code[1]) in codes, reply[:300]
    engine = CacheEngine.connect(LAYOUT, socket=daemon.socket, strict=True)
    store_and_read_back(engine, 2)
    engine.close()
    info = daemon.info()
    assert info["errors"] == 0, {k: v for k, v in info.items() if k.startswith("errors_")}
    assert_counts_agree_with_info(daemon, port)
    assert len(HUGE_HEADERS) > 100 * MAX_REQUEST_BYTES


@pytest.fixture
def metrics_daemon(daemon_factory):
    """(daemon, its metrics port)."""
    port = free_port()
    return daemon_factory("--capacity", "1MiB", "--metrics-port", str(port)), port


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096))
def test_random_bytes_on_the_metrics_port_leave_the_daemon_serving(metrics_daemon, data):
    daemon, port = metrics_daemon
    assert not exchange(port, data).startswith(b"HTTP/1.0 200")
    with Connection(daemon.socket, timeout_s=10) as conn:
        conn.request(Ping())
    assert daemon.info()["errors"] == 0


# -------------------------------------------------------- (d) a stop under scrapes
def test_sigterm_with_scrapes_in_flight_stops_within_seconds_and_leaves_nothing(
        daemon_factory):
    port = free_port()
    daemon = daemon_factory("--capacity", "8MiB", "--metrics-port", str(port))
    engine = CacheEngine.connect(LAYOUT, socket=daemon.socket, strict=True)
    store_and_read_back(engine, 3)
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                scrape(port)
            except OSError:
                time.sleep(0.01)

    threads = [threading.Thread(target=flood) for _ in range(FLOOD_THREADS)]
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    idle[0].sendall(b"GET /metr")
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        started = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=30) == 0
        stop_s = time.monotonic() - started
    finally:
        stop.set()
        for t in threads:
            t.join()
        for sock in idle:
            sock.close()
        engine.close()
    assert stop_s < 10.0, stop_s
    assert list_segments(daemon.name) == []
    assert "Traceback" not in daemon.log() and "stopped" in daemon.log()
