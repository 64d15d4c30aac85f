"""Shared fixtures: unique names, a segment-leak check, and real daemon processes."""

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
import uuid

import msgspec
import psutil
import pytest

from lmcached import launcher
from lmcached.launcher import stop_daemon
from lmcached.wire.connection import Connection, list_clients
from lmcached.wire.frames import request_decoder
from lmcached.wire.protocol import Info, Invalidate, Release
from lmcached.shm.janitor import list_segments
from redis_servers import redis_cluster, redis_server  # noqa: F401

SEGMENT_LEAK_DEADLINE_S = 10.0


# Every daemon or arena a test creates is named after this prefix (see unique_name), so
# the leak check never touches segments of other processes on the machine.
TEST_NAME_PREFIX = f"t{os.getpid()}-"


VLLM_SEGMENT_PREFIX = "vllm_dist_"  # vLLM's TP message queues (tests/client/vllm/)


def our_segments() -> set[str]:
    """Segments in /dev/shm named by this test run, and every one of vLLM's (random
    names: `leaked_segments` tells this run's from other processes')."""
    ours = {s for s in list_segments() if s.startswith(f"lmcached.{TEST_NAME_PREFIX}")}
    return ours | {s for s in os.listdir("/dev/shm") if s.startswith(VLLM_SEGMENT_PREFIX)}


def _held_by_others(names: set[str]) -> set[str]:
    """Those of `names` (in /dev/shm) that a process outside this test run (not this
    process nor a descendant of it) has mapped or open: another run's live vLLM."""
    paths = {f"/dev/shm/{name}": name for name in names}
    me, held = os.getpid(), set()
    for proc in psutil.process_iter():
        try:
            if proc.pid == me or any(p.pid == me for p in proc.parents()):
                continue
            found = {paths[m.path] for m in proc.memory_maps(grouped=True) if m.path in paths}
            found |= {paths[f.path] for f in proc.open_files() if f.path in paths}
        except (psutil.Error, OSError):
            continue  # gone, or not ours to read
        held |= found
    return held


def leaked_segments(before: set[str]) -> set[str]:
    """Segments of this test run in /dev/shm that were not there at `before`: ours by
    name, and vLLM's that no process outside this run holds (vLLM names them at random,
    and other test runs on the machine create theirs meanwhile)."""
    new = our_segments() - before
    vllm = {s for s in new if s.startswith(VLLM_SEGMENT_PREFIX)}
    return new - _held_by_others(vllm) if vllm else new


@pytest.fixture
def unique_name() -> str:
    """A daemon/arena name no other test (or test run) uses."""
    return f"{TEST_NAME_PREFIX}{uuid.uuid4().hex[:10]}"


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Fail the test if it leaves a segment of this test run in /dev/shm (polls a deadline).

    Leaked segments are unlinked so one leak does not fail every later test.
    """
    before = our_segments()
    yield
    deadline = time.monotonic() + SEGMENT_LEAK_DEADLINE_S
    leaked = leaked_segments(before)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = leaked_segments(before)
    for entry in leaked:
        try:
            os.unlink(os.path.join("/dev/shm", entry))
        except FileNotFoundError:
            pass
    assert not leaked, f"test left shared-memory segments behind: {sorted(leaked)}"


# ------------------------------------------------------------------ daemon processes
DAEMON_START_DEADLINE_S = 30.0


@dataclasses.dataclass
class DaemonProcess:
    """A real `lmcached serve` subprocess started by a test."""

    proc: subprocess.Popen
    name: str
    socket: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait; SIGKILL by pid if it does not stop. Returns the exit status."""
        return stop_daemon(self.proc, timeout_s)

    def info(self) -> dict:
        """Every INFO field of every section, flattened into one dict."""
        with Connection(self.socket) as conn:
            sections = conn.request(Info()).sections
        return {k: v for fields in sections.values() for k, v in fields.items()}

    def pins_held(self) -> int:
        """Pins held by every session together (CLIENTS), counting a block pinned by two
        leases twice (INFO's pinned_blocks counts blocks)."""
        with Connection(self.socket) as conn:
            return sum(row["pinned_blocks"] for row in list_clients(conn))


def start_daemon(name: str, socket_path: str, log_path: str, *args: str, env=None,
                 preexec_fn=None) -> DaemonProcess:
    """Start `lmcached serve` and wait (deadline) until it serves (`launcher.start_daemon`)."""
    try:
        proc = launcher.start_daemon(name, socket_path, *args, log_path=log_path, env=env,
                                     timeout_s=DAEMON_START_DEADLINE_S, preexec_fn=preexec_fn)
    except RuntimeError as exc:
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"{exc}:\n{f.read()}") from None
    return DaemonProcess(proc, name, socket_path, log_path)


@pytest.fixture
def short_tmp():
    """A short temporary directory (Unix socket paths are limited to 107 bytes)."""
    path = tempfile.mkdtemp(prefix="lmc-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon_factory(unique_name, short_tmp):
    """Start daemons with `factory(*serve_args, env=None, preexec_fn=None)`; all are
    stopped by pid after."""
    started: list[DaemonProcess] = []

    def factory(*args: str, env=None, name: str | None = None, preexec_fn=None) -> DaemonProcess:
        n = name or f"{unique_name}-{len(started)}"
        daemon = start_daemon(n, os.path.join(short_tmp, f"{len(started)}.sock"),
                              os.path.join(short_tmp, f"{len(started)}.log"), *args, env=env,
                              preexec_fn=preexec_fn)
        started.append(daemon)
        return daemon

    yield factory
    for daemon in started:
        daemon.stop()
        assert not os.path.exists(daemon.socket), "daemon left its socket behind"


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    """A daemon with a 64 MiB arena and 1 MiB blocks."""
    return daemon_factory("--capacity", "64MiB", "--block-size", "1MiB")


def is_release_frame(payload) -> bool:
    """Whether the daemon leaves `payload` unanswered: it decodes to a RELEASE or an
    INVALIDATE, or it is a msgpack array tagged "release" or "invalidate" that does not
    (its sender, `Connection.send`, reads no reply either way)."""
    try:
        return isinstance(request_decoder.decode(payload), (Release, Invalidate))
    except Exception:  # noqa: BLE001 - not a valid request
        pass
    try:
        message = msgspec.msgpack.decode(payload)
    except Exception:  # noqa: BLE001 - not msgpack: answered with an Error
        return False
    return (isinstance(message, list) and bool(message)
            and message[0] in ("release", "invalidate"))
