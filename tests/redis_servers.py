"""Real Redis servers for the L2 tests: a standalone server and a 3-master cluster.

Debian's redis-server on loopback, on free ports, with its data in the test's tmp
directory and no persistence (`--save "" --appendonly no`: a restarted server is empty,
except a cluster node's nodes.conf, which keeps its slots). Each server is a child
process started by the test and killed by pid in a finalizer, also when the test fails.
Tests that need no Redis never import redis-py through this module (the client is
imported lazily), and the fixtures skip with the reason when redis-server is missing.

Fixtures (registered in conftest.py): `redis_server`, `redis_cluster`. Each yields a
`RedisServers`: `.url`, `.ports`, `.pids`, `.stop()` / `.start()` (kill and bring back
the same ports mid-test), `.client()` (a redis-py client for tampering), `.node_client(i)`.
"""

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
NUM_CLUSTER_MASTERS = 3
CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on port + 10000 (its bus)
READY_DEADLINE_S = 30.0
START_ATTEMPTS = 3  # fresh ports if another process took one between the check and bind


def free_port(with_bus: bool) -> int:
    """A loopback TCP port that is free now (and port + 10000 too, for a cluster node)."""
    for _ in range(1000):
        port = random.randrange(20000, 40000)
        wanted = (port, port + CLUSTER_BUS_OFFSET) if with_bus else (port,)
        try:
            for p in wanted:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free loopback port in 20000..39999")


def command(port: int, *args: str, timeout_s: float = 1.0) -> bytes:
    """One Redis command over a raw socket (no redis-py); the reply, or OSError.

    Returns the payload of a `+`, `:` or `$` reply; raises RuntimeError on a `-` reply.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(b"".join([b"*%d\r\n" % len(args)] + [b"$%d\r\n%s\r\n" % (len(a), a.encode())
                                                        for a in args]))
        reply = b""
        while b"\r\n" not in reply:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"redis on port {port} closed the connection")
            reply += chunk
        head, _, body = reply.partition(b"\r\n")
        if head[:1] == b"-":
            raise RuntimeError(f"redis on port {port}: {head[1:].decode()}")
        if head[:1] != b"$":
            return head[1:]
        length = int(head[1:])
        while len(body) < length + 2:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"redis on port {port} closed the connection")
            body += chunk
        return body[:length]


class RedisServers:
    """One standalone redis-server, or the masters of one cluster, started by a test.

    Args:
        data_dir: where each server keeps its log (and nodes.conf for a cluster).
        cluster: three masters in cluster mode (`redis-cli --cluster create`,
            `--cluster-replicas 0`), else one standalone server.
    """

    def __init__(self, data_dir: str, *, cluster: bool) -> None:
        self.data_dir = str(data_dir)
        self.cluster = cluster
        self.ports: list[int] = []
        self._procs: dict[int, subprocess.Popen] = {}
        self._clients: list = []
        self._created = False

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:P[,127.0.0.1:P...]` (the `--l2` option's syntax)."""
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @property
    def pids(self) -> list[int]:
        """Pids of the servers running now."""
        return [proc.pid for proc in self._procs.values()]

    def _log_path(self, port: int) -> str:
        return os.path.join(self.data_dir, f"redis-{port}.log")

    def _spawn(self, port: int) -> None:
        node_dir = os.path.join(self.data_dir, f"redis-{port}")
        os.makedirs(node_dir, exist_ok=True)
        args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", node_dir, "--logfile", self._log_path(port)]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "5000"]
        self._procs[port] = subprocess.Popen(args, stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + READY_DEADLINE_S
        for port, proc in self._procs.items():
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {port} exited ({proc.returncode}): "
                                       f"{self._log_tail(port)}")
                try:
                    if ready(port):
                        break
                except (OSError, RuntimeError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis on port {port}: no {what} within "
                                       f"{READY_DEADLINE_S} s: {self._log_tail(port)}")
                time.sleep(0.02)

    def _log_tail(self, port: int) -> str:
        try:
            with open(self._log_path(port), errors="replace") as f:
                return f.read()[-2000:]
        except FileNotFoundError:
            return "(no log)"

    def start(self) -> None:
        """Start the servers (the same ports as before, after `stop`); return when every
        server answers PING and, for a cluster, reports `cluster_state:ok`."""
        assert not self._procs, "start() while the servers run: call stop() first"
        for attempt in range(START_ATTEMPTS):
            if not self.ports:
                num = NUM_CLUSTER_MASTERS if self.cluster else 1
                while len(self.ports) < num:
                    port = free_port(self.cluster)
                    taken = {q + d for q in self.ports
                             for d in (0, CLUSTER_BUS_OFFSET, -CLUSTER_BUS_OFFSET)}
                    if port not in taken:
                        self.ports.append(port)
            for port in self.ports:
                self._spawn(port)
            try:
                self._wait(lambda p: command(p, "PING") == b"PONG", "PONG")
                break
            except RuntimeError:
                self.stop()
                if self._created or attempt == START_ATTEMPTS - 1:
                    raise
                self.ports = []  # a port was taken meanwhile: new ports
        if self.cluster:
            if not self._created:
                subprocess.run([REDIS_CLI, "--cluster", "create",
                                *(f"127.0.0.1:{p}" for p in self.ports),
                                "--cluster-replicas", "0", "--cluster-yes"],
                               check=True, capture_output=True, timeout=READY_DEADLINE_S)
            self._wait(lambda p: b"cluster_state:ok" in command(p, "CLUSTER", "INFO"),
                       "cluster_state:ok")
        self._created = True

    def stop(self) -> None:
        """Kill every server by pid (SIGKILL: a crash) and reap it."""
        for port, proc in list(self._procs.items()):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            del self._procs[port]

    def client(self):
        """A redis-py client (RedisCluster for a cluster), closed by `close`."""
        import redis
        from redis.cluster import RedisCluster

        if self.cluster:
            client = RedisCluster(host="127.0.0.1", port=self.ports[0])
        else:
            client = redis.Redis(host="127.0.0.1", port=self.ports[0])
        self._clients.append(client)
        return client

    def node_client(self, index: int):
        """A plain redis-py client of one server (one cluster node), closed by `close`."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.ports[index])
        self._clients.append(client)
        return client

    def close(self) -> None:
        """Close the clients handed out and kill the servers."""
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        self._clients.clear()
        self.stop()


@contextlib.contextmanager
def running_redis(data_dir: str, *, cluster: bool) -> Iterator[RedisServers]:
    """Servers that run for the `with` block and are killed when it ends, however."""
    for binary in (REDIS_SERVER, REDIS_CLI) if cluster else (REDIS_SERVER,):
        if not os.access(binary, os.X_OK):
            pytest.skip(f"{binary} is not installed (Debian: apt-get install redis-server); "
                        f"the L2 tests run against real Redis servers")
    servers = RedisServers(data_dir, cluster=cluster)
    try:
        servers.start()
        yield servers
    finally:
        servers.close()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServers]:
    """A standalone redis-server on a free loopback port, killed by pid after the test."""
    with running_redis(str(tmp_path), cluster=False) as servers:
        yield servers


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator[RedisServers]:
    """A 3-master Redis cluster (no replicas) on free loopback ports, killed after."""
    with running_redis(str(tmp_path), cluster=True) as servers:
        yield servers
