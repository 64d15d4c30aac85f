"""While the arena is prefaulted the daemon is LOADING (after Redis's -LOADING): it
answers INFO, CLIENTS, CONFIG and the CLI with its progress, refuses PING, HELLO and data
requests with a `loading` error that clients take as a miss, and stops cleanly on
SHUTDOWN. Before, the socket appeared only after the prefault: minutes of "no daemon is
running" for a large arena.

A daemon reserves its arena's pages holding an flock on /dev/shm (one daemon at a time,
shm/pages.py); the tests hold that lock for a few seconds, so the daemon stays LOADING
until they release it, whatever the speed of the machine.
"""

import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import threading
import time

from click.testing import CliRunner

from engine_worker import prompt_kv, small_layout
from lmcached.cli import main
from lmcached.client import CacheEngine
from lmcached import launcher
from lmcached.launcher import stop_daemon
from lmcached.shm.janitor import list_segments
from lmcached.wire.connection import Connection, DaemonError, hello
from lmcached.wire.protocol import Info, Ping

MiB = 1 << 20
DEADLINE_S = 30.0
TOKENS = list(range(64))


@contextlib.contextmanager
def reservation_held():
    """Hold the lock daemons reserve their arenas under (another daemon reserving)."""
    fd = os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def start_loading_daemon(name: str, directory: str) -> tuple[subprocess.Popen, str, str]:
    """`lmcached serve` with a 64 MiB arena, not waited for: (process, socket, log)."""
    socket_path = os.path.join(directory, "d.sock")
    log_path = os.path.join(directory, "d.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmcached.cli", "serve", "--name", name, "--socket",
             socket_path, "--capacity", "64MiB"], stdout=log, stderr=subprocess.STDOUT)
    return proc, socket_path, log_path


def server_info(socket_path: str) -> dict | None:
    """INFO `server`, or None while nothing listens yet."""
    try:
        with Connection(socket_path, timeout_s=10) as conn:
            return conn.request(Info("server")).sections["server"]
    except (FileNotFoundError, ConnectionRefusedError):
        return None


def wait_until(predicate, what: str, proc: subprocess.Popen, log_path: str):
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, open(log_path).read()[-2000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def loading(socket_path: str) -> dict | None:
    """INFO `server` while the daemon is loading, else None."""
    server = server_info(socket_path)
    return server if server and server["loading"] else None


def test_loading_daemon_answers_with_its_progress_and_clients_miss(unique_name, short_tmp,
                                                                   caplog):
    proc, socket_path, log_path = start_loading_daemon(unique_name, short_tmp)
    try:
        layout = small_layout()
        engine = CacheEngine.connect(layout, socket=socket_path)  # nothing listens yet
        with reservation_held():
            server = wait_until(lambda: loading(socket_path), "the loading state", proc,
                                log_path)
            assert server["loading_total_bytes"] == 64 * MiB and server["pid"] == proc.pid
            assert server["loading_loaded_perc"] == 0.0 and server["loading_eta_s"] == -1.0

            # PING and HELLO: refused with `loading` and the progress; INFO still answered
            with Connection(socket_path) as conn:
                try:
                    conn.request(Ping())
                    raise AssertionError("PING answered during the prefault")
                except DaemonError as exc:
                    assert exc.code == "loading"
                    assert str(exc).startswith("loading: prefaulting the 64.00M arena: 0% "
                                               "(0B), 0.00 GB/s, time left unknown yet; ")
                try:
                    hello(conn, "worker", [layout.to_wire()])
                    raise AssertionError("HELLO answered during the prefault")
                except DaemonError as exc:
                    assert exc.code == "loading"
                clients = conn.request(Info("clients")).sections["clients"]
                assert clients["connected_clients"] == 1

            # the CLI: ping says LOADING with the progress (status 1), info shows it
            result = CliRunner().invoke(main, ["ping", "--socket", socket_path])
            assert result.exit_code == 1, result.output
            assert result.stdout.startswith("LOADING prefaulting the 64.00M arena: 0% ")
            result = CliRunner().invoke(main, ["info", "server", "--socket", socket_path])
            assert result.exit_code == 0 and "loading:1" in result.stdout.splitlines()
            assert result.stderr.startswith("note: the daemon is loading: ")

            # a worker: misses and skipped stores, never an exception, one warning
            with caplog.at_level(logging.WARNING):
                for _ in range(3):
                    assert engine.lookup(TOKENS) == 0
                    assert engine.store(TOKENS, prompt_kv(layout, TOKENS)) == 0
                    time.sleep(0.06)
            assert server_info(socket_path)["loading"] == 1  # all of it while loading
        warnings = [r.getMessage() for r in caplog.records if r.name.startswith("lmcached")
                    and r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "unavailable" in warnings[0], warnings

        # once prefaulted: PING, INFO loading:0, and the worker caches again
        wait_until(lambda: (server_info(socket_path) or {}).get("loading") == 0,
                   "the end of the prefault", proc, log_path)
        with Connection(socket_path) as conn:
            conn.request(Ping())
            server = conn.request(Info("server")).sections["server"]
        assert server["loading_loaded_perc"] == 100.0 and server["loading_eta_s"] == 0.0
        assert server["loading_loaded_bytes"] == 64 * MiB and server["loading_rate_gbps"] > 0
        wait_until(lambda: engine.store(TOKENS, prompt_kv(layout, TOKENS)) > 0,
                   "a store after the reconnect back-off", proc, log_path)
        assert engine.lookup(TOKENS) == len(TOKENS)
        engine.close()
    finally:
        assert stop_daemon(proc) == 0
    assert list_segments(unique_name) == [] and not os.path.exists(socket_path)


def test_stop_during_the_prefault_stops_the_daemon_cleanly(unique_name, short_tmp):
    """`lmcached stop` while the daemon is loading: SHUTDOWN is answered, the start-up
    ends (exit 0), nothing is left in /dev/shm, and `stop` returns after the exit."""
    proc, socket_path, log_path = start_loading_daemon(unique_name, short_tmp)
    try:
        with reservation_held():
            wait_until(lambda: loading(socket_path), "the loading state", proc, log_path)
            result = CliRunner().invoke(main, ["stop", "--socket", socket_path])
            assert (result.exit_code, result.stdout) == (0, "stopping\nstopped\n"), \
                result.output
            assert proc.poll() == 0  # exited before `stop` returned
    finally:
        stop_daemon(proc)
    with open(log_path) as f:
        assert "received SHUTDOWN during start-up: stopped" in f.read()
    assert list_segments(unique_name) == [] and not os.path.exists(socket_path)


def test_the_launcher_waits_out_the_loading_without_counting_an_error(unique_name, short_tmp):
    """`launcher.start_daemon` (every test's daemon) returns once the daemon serves, and
    its wait leaves the daemon's error counts at 0: it polls INFO, which is answered
    while loading, not PING, which is refused then and counted in `errors_loading`
    (tests asserting INFO `errors` 0 failed so on a loaded machine)."""
    socket_path = os.path.join(short_tmp, "d.sock")
    seen_loading = threading.Event()

    def hold_while_loading():
        with reservation_held():  # the daemon stays LOADING while this is held
            deadline = time.monotonic() + DEADLINE_S
            while not loading(socket_path) and time.monotonic() < deadline:
                time.sleep(0.01)
            if loading(socket_path):
                seen_loading.set()
                time.sleep(0.5)  # the launcher polls meanwhile

    holder = threading.Thread(target=hold_while_loading)
    holder.start()
    try:
        proc = launcher.start_daemon(unique_name, socket_path, "--capacity", "16MiB",
                                     log_path=os.path.join(short_tmp, "d.log"),
                                     timeout_s=DEADLINE_S)
    finally:
        holder.join()
    try:
        assert seen_loading.is_set()
        with Connection(socket_path) as conn:
            sections = conn.request(Info()).sections
            conn.request(Ping())  # it serves
        assert sections["server"]["loading"] == 0
        errors = {k: v for k, v in sections["stats"].items() if k.startswith("errors")}
        assert errors == {"errors": 0}, errors
    finally:
        stop_daemon(proc)
