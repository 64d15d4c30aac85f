"""systemd's notify protocol: READY/STATUS, watchdog pings and STOPPING over a real socket."""

import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from lmcached.launcher import stop_daemon
from lmcached.wire import envs
from lmcached.daemon.notify import SystemdNotifier


@pytest.fixture
def notify_socket():
    """A bound AF_UNIX datagram socket at a short path: (socket, path)."""
    directory = tempfile.mkdtemp(prefix="lmc-n-", dir="/tmp")
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    yield sock, path
    sock.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def clean_env(monkeypatch):
    """No systemd variable of the caller's environment (e.g. a CI service) leaks in."""
    for name in envs.SYSTEMD_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def daemon_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in envs.SYSTEMD_VARS}
    env.update(extra)
    return env


def start_daemon_process(name: str, directory: str, env: dict):
    """`lmcached serve` with a 16 MiB arena, not waited for (it may be held loading)."""
    log = open(os.path.join(directory, "d.log"), "w")
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", "lmcached.cli", "serve", "--name", name, "--socket",
             os.path.join(directory, "d.sock"), "--capacity", "16MiB"], env=env,
            stdout=log, stderr=subprocess.STDOUT)


def receive(sock: socket.socket, timeout_s: float) -> list[str] | None:
    """One datagram as its `KEY=VALUE` lines, or None if none arrives in time."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(4096).decode().split("\n")
    except TimeoutError:
        return None


def receive_until(sock: socket.socket, field: str, timeout_s: float) -> tuple[list, list]:
    """Datagrams up to and including the first with line `field`: (that one, all before)."""
    deadline = time.monotonic() + timeout_s
    before = []
    while (left := deadline - time.monotonic()) > 0:
        lines = receive(sock, left)
        if lines is None:
            break
        if field in lines:
            return lines, before
        before.append(lines)
    raise AssertionError(f"no datagram with {field} within {timeout_s} s; got {before}")


# ------------------------------------------------------------------ the real daemon
def test_daemon_notifies_ready_status_watchdog_and_stopping(daemon_factory, notify_socket):
    sock, path = notify_socket
    daemon = daemon_factory(
        "--capacity", "16MiB", env=daemon_env(NOTIFY_SOCKET=path, WATCHDOG_USEC="200000")
    )
    ready, before = receive_until(sock, "READY=1", timeout_s=10)
    assert f"STATUS=serving on {daemon.socket}" in ready
    assert f"MAINPID={daemon.proc.pid}" in ready
    statuses = [line for lines in before for line in lines if line.startswith("STATUS=")]
    # sent before READY, not after
    assert statuses[0].startswith("STATUS=prefaulting the 16.00M arena: 0% (0B), "), statuses

    # WATCHDOG_USEC=200000: a ping every 0.1 s, so several within one second.
    deadline = time.monotonic() + 1.0
    pings = 0
    while (left := deadline - time.monotonic()) > 0:
        lines = receive(sock, left)
        if lines == ["WATCHDOG=1"]:
            pings += 1
    assert pings >= 2, f"only {pings} WATCHDOG=1 in 1 s with WATCHDOG_USEC=200000"

    daemon.proc.send_signal(signal.SIGTERM)
    stopping, _ = receive_until(sock, "STOPPING=1", timeout_s=10)
    assert "STATUS=stopping" in stopping
    assert daemon.proc.wait(timeout=15) == 0


def test_status_tells_the_prefault_progress_as_it_goes(unique_name, short_tmp, notify_socket):
    """STATUS= is updated about once a second while the arena is prefaulted (it was sent
    once, with no progress, rate or time left). The daemon is held before its first
    step: the test holds the lock daemons reserve their arenas under (shm/pages.py)."""
    sock, path = notify_socket
    lock = os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        daemon = start_daemon_process(unique_name, short_tmp, daemon_env(NOTIFY_SOCKET=path))
    except BaseException:
        os.close(lock)
        raise
    try:
        try:
            statuses = []
            while len(statuses) < 3:  # one at the start, then one a second
                lines = receive(sock, 10)
                assert lines is not None and "READY=1" not in lines, statuses
                statuses += [line for line in lines if line.startswith("STATUS=")]
            assert all(s.startswith("STATUS=prefaulting the 16.00M arena: 0% (0B), 0.00 "
                                    "GB/s, time left unknown yet") for s in statuses), statuses
        finally:
            os.close(lock)  # the daemon goes on
        ready, _ = receive_until(sock, "READY=1", timeout_s=20)
        assert any(line.startswith("STATUS=serving on ") for line in ready)
    finally:
        assert stop_daemon(daemon) == 0


def test_daemon_without_watchdog_sends_no_pings(daemon_factory, notify_socket):
    sock, path = notify_socket
    daemon_factory("--capacity", "16MiB", env=daemon_env(NOTIFY_SOCKET=path))
    receive_until(sock, "READY=1", timeout_s=10)
    assert receive(sock, 0.5) is None


def test_daemon_serves_when_the_service_manager_is_gone(daemon_factory, short_tmp):
    """A notify socket nobody listens on is logged, never fatal: the cache keeps serving."""
    missing = os.path.join(short_tmp, "gone.sock")
    daemon = daemon_factory("--capacity", "16MiB", env=daemon_env(NOTIFY_SOCKET=missing))
    assert daemon.proc.poll() is None
    assert f"systemd notify to {missing} failed" in daemon.log()


# --------------------------------------------------------------- SystemdNotifier unit
def test_notifier_is_disabled_without_notify_socket(clean_env):
    notifier = SystemdNotifier()
    assert not notifier.enabled
    assert notifier.notify("READY=1") is False
    assert notifier.watchdog_interval_s is None


def test_notifier_sends_fields_as_one_datagram(clean_env, notify_socket):
    sock, path = notify_socket
    clean_env.setenv("NOTIFY_SOCKET", path)
    notifier = SystemdNotifier()
    assert notifier.enabled
    assert notifier.notify("READY=1", "STATUS=serving") is True
    assert receive(sock, 2) == ["READY=1", "STATUS=serving"]
    notifier.close()
    assert notifier.notify("WATCHDOG=1") is False  # closed: nothing sent
    assert receive(sock, 0.1) is None


def test_notifier_reaches_an_abstract_namespace_address(clean_env):
    """`@name` in $NOTIFY_SOCKET is the abstract address b"\\0name" (sd_notify(3))."""
    name = f"lmcached-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    try:
        clean_env.setenv("NOTIFY_SOCKET", "@" + name)
        notifier = SystemdNotifier()
        assert notifier.notify("READY=1") is True
        assert receive(sock, 2) == ["READY=1"]
        notifier.close()
    finally:
        sock.close()


def test_failed_send_returns_false_and_logs(clean_env, short_tmp, caplog):
    clean_env.setenv("NOTIFY_SOCKET", os.path.join(short_tmp, "nobody.sock"))
    notifier = SystemdNotifier()
    with caplog.at_level(logging.WARNING, logger="lmcached.daemon.notify"):
        assert notifier.notify("READY=1") is False
    assert "systemd notify to" in caplog.text and "failed" in caplog.text
    notifier.close()


@pytest.mark.parametrize(
    ("usec", "pid", "interval_s"),
    [
        ("30000000", None, 15.0),  # half of WatchdogSec=30s
        ("200000", "self", 0.1),
        ("30000000", "other", None),  # meant for another process: ours stays off
        ("0", None, None),
        ("soon", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec_for_this_pid(clean_env, usec, pid, interval_s):
    if usec is not None:
        clean_env.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        clean_env.setenv("WATCHDOG_PID", str(os.getpid() + (pid == "other")))
    assert SystemdNotifier().watchdog_interval_s == interval_s
