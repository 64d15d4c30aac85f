"""Limits after Redis: no client or crowd of clients can stall, starve or bloat the daemon.

Real daemon processes: pipelined frames answered in order, fairness between a flooding
client and a quiet one, replies a client does not read, unfinished frames, idle and
silent connections, max clients, the total buffer budget, and a flood of idle
connections under a 1024 file-descriptor limit.
"""

import resource
import statistics
import threading
import time

import psutil
import pytest
from click.testing import CliRunner

from raw_frames import connect, frame, read_replies, split_frames
from lmcached.cli import main
from lmcached.daemon.connection import SILENT_GRACE_S
from lmcached.wire.connection import Connection, DaemonError, hello
from lmcached.wire.frames import encode_frame
from lmcached.wire.protocol import (
    MAX_FRAME_BYTES,
    Error,
    Info,
    InfoReply,
    Layout,
    Lookup,
    Ok,
    Ping,
    Release,
)

LAYOUT = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)


def ping_latency_s(path: str) -> float:
    """Connect, HELLO, PING: what `lmcached ping` does, timed."""
    started = time.perf_counter()
    with Connection(path, timeout_s=5.0) as conn:
        hello(conn, "probe")
        conn.request(Ping())
    return time.perf_counter() - started


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_frames_sent_in_one_write_are_all_answered_in_order(daemon):
    """Every frame gets its reply, in order; a RELEASE (which has no reply, even when
    refused) takes no place among them."""
    sock = connect(daemon.socket)
    frames = [Ping(), Info("stats"), Lookup([1], b"\x00" * 16), Release([5]), Ping(),
              Info("nope")]
    sock.sendall(b"".join(encode_frame(f) for f in frames))
    replies = read_replies(sock, len(frames) - 1)
    assert isinstance(replies[0], Ok)
    assert isinstance(replies[1], InfoReply) and "stats" in replies[1].sections
    assert isinstance(replies[2], Error) and replies[2].code == "no_session"  # before HELLO
    assert isinstance(replies[3], Ok)
    assert isinstance(replies[4], Error) and replies[4].code == "bad_request"
    sock.close()
    assert daemon.info()["errors_no_session"] == 2  # the LOOKUP's and the RELEASE's


def test_invalid_utf8_frame_gets_bad_request_and_daemon_serves_on(daemon):
    sock = connect(daemon.socket)
    sock.sendall(frame(b"\x91\xa2\xff\xfe") + encode_frame(Ping()))
    bad, pong = read_replies(sock, 2)
    assert isinstance(bad, Error) and bad.code == "bad_request"
    assert isinstance(pong, Ok)
    sock.close()
    assert daemon.proc.poll() is None
    assert daemon.info()["errors_bad_request"] == 1


def test_a_flooding_client_does_not_starve_a_quiet_one(daemon):
    """One client pipelines INFO and PING frames as fast as the daemon takes them; the
    other's PING round trips stay short (bounded work per client per loop pass)."""
    num_flood = 100_000
    flood = connect(daemon.socket, timeout_s=60)
    one = encode_frame(Info("stats")) + encode_frame(Ping()) * 3
    payload = one * (num_flood // 4)
    received = {"frames": 0}

    def drain():
        buf = b""
        while received["frames"] < num_flood:
            data = flood.recv(1 << 20)
            if not data:
                return
            payloads, buf = split_frames(buf + data)
            received["frames"] += len(payloads)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    writer = threading.Thread(target=flood.sendall, args=(payload,), daemon=True)
    writer.start()
    quiet = Connection(daemon.socket)
    hello(quiet, "quiet")
    latencies = []
    while writer.is_alive() or received["frames"] < num_flood * 0.9:
        started = time.perf_counter()
        quiet.request(Ping())
        latencies.append(time.perf_counter() - started)
        time.sleep(0.001)
        if len(latencies) > 20_000:
            break
    writer.join(60)
    reader.join(60)
    quiet.close()
    flood.close()
    assert received["frames"] == num_flood
    latencies.sort()
    p50 = latencies[len(latencies) // 2]
    p99 = latencies[int(len(latencies) * 0.99)]
    print(f"quiet client's PING during a {num_flood}-frame flood: n={len(latencies)} "
          f"p50={p50 * 1e3:.2f} ms p99={p99 * 1e3:.2f} ms max={latencies[-1] * 1e3:.1f} ms")
    assert len(latencies) >= 20
    assert p99 < 0.1, f"p99 {p99 * 1e3:.1f} ms"


def test_clients_that_do_not_read_replies_do_not_grow_the_daemon(daemon):
    """20 clients pipeline INFO without reading a reply: the daemon stops reading them
    (their own sockets fill up) instead of buffering replies; a fresh ping answers."""
    proc = psutil.Process(daemon.proc.pid)
    rss_before = proc.memory_info().rss
    frame = encode_frame(Info())
    socks = []
    for _ in range(20):
        sock = connect(daemon.socket)
        sock.setblocking(False)
        sent = 0
        try:
            while sent < 8 << 20:  # at most 8 MiB of requests each
                sent += sock.send(frame * 1000)
        except BlockingIOError:
            pass
        socks.append(sock)
    time.sleep(1.0)
    assert ping_latency_s(daemon.socket) < 1.0
    grown = proc.memory_info().rss - rss_before
    print(f"daemon RSS grew by {grown / 2**20:.1f} MiB under 20 non-reading pipelining clients")
    assert grown < 64 << 20
    for sock in socks:
        sock.close()


@pytest.mark.slow
def test_unfinished_frame_is_dropped_after_a_few_seconds(daemon):
    sock = connect(daemon.socket)
    sock.sendall(frame(b"x" * 10, 1000))  # 10 of 1000 bytes, then nothing
    started = time.monotonic()
    assert sock.recv(16) == b""  # the daemon closes it
    waited = time.monotonic() - started
    assert 4.0 < waited < 9.0, waited
    assert daemon.info()["errors_partial_frame_timeout"] == 1
    sock.close()


def test_idle_timeout_closes_idle_sessions_only(daemon_factory):
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "1MiB", "--idle-timeout", "1")
    idle = Connection(daemon.socket)
    hello(idle, "idle", [LAYOUT])
    busy = Connection(daemon.socket)
    hello(busy, "busy")
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        busy.request(Ping())
        time.sleep(0.2)
    with pytest.raises(ConnectionError):
        idle.request(Ping())
    busy.request(Ping())
    assert daemon.info()["errors_idle_timeout"] == 1
    idle.close()
    busy.close()


def test_max_clients_refuses_with_an_error_but_sheds_silent_connections(daemon_factory):
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "1MiB", "--max-clients", "3")
    talking = [Connection(daemon.socket) for _ in range(2)]
    for conn in talking:
        hello(conn, "talking")
    silent = connect(daemon.socket)  # never sends a byte
    wait_for(lambda: talking[0].request(Info("clients")).sections["clients"]
             ["connected_clients"] == 3, what="3 clients")
    time.sleep(SILENT_GRACE_S + 0.1)
    # A fourth client gets in: the silent connection makes room.
    assert ping_latency_s(daemon.socket) < 2.0
    assert silent.recv(16) == b""
    # With every slot held by a client that talks, the next one is refused with an error.
    talking.append(Connection(daemon.socket))
    hello(talking[-1], "third")
    refused = connect(daemon.socket)
    (reply,) = read_replies(refused, 1)
    assert isinstance(reply, Error) and reply.code == "max_clients"
    assert refused.recv(16) == b""
    for conn in talking:
        conn.request(Ping())  # the admitted ones are unaffected
        conn.close()
    refused.close()
    silent.close()
    info = daemon.info()
    assert info["errors_max_clients"] >= 1 and info["errors_max_clients_silent_dropped"] == 1


def test_a_client_refused_at_max_clients_always_learns_max_clients(daemon_factory):
    """The refusal is an Error frame and a close, often before the client writes its
    HELLO: the write then fails with EPIPE, and the reply waiting unread must still be
    what the client reports, not `[Errno 32] Broken pipe` (`lmcached` printed that)."""
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "1MiB", "--max-clients", "1")
    holder = Connection(daemon.socket)
    hello(holder, "holder")
    refused = Connection(daemon.socket, timeout_s=5.0)
    wait_for(refused.peer_closed, what="the daemon closes the refused connection")
    with pytest.raises(DaemonError) as caught:  # the write fails: EPIPE
        hello(refused, "late")
    assert caught.value.code == "max_clients"
    assert "max number of clients reached (1; see --max-clients)" in str(caught.value)
    with pytest.raises(ConnectionError, match="out of step"):  # that connection is over
        refused.request(Ping())
    refused.close()
    for _ in range(5):  # the CLI, whatever the race between its write and the close
        result = CliRunner().invoke(main, ["ping", "--socket", daemon.socket])
        assert result.exit_code == 1 and result.stderr == (
            "Error: max_clients: max number of clients reached (1; see --max-clients)\n")
    holder.request(Ping())  # the admitted one is unaffected
    holder.close()


def test_buffer_budget_drops_the_clients_holding_the_most(daemon_factory):
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "1MiB",
                            "--buffer-budget", "4MiB")
    proc = psutil.Process(daemon.proc.pid)
    keeper = Connection(daemon.socket)
    hello(keeper, "keeper")
    rss_before = proc.memory_info().rss
    hoarders = []
    for _ in range(12):  # each holds most of a 1 MiB frame, unfinished: 12 MiB in all
        sock = connect(daemon.socket)
        try:
            sock.sendall(frame(b"x" * (MAX_FRAME_BYTES - 100), MAX_FRAME_BYTES))
        except (BrokenPipeError, ConnectionResetError):
            pass  # already dropped
        hoarders.append(sock)
    wait_for(lambda: daemon.info()["errors_buffer_budget"] >= 8, what="hoarders dropped")
    keeper.request(Ping())
    assert ping_latency_s(daemon.socket) < 1.0
    grown = proc.memory_info().rss - rss_before
    print(f"daemon RSS grew by {grown / 2**20:.1f} MiB with 12 clients holding 1 MiB frames "
          f"under a 4 MiB budget")
    assert grown < 16 << 20
    for sock in hoarders:
        sock.close()
    keeper.close()


def _limit_fds_to_1024():
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


@pytest.mark.slow
def test_idle_flood_under_a_1024_fd_limit_neither_spins_nor_locks_out_a_ping(daemon_factory):
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "1MiB",
                            preexec_fn=_limit_fds_to_1024)
    proc = psutil.Process(daemon.proc.pid)
    assert proc.rlimit(psutil.RLIMIT_NOFILE) == (1024, 1024)
    flood = []
    deadline = time.monotonic() + 30.0
    while len(flood) < 1064 and time.monotonic() < deadline:
        try:
            flood.append(connect(daemon.socket, timeout_s=2.0))
        except BlockingIOError:
            time.sleep(0.001)  # the listen backlog is full while the daemon catches up
    assert len(flood) == 1064
    time.sleep(1.0)
    cpu_before = sum(proc.cpu_times()[:2])
    latencies = [ping_latency_s(daemon.socket) for _ in range(20)]
    time.sleep(2.0)
    cpu_s = sum(proc.cpu_times()[:2]) - cpu_before
    log_lines = [line for line in daemon.log().splitlines() if "accept failed" in line]
    print(f"flood of {len(flood)} idle connections under a 1024 fd limit: ping median "
          f"{statistics.median(latencies) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms; "
          f"daemon CPU {cpu_s:.2f} s in ~2.5 s; {len(log_lines)} 'accept failed' log lines")
    assert statistics.median(latencies) < 0.1
    assert max(latencies) < 1.0
    assert cpu_s < 0.5, "the daemon spins"
    assert len(log_lines) < 20
    for sock in flood:
        sock.close()
    assert daemon.proc.poll() is None


def test_out_of_descriptors_the_daemon_backs_off_instead_of_spinning(daemon):
    """Every descriptor used by clients that talk (none to shed): accept() fails with
    EMFILE; the daemon pauses accepting and logs once, and takes the waiting clients as
    soon as descriptors are free again."""
    proc = psutil.Process(daemon.proc.pid)
    proc.rlimit(psutil.RLIMIT_NOFILE, (48, 48))
    talking = []
    while True:  # fill every descriptor with a client that said HELLO
        conn = Connection(daemon.socket, timeout_s=0.5)
        try:
            hello(conn, "talking")
        except OSError:  # TimeoutError: it waits in the listen backlog
            waiting = conn
            break
        talking.append(conn)
    assert 20 < len(talking) < 48
    cpu_before = sum(proc.cpu_times()[:2])
    time.sleep(2.0)
    cpu_s = sum(proc.cpu_times()[:2]) - cpu_before
    log_lines = [line for line in daemon.log().splitlines() if "accept failed" in line]
    print(f"out of descriptors with {len(talking)} clients: daemon CPU {cpu_s:.2f} s in 2 s, "
          f"{len(log_lines)} 'accept failed' log line(s)")
    assert cpu_s < 0.3, "the daemon spins on accept"
    assert 1 <= len(log_lines) <= 2, daemon.log()[-3000:]
    assert "Too many open files" in log_lines[0]
    waiting.close()
    for conn in talking[:5]:
        conn.close()
    late = Connection(daemon.socket)  # taken within the back-off once descriptors are free
    hello(late, "late")
    late.request(Ping())
    assert late.request(Info("stats")).sections["stats"]["errors_accept_emfile"] >= 1
    late.close()
    for conn in talking[5:]:
        conn.close()
