"""Start and stop a daemon subprocess: for the demo, the benchmarks and the tests.

A tool that needs a private daemon starts `python -m lmcached.cli serve` on a socket of
its own, waits until it answers PING, and stops it by pid whatever happens (SIGTERM,
then SIGKILL), removing its socket directory and any segment it left.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

from lmcached.wire.connection import Connection, DaemonError
from lmcached.wire.protocol import Info
from lmcached.shm.janitor import sweep_orphans


def start_daemon(name: str, socket: str, *serve_args: str, log_path: str | None = None,
                 env: dict | None = None, timeout_s: float = 120.0,
                 preexec_fn=None) -> subprocess.Popen:
    """Start a daemon and wait (deadline) until it serves: INFO `server` says
    `loading` 0 (its arena is prefaulted). INFO is answered while it loads, so the wait
    adds nothing to the daemon's error counts (a PING then would count in
    `errors_loading`).

    Args:
        name: daemon name (`--name`).
        socket: socket path (`--socket`).
        serve_args: more `lmcached serve` options, e.g. "--capacity", "64MiB".
        log_path: file for its stdout and stderr (inherited when None).
        env: its environment (this process's when None).
        timeout_s: how long to wait for it to serve.
        preexec_fn: run in the child before exec (e.g. to set resource limits).

    Raises:
        RuntimeError: it exited, or did not answer in time (it is stopped then).
    """
    cmd = [sys.executable, "-m", "lmcached.cli", "serve", "--name", name, "--socket", socket,
           *serve_args]
    log = open(log_path, "w") if log_path else None
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None, env=env,
                                preexec_fn=preexec_fn)
    finally:
        if log:
            log.close()
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with status {proc.returncode}")
        try:
            with Connection(socket, timeout_s=5) as conn:
                if not conn.request(Info("server")).sections["server"]["loading"]:
                    return proc
        except DaemonError as exc:
            stop_daemon(proc)
            raise RuntimeError(f"the daemon refused INFO: {exc}") from None
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            stop_daemon(proc)
            raise RuntimeError(f"the daemon did not serve within {timeout_s:.0f} s") from None
        time.sleep(0.05)


def stop_daemon(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM, wait; SIGKILL by pid if it does not stop. Returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def temporary_daemon(*serve_args: str, name: str | None = None) -> Iterator[str]:
    """A private daemon on a temp socket for the duration of the block; yields the socket.

    On exit it is stopped, its socket directory removed, and a segment it could not
    remove (if it was killed) unlinked.
    """
    name = name or f"tmp-{os.getpid()}"
    tmp = tempfile.mkdtemp(prefix="lmcd-", dir="/tmp")  # socket paths are limited to 107 bytes
    socket = os.path.join(tmp, "d.sock")
    proc = None
    try:
        proc = start_daemon(name, socket, *serve_args)
        yield socket
    finally:
        if proc is not None:
            stop_daemon(proc)
        sweep_orphans(name)
        shutil.rmtree(tmp, ignore_errors=True)
