"""What every section of bench_protocol.py shares: private servers, CPU placement, stats.

Why this file exists: each section starts its own `lmcached serve` and echo server,
times its ops under the same two CPU placements and summarizes latencies the same way;
this module is that harness, so that a section module holds only its ops and report.
It imports neither torch nor the client engine: the wire section's spawned clients
re-import bench_protocol.py and every module it imports.
"""

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from lmcached.launcher import start_daemon, stop_daemon
from benchmarks.protocol.protocol_echo import ECHO_SCRIPT, EchoClient

HASH_BYTES = 16  # one chunk hash on the wire
START_DEADLINE_S = 30.0
STOP_TIMEOUT_S = 15.0


def summarize(lat_ns, round_trips_per_iter: int = 1) -> dict:
    """Median / p99 in us and round trips per second of back-to-back latencies (ns)."""
    arr = np.asarray(lat_ns, dtype=np.float64) / 1e3
    return {
        "n": len(arr),
        "median": float(np.median(arr)),
        "p99": float(np.percentile(arr, 99)),
        "rps": round_trips_per_iter * len(arr) / (arr.sum() / 1e6),
    }


def wait_for(predicate, deadline_s: float, what: str, proc: subprocess.Popen, log_path: str):
    """Poll `predicate` until true; raise with the process log if it dies or times out."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{read_log(log_path)}")
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer within {deadline_s} s:\n{read_log(log_path)}")


def read_log(path: str) -> str:
    """The last 4,000 characters of a server's log, for an error message."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-4000:]
    except OSError:
        return "(no log)"


def start_echo(sock: str, log_path: str) -> subprocess.Popen:
    """Start protocol_echo.py on `sock`, logging to `log_path`; returns once it answers."""
    cmd = [sys.executable, ECHO_SCRIPT, sock]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def answers() -> bool:
        client = EchoClient(sock)
        try:
            return bytes(client.round_trip(b"\x01\x00\x00\x00x")) == b"x"
        finally:
            client.close()

    try:
        wait_for(answers, START_DEADLINE_S, "echo server", proc, log_path)
    except BaseException:
        stop_daemon(proc, STOP_TIMEOUT_S)
        raise
    return proc


@dataclasses.dataclass
class Servers:
    """A section's private daemon and echo server (processes and socket paths)."""

    daemon: subprocess.Popen
    daemon_sock: str
    echo: subprocess.Popen
    echo_sock: str


@contextlib.contextmanager
def private_servers(tag: str, capacity: str, block_size: str, leftovers: list[str]):
    """A private `lmcached serve` and an echo server on temp sockets for one section.

    Both are stopped by pid on exit whatever happens (SIGTERM, then SIGKILL). A socket or
    /dev/shm/lmcached.* segment still there afterwards is removed and its path appended
    to `leftovers` (the script then exits with status 1).

    Args:
        tag: distinguishes this section's daemon name (arena /lmcached.bench-<pid>-<tag>.*).
        capacity / block_size: the daemon's --capacity and --block-size.
        leftovers: list the paths of anything left behind are appended to.

    Yields:
        Servers.
    """
    name = f"bench-{os.getpid()}-{tag}"
    tmp = tempfile.mkdtemp(prefix="lmcb-", dir="/tmp")
    daemon_sock = os.path.join(tmp, "d.sock")
    echo_sock = os.path.join(tmp, "e.sock")
    daemon = echo = None
    try:
        # --max-session-share 100: one client at a time fills the arena here (a TP=4
        # scheduler pins every rank's chunks), which the default 50% cap would cut short.
        daemon = start_daemon(name, daemon_sock, "--capacity", capacity, "--block-size", block_size,
                              "--max-session-share", "100",
                              log_path=os.path.join(tmp, "daemon.log"), timeout_s=START_DEADLINE_S)
        echo = start_echo(echo_sock, os.path.join(tmp, "echo.log"))
        yield Servers(daemon, daemon_sock, echo, echo_sock)
    finally:
        if echo is not None:
            stop_daemon(echo, STOP_TIMEOUT_S)
        if daemon is not None:
            stop_daemon(daemon, STOP_TIMEOUT_S)
        from lmcached.shm.janitor import list_segments

        for path in (daemon_sock, echo_sock):
            if os.path.exists(path):
                leftovers.append(path)
                os.unlink(path)
        for entry in list_segments(name):
            leftovers.append("/dev/shm/" + entry)
            try:
                os.unlink("/dev/shm/" + entry)
            except FileNotFoundError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


def placements() -> list[tuple[str, set[int]]]:
    """(name, CPUs) of the two placements every section times: one CPU, then unpinned
    (bench_protocol.py's docstring says why both; `place` applies one)."""
    all_cpus = os.sched_getaffinity(0)
    return [("one CPU", {min(all_cpus)}), ("unpinned", all_cpus)]


def place(cpus: set[int], *pids: int) -> None:
    """Pin this process's calling thread and `pids` to `cpus`."""
    for pid in (0, *pids):
        os.sched_setaffinity(pid, cpus)
