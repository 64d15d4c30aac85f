"""An L2 that answers, but not as Redis answers lmcached (lmcached/daemon/l2/redis_store.py).

A wrong port (a server that does not speak RESP), a server that wants a password, a
read-only replica: each is ONE error line naming the address and what it answered,
counted under its kind (INFO `l2_errors_protocol` / `_auth` / `_readonly`, the metrics'
`lmcached_l2_errors_total{kind}`), `l2_state:misconfigured`, and backed off as an outage:
no attempt per call while backing off, never a traceback per store.
"""

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time

import pytest
import torch

from engine_worker import prompt_kv, small_layout
from redis_servers import REDIS_SERVER, free_port
from test_l2_redis_store import FakeClock
from lmcached.client import CacheEngine
from lmcached.daemon.l2 import redis_store
from lmcached.daemon.l2.redis_store import L2Misconfigured, L2Unavailable, RedisL2

GARBAGE = b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n"


class GarbageServer:
    """A plain TCP server on loopback that answers GARBAGE to whatever it reads and
    closes; counts the connections it accepted (each is an attempt by the store)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.num_connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self.num_connections += 1
            with conn:
                try:
                    conn.settimeout(2)
                    conn.recv(4096)
                    conn.sendall(GARBAGE)
                except OSError:
                    pass

    def close(self) -> None:
        self._sock.close()
        self._thread.join(5)


@pytest.fixture
def garbage_server():
    server = GarbageServer()
    yield server
    server.close()


@contextlib.contextmanager
def redis_with(tmp_path, *args: str):
    """A redis-server started with extra `args` (e.g. --requirepass), killed by pid after.
    Yields its port once it accepts connections."""
    if not os.access(REDIS_SERVER, os.X_OK):
        pytest.skip(f"{REDIS_SERVER} is not installed (Debian: apt-get install redis-server)")
    port = free_port(False)
    proc = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                             "--logfile", str(tmp_path / f"redis-{port}.log"), *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"redis-server exited ({proc.returncode})"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not answer"
            time.sleep(0.02)
        yield port
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def misconfig_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.ERROR and r.name.startswith("lmcached.daemon.l2")]


# ------------------------------------------------------------------- the store
def test_a_server_that_does_not_speak_resp_is_one_line_then_backed_off(garbage_server,
                                                                     monkeypatch, caplog):
    clock = FakeClock()
    monkeypatch.setattr(redis_store, "_now", clock)
    store = RedisL2([("127.0.0.1", garbage_server.port)], ttl_s=None, timeout_s=2.0)
    address = f"127.0.0.1:{garbage_server.port}"
    with caplog.at_level(logging.ERROR, logger="lmcached"):
        with pytest.raises(L2Misconfigured) as excinfo:
            store.set_many([(b"k", b"v")])
        assert str(excinfo.value) == (
            f"L2 {address} does not speak RESP (Redis' protocol): to PING it answered "
            f"{GARBAGE!r}; give the address of a Redis or Valkey server (port 6379 by default)")
        assert (store.state, store.errors["protocol"]) == ("misconfigured", 1)
        attempts = garbage_server.num_connections
        for _ in range(20):  # backing off: no network, not counted
            with pytest.raises(L2Unavailable, match="is misconfigured; next try in 0.10 s"):
                store.get_many([b"k"])
        assert garbage_server.num_connections == attempts and store.errors["protocol"] == 1
        clock.now += redis_store.BACKOFF_MIN_S
        with pytest.raises(L2Misconfigured):  # one probe: connects and checks again
            store.exists_prefix([b"k"])
        assert store.errors["protocol"] == 2 and garbage_server.num_connections > attempts
        clock.now += redis_store.BACKOFF_MIN_S  # the wait doubled: still backing off
        with pytest.raises(L2Unavailable, match="next try in 0.10 s"):
            store.exists_prefix([b"k"])
    (line,) = misconfig_lines(caplog)  # the same answer twice: logged once
    assert line.startswith(str(excinfo.value) + ". Chunks stay in the arena")
    assert "l2_state:misconfigured, l2_errors_protocol" in line
    assert not any(r.exc_info for r in caplog.records)
    store.close()


def test_a_server_that_wants_a_password_is_an_auth_error(tmp_path, caplog):
    with redis_with(tmp_path, "--requirepass", "secret") as port:
        store = RedisL2([("127.0.0.1", port)], ttl_s=None)
        with caplog.at_level(logging.ERROR, logger="lmcached"):
            with pytest.raises(L2Misconfigured, match=rf"L2 127.0.0.1:{port} refuses lmcached: "
                               r"AuthenticationError: Authentication required.; --l2 sends no "
                               r"credentials"):
                store.get_many([b"k"])
        assert (store.state, store.errors["auth"], store.errors["connection"]) == (
            "misconfigured", 1, 0)
        assert len(misconfig_lines(caplog)) == 1
        store.close()


def test_a_replica_is_a_readonly_error_naming_its_primary(redis_server, tmp_path, caplog):
    primary = redis_server.ports[0]
    with redis_with(tmp_path, "--replicaof", "127.0.0.1", str(primary)) as port:
        store = RedisL2([("127.0.0.1", port)], ttl_s=None)
        with caplog.at_level(logging.ERROR, logger="lmcached"):
            with pytest.raises(L2Misconfigured, match=rf"L2 127.0.0.1:{port} is a read-only "
                               rf"replica \(INFO role:slave, of 127.0.0.1:{primary}\); give the "
                               r"primary's address"):
                store.set_many([(b"k", b"v")])
        assert (store.state, store.errors["readonly"]) == ("misconfigured", 1)
        assert len(misconfig_lines(caplog)) == 1
        store.close()


# ------------------------------------------------------------------ the daemon
@pytest.mark.slow
def test_a_daemon_whose_l2_is_a_wrong_port_logs_one_line_and_counts_it(garbage_server,
                                                                      daemon_factory):
    from test_metrics import free_port as free_metrics_port, fresh_scrape, total

    metrics_port = free_metrics_port()
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "64KiB",
                            "--l2", f"redis://127.0.0.1:{garbage_server.port}",
                            "--metrics-port", str(metrics_port))
    layout = small_layout()
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        for start in range(0, 6000, 1000):  # 6 stores, each written through to "L2"
            tokens = list(range(start, start + 100))
            engine.store(torch.tensor(tokens), prompt_kv(layout, tokens))
            time.sleep(0.05)
        kv, mask = engine.retrieve(torch.tensor(list(range(100))), return_tuple=False)
        assert int(mask.sum()) == 100 and torch.equal(kv, prompt_kv(layout, list(range(100))))
    info = daemon.info()
    assert info["l2_state"] == "misconfigured" and info["l2_errors_protocol"] >= 1
    assert info["l2_errors_connection"] == 0 and info["pinned_blocks"] == 0
    log = daemon.log()
    lines = [line for line in log.splitlines() if "does not speak RESP" in line]
    assert len(lines) == 1, log
    assert f"ERROR lmcached.daemon.l2.redis_store: L2 127.0.0.1:{garbage_server.port} does " \
           f"not speak RESP" in lines[0]
    assert "Traceback" not in log, log
    samples = fresh_scrape(metrics_port)
    assert total(samples, "lmcached_l2_errors_total", kind="protocol") == \
        daemon.info()["l2_errors_protocol"]
    assert samples[("lmcached_l2_up",)] == 0
