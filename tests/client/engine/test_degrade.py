"""A serving process never fails, or stalls for seconds, because its cache did.

Every client-side failure -- a stopped daemon, a socket or segment this process may not
open, another protocol version, a reply that is not the protocol -- becomes misses and
skipped stores with one warning (client/daemon_link.py); `strict=True` raises. Real
daemon processes (tests/conftest.py), plus a fake daemon thread for the bad replies.
"""

import errno
import itertools
import logging
import os
import signal
import socket
import threading
import time
import types

import msgspec
import posix_ipc
import pytest
import torch

from conftest import start_daemon
from engine_worker import prompt_kv, small_layout
from raw_frames import frame, recv_frame
from lmcached.wire import connection, protocol
from lmcached.client import CacheEngine
from lmcached.client.daemon_link import CacheUnavailable, DaemonLink, default_data_timeout_s
from lmcached.wire.connection import Connection, DaemonError
from lmcached.wire.frames import encode_frame, request_decoder
from lmcached.wire.protocol import MAX_FRAME_BYTES, Hello, HelloReply, LookupReply, Ok, Ping
from lmcached.shm.arena import Arena
from lmcached.wire.socket_path import UnsafeSocketPathError

DATA_TIMEOUT_S = 0.2
STOP_S = 2.0
CALL_LIMIT_S = 1.0  # the data-path timeout plus a generous margin for a loaded 2-core box
RECOVERY_DEADLINE_S = 15.0
TOKENS = list(range(64))  # 4 chunks of 16 tokens


def lmcached_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("lmcached") and r.levelno >= logging.WARNING]


def assert_misses_only(engine: CacheEngine) -> None:
    """Every engine call answers as a miss / skipped store, none raises."""
    layout = engine.layout
    assert engine.lookup(TOKENS) == 0
    assert engine.store(TOKENS, prompt_kv(layout, TOKENS)) == 0
    kv, ret_mask = engine.retrieve(TOKENS)
    assert kv == () and not ret_mask.any()
    with engine.retrieve_views(TOKENS) as views:
        assert views.num_tokens == 0


def assert_misses_with_one_warning(engine: CacheEngine, caplog,
                                   says: str = "unavailable") -> None:
    """Three rounds of calls (later ones retry the connect after the back-off) are all
    misses, and the outage (or the permanent refusal) gave exactly one warning (error)
    that `says` so."""
    for _ in range(3):
        assert_misses_only(engine)
        time.sleep(0.06)
    warnings = lmcached_warnings(caplog)
    assert len(warnings) == 1 and says in warnings[0], warnings


def views_missed(engine: CacheEngine) -> bool:
    with engine.retrieve_views(TOKENS) as views:
        return views.num_tokens == 0


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value is not None and value is not False:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --------------------------------------------------------------- a stopped daemon
def test_a_stopped_daemon_costs_a_call_one_short_timeout_then_backoff(daemon, caplog):
    caplog.set_level(logging.INFO, logger="lmcached")
    layout = small_layout()
    kv = prompt_kv(layout, TOKENS)
    other = list(range(1000, 1064))
    other_kv = prompt_kv(layout, other)
    engine = CacheEngine.connect(layout, socket=daemon.socket, strict=True,
                                 data_timeout_s=DATA_TIMEOUT_S)
    ops = {
        "lookup": lambda: engine.lookup(TOKENS) == 0,
        "store": lambda: engine.store(other, other_kv) == 0,
        "retrieve": lambda: not engine.retrieve(TOKENS)[1].any(),
        "views": lambda: views_missed(engine),
    }
    calls: list[tuple[str, float, bool]] = []  # (op, seconds, answered as a miss)
    try:
        assert engine.store(TOKENS, kv) == 4
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            stop_until = time.monotonic() + STOP_S
            for name in itertools.cycle(ops):
                if time.monotonic() >= stop_until:
                    break
                started = time.perf_counter()
                missed = ops[name]()
                calls.append((name, time.perf_counter() - started, missed))
                time.sleep(0.01)  # a serving loop: one cache call per step
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        durations = [seconds for _, seconds, _ in calls]
        paid = [(name, round(seconds * 1000)) for name, seconds, _ in calls
                if seconds >= 0.9 * DATA_TIMEOUT_S]
        print(f"\nSIGSTOP {STOP_S:.0f} s: {len(calls)} calls, longest "
              f"{max(durations) * 1000:.0f} ms, {len(paid)} paid the "
              f"{DATA_TIMEOUT_S * 1000:.0f} ms timeout: {paid}")
        assert all(missed for _, _, missed in calls), calls
        assert max(durations) < CALL_LIMIT_S, calls
        # The first call pays the timeout; then the backoff window skips the daemon and
        # only the (exponentially rarer) reconnect attempts pay it again.
        assert 1 <= len(paid) <= len(calls) // 4, paid

        # After SIGCONT the engine reconnects after its backoff and hits the stored bytes.
        def hit():
            got, ret_mask = engine.retrieve(TOKENS, return_tuple=False)
            return got if bool(ret_mask.all()) else None

        started = time.monotonic()
        got = wait_for(hit, RECOVERY_DEADLINE_S, "hits after SIGCONT")
        print(f"hits again {time.monotonic() - started:.2f} s after SIGCONT")
        assert torch.equal(got, kv)
        assert engine.store(other, other_kv) == 4
        assert engine.link.num_reconnects == 1
        warnings = lmcached_warnings(caplog)
        assert len(warnings) == 1 and "unavailable" in warnings[0], warnings
    finally:
        engine.close()
    # The requests abandoned at their timeout left no pin and no half-written block.
    wait_for(lambda: (lambda f: f["pinned_blocks"] == 0 and f["writing_blocks"] == 0)(
        daemon.info()), 10, "the daemon to release the abandoned sessions")


def test_a_timed_out_connection_is_dropped_not_reused(daemon):
    conn = Connection(daemon.socket)
    try:
        connection.hello(conn, "stopped")
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            started = time.perf_counter()
            with pytest.raises(TimeoutError):
                conn.request(Ping(), timeout_s=DATA_TIMEOUT_S)
            assert time.perf_counter() - started < CALL_LIMIT_S
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        time.sleep(0.2)  # the late PING reply is on its way: it must never be read
        with pytest.raises(ConnectionError, match="out of step"):
            conn.request(Ping())
    finally:
        conn.close()


def test_data_timeout_comes_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv("LMCACHED_DATA_TIMEOUT_MS", raising=False)
    assert default_data_timeout_s() == 0.2
    monkeypatch.setenv("LMCACHED_DATA_TIMEOUT_MS", "150")
    assert DaemonLink("/nonexistent.sock").data_timeout_s == 0.15
    assert DaemonLink("/nonexistent.sock", data_timeout_s=0.05).data_timeout_s == 0.05
    for bad in ("0", "-5", "soon", "inf"):
        monkeypatch.setenv("LMCACHED_DATA_TIMEOUT_MS", bad)
        with pytest.raises(ValueError, match="LMCACHED_DATA_TIMEOUT_MS"):
            default_data_timeout_s()


# ------------------------------------------------------- failures while connecting
def deny_segment(monkeypatch, error: Exception) -> None:
    def attach(*args, **kwargs):
        raise error

    monkeypatch.setattr(Arena, "attach", attach)


class _DeniedSocket(socket.socket):
    """A socket whose connect fails as a socket of another user's 0600 would (EACCES)."""

    def connect(self, address):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), address)


def world_writable_link(socket_path: str, tmp: str) -> str:
    """The daemon's socket reached through a 0777 directory anyone could have put it in."""
    directory = os.path.join(tmp, "open")
    os.mkdir(directory)
    os.chmod(directory, 0o777)
    os.symlink(socket_path, os.path.join(directory, "d.sock"))
    return os.path.join(directory, "d.sock")


CONNECT_FAILURES = {
    # name: (arrange(monkeypatch, daemon, short_tmp) -> socket path, exception strict raises)
    "segment_permission": (
        lambda mp, d, tmp: deny_segment(mp, posix_ipc.PermissionsError("Permission denied"))
        or d.socket, posix_ipc.PermissionsError),
    "segment_missing": (
        lambda mp, d, tmp: deny_segment(mp, posix_ipc.ExistentialError("No such file"))
        or d.socket, posix_ipc.ExistentialError),
    "segment_not_the_arena": (
        lambda mp, d, tmp: deny_segment(mp, ValueError("not an lmcached arena")) or d.socket,
        ValueError),
    "protocol_version": (
        lambda mp, d, tmp: mp.setattr(connection, "PROTOCOL_VERSION", 999) or d.socket,
        DaemonError),
    "no_socket": (lambda mp, d, tmp: os.path.join(tmp, "nobody.sock"), FileNotFoundError),
    "unsafe_directory": (lambda mp, d, tmp: world_writable_link(d.socket, tmp),
                         UnsafeSocketPathError),
    "socket_eacces": (
        lambda mp, d, tmp: mp.setattr(connection.socket, "socket", _DeniedSocket) or d.socket,
        PermissionError),
}
# Failures only a change of settings lifts: one error with the fix, a long back-off.
PERMANENT_FAILURES = {"protocol_version": "use an lmcached client of the daemon's version",
                      "socket_eacces": "--allow-group"}


@pytest.mark.parametrize("failure", sorted(CONNECT_FAILURES))
def test_a_failed_connect_degrades_to_misses_with_one_warning(failure, daemon, short_tmp,
                                                              monkeypatch, caplog):
    arrange, strict_error = CONNECT_FAILURES[failure]
    path = arrange(monkeypatch, daemon, short_tmp)
    layout = small_layout()
    with pytest.raises(strict_error) as raised:
        CacheEngine.connect(layout, socket=path, strict=True)
    if strict_error is DaemonError:
        assert raised.value.code == "version"
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="lmcached")
    engine = CacheEngine.connect(layout, socket=path, data_timeout_s=DATA_TIMEOUT_S)
    try:
        assert engine.link.hello_reply is None
        if failure in PERMANENT_FAILURES:
            assert_misses_with_one_warning(engine, caplog, "refuses this client")
            assert PERMANENT_FAILURES[failure] in lmcached_warnings(caplog)[0]
        else:
            assert_misses_with_one_warning(engine, caplog)
    finally:
        engine.close()
    monkeypatch.undo()
    assert daemon.info()["pinned_blocks"] == 0


# ---------------------------------------------------------- replies out of protocol
GARBAGE_FRAMES = {
    "invalid_utf8": frame(b"\x91\xa2\xff\xfe"),  # a str that is not UTF-8
    "truncated": frame(msgspec.msgpack.encode(LookupReply(3))[:-1]),
    "wrong_field_type": frame(msgspec.msgpack.encode(["lookup_reply", "many"])),
    "wrong_reply_type": encode_frame(Ok()),  # not what any data-path request expects
    "oversized": frame(b"", MAX_FRAME_BYTES + 1),
    "closed": b"",
}


class FakeDaemon:
    """A Unix-socket server thread that speaks the frame format but answers `garbage`.

    Args:
        path: socket path to listen on.
        garbage: raw bytes sent as the answer (b"": close the connection instead).
        greet: answer HELLO properly (so the garbage reaches the data path) or not.
    """

    def __init__(self, path: str, garbage: bytes, greet: bool) -> None:
        self.garbage, self.greet = garbage, greet
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        self.listener.settimeout(0.1)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            while True:
                try:
                    payload = recv_frame(conn)
                except ConnectionResetError:
                    return
                request = request_decoder.decode(payload)
                if isinstance(request, Hello) and self.greet:
                    conn.sendall(encode_frame(HelloReply(1, "fake", 1, 4096, 16, 65536, [7], 0)))
                elif self.garbage:
                    conn.sendall(self.garbage)
                else:
                    return

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize("greet", [False, True], ids=["on_hello", "on_data_path"])
@pytest.mark.parametrize("garbage", sorted(GARBAGE_FRAMES))
def test_a_reply_out_of_protocol_degrades_to_a_miss(garbage, greet, short_tmp, monkeypatch,
                                                    caplog):
    path = os.path.join(short_tmp, "fake.sock")
    fake = FakeDaemon(path, GARBAGE_FRAMES[garbage], greet)
    # The fake's HELLO names no real segment: map a stand-in (the data path never
    # reaches the arena, since every request fails).
    monkeypatch.setattr(Arena, "attach", lambda *a, **k: types.SimpleNamespace(
        generation=1, close=lambda: None))
    caplog.set_level(logging.WARNING, logger="lmcached")
    layout = small_layout()
    try:
        if not greet:
            with pytest.raises(ConnectionError):
                CacheEngine.connect(layout, socket=path, strict=True)
        engine = CacheEngine.connect(layout, socket=path, data_timeout_s=DATA_TIMEOUT_S)
        try:
            assert_misses_with_one_warning(engine, caplog)
        finally:
            engine.close()
    finally:
        fake.stop()


@pytest.mark.parametrize("garbage", ["invalid_utf8", "wrong_reply_type", "truncated"])
def test_a_connection_that_got_a_bad_reply_refuses_further_requests(garbage, short_tmp):
    path = os.path.join(short_tmp, "fake.sock")
    fake = FakeDaemon(path, GARBAGE_FRAMES[garbage], greet=True)
    try:
        with Connection(path, timeout_s=2) as conn:
            with pytest.raises(ConnectionError):
                conn.request(protocol.Lookup([1], bytes(16)))
            with pytest.raises(ConnectionError, match="out of step"):
                conn.request(Ping())
    finally:
        fake.stop()


@pytest.mark.parametrize("error", [
    msgspec.ValidationError("bad"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"),
    TimeoutError("timed out"), ValueError("too large"), RuntimeError("anything else"),
])
def test_any_request_failure_but_a_refusal_becomes_cache_unavailable(error, daemon,
                                                                     monkeypatch):
    link = DaemonLink(daemon.socket, layouts=[small_layout().to_wire()])
    try:
        ns = link.ensure_connected().namespaces

        def fail(self, message, timeout_s=None):
            raise error

        monkeypatch.setattr(Connection, "request", fail)
        with pytest.raises(CacheUnavailable):
            link.request(protocol.Lookup(ns, bytes(16)))
        assert link.hello_reply is None  # dropped: a late reply must not answer the next one
    finally:
        link.close()


def test_a_failing_detach_hook_does_not_block_the_reconnect_to_a_restarted_daemon(
        unique_name, short_tmp, caplog):
    # e.g. cuda_register=True on a host whose cudaHostUnregister raises
    path = os.path.join(short_tmp, "d.sock")
    args = ("--capacity", "16MiB", "--block-size", "64KiB")
    first = start_daemon(unique_name, path, os.path.join(short_tmp, "1.log"), *args)
    second = None
    link = DaemonLink(path, layouts=[small_layout().to_wire()], data_timeout_s=1.0)

    def broken_detach(arena):
        raise RuntimeError("cudaHostUnregister failed")

    link.on_detach = broken_detach
    try:
        link.try_connect(strict=True)
        old_generation = link.generation
        first.stop()
        second = start_daemon(unique_name, path, os.path.join(short_tmp, "2.log"), *args)

        def reconnected():
            try:
                link.request(protocol.Lookup(link.ensure_connected().namespaces, bytes(16)))
            except CacheUnavailable:  # the loss is noticed, then the backoff
                return None
            return link.generation != old_generation

        wait_for(reconnected, 10, "the reconnect to the restarted daemon")
        assert link.arena.generation == link.generation != old_generation
        assert "detach hook failed" in caplog.text
    finally:
        try:
            link.close()
        finally:
            first.stop()
            if second is not None:
                second.stop()
