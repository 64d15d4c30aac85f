"""Redis as a KV-chunk store: the store people reach for, measured on our shapes.

Why this file exists: the suite compares lmcached with a real `redis-server` (Debian's
package, installed if missing), started here on a loopback port with persistence off
and stopped by pid, whatever happens. Chunks are stored as bytes with redis-py + hiredis,
pipelined: one key per chunk (the same xxh3 prefix-chain hashes as lmcached), one
contiguous `chunk_shape(t)` value per key, as LMCache's remote backends do.

    store     per chunk: a contiguous copy of the chunk (a Redis value is one buffer),
              then pipelined SETs (the copy is sent without another copy: memoryview)
    lookup    one EXISTS of every chunk key
    retrieve  pipelined GETs, each value copied into its place in a touched destination

Pipelines are cut into batches of at most `batch_bytes` so that Redis' reply buffer
and the client's reply bytes stay bounded (16k tokens of Llama-3-8B are 2 GiB).
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Iterator

import numpy as np
import torch

from lmcached.client.hashing import as_token_array, hash_request_tokens
from lmcached.client.layout import KVLayout
from lmcached.launcher import stop_daemon

BATCH_BYTES = 512 << 20
START_TIMEOUT_S = 20.0


class RedisUnavailable(RuntimeError):
    """redis-server or redis-py cannot be had here; the message says why."""


def find_redis_server(install: bool = True) -> str:
    """Path of redis-server, installing Debian's package when missing and allowed.

    Raises:
        RedisUnavailable: not installed and the install failed (the message has apt's error).
    """
    path = shutil.which("redis-server")
    if path or not install:
        if path:
            return path
        raise RedisUnavailable("redis-server is not installed")
    if os.geteuid() != 0:
        raise RedisUnavailable("redis-server is not installed and this is not root "
                               "(apt-get install -y redis-server)")
    print("installing redis-server (apt-get install -y redis-server) ...", flush=True)
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "redis-server"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if done.returncode != 0 and cmd[1] == "install":
            raise RedisUnavailable(f"apt-get install redis-server failed: "
                                   f"{(done.stderr or done.stdout).strip()[-500:]}")
    path = shutil.which("redis-server")
    if not path:
        raise RedisUnavailable("apt-get install redis-server left no redis-server on PATH")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(proc: subprocess.Popen, pidfile: str) -> None:
    """SIGTERM then SIGKILL the server by its pid (the Popen's, checked with the pidfile)."""
    pids = {proc.pid}
    with contextlib.suppress(OSError, ValueError):
        with open(pidfile) as f:
            pids.add(int(f.read().strip()))
    stop_daemon(proc, timeout_s=15)  # SIGTERM, then SIGKILL by pid
    for pid in pids - {proc.pid}:  # only if redis forked itself (it should not: no daemonize)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def running_redis(install: bool = True) -> Iterator["object"]:
    """Start redis-server on 127.0.0.1:<free port>, persistence off; yield a redis.Redis.

    The server runs in a temp dir with a pidfile and is stopped by pid on exit.

    Raises:
        RedisUnavailable: redis-server or redis-py is missing and cannot be installed,
            or the server did not answer PING.
    """
    try:
        import redis
    except ImportError as exc:
        raise RedisUnavailable(f"redis-py is not installed ({exc}): pip install -e '.[bench]'")
    binary = find_redis_server(install)
    tmp = tempfile.mkdtemp(prefix="lmcb-redis-", dir="/tmp")
    pidfile = os.path.join(tmp, "redis.pid")
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", "--daemonize", "no", "--pidfile", pidfile, "--dir", tmp,
           "--logfile", os.path.join(tmp, "redis.log"), "--protected-mode", "yes"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = None
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=120)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RedisUnavailable(f"redis-server exited with status {proc.returncode}")
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RedisUnavailable("redis-server did not answer PING in time") from None
                time.sleep(0.05)
        yield client
    finally:
        if client is not None:
            client.close()
        _stop(proc, pidfile)
        shutil.rmtree(tmp, ignore_errors=True)


def versions(client) -> dict:
    """redis-server, redis-py and hiredis versions (and whether hiredis parses replies)."""
    import redis

    try:
        import hiredis
        hiredis_version = getattr(hiredis, "__version__", "?")
    except ImportError:
        hiredis_version = None
    from redis.utils import HIREDIS_AVAILABLE

    return {
        "redis_server": client.info("server").get("redis_version"),
        "redis_py": redis.__version__,
        "hiredis": hiredis_version,
        "hiredis_parser": bool(HIREDIS_AVAILABLE),
        "transport": "TCP 127.0.0.1",
    }


class RedisKV:
    """Chunked KV store/retrieve over Redis for one layout.

    Args:
        client: a redis.Redis connected to the server.
        layout: the KV layout (chunking, dtype, format).
        batch_bytes: most value bytes per pipeline execution.
    """

    def __init__(self, client, layout: KVLayout, batch_bytes: int = BATCH_BYTES) -> None:
        self.client = client
        self.layout = layout
        self.kv_bytes_per_chunk = layout.chunk_size * layout.token_bytes
        self.batch_chunks = max(1, batch_bytes // self.kv_bytes_per_chunk)
        self.alias = layout.numpy_alias()[1]

    def keys(self, tokens) -> list[bytes]:
        """One key per chunk: the model name and the chunk's prefix-chain hash."""
        hashes = hash_request_tokens(self.layout.chunk_size, as_token_array(tokens))
        prefix = f"lmcb:{self.layout.model_name}:".encode()
        return [prefix + h.hex().encode() for h in hashes]

    def _slices(self, num_tokens: int) -> list[tuple[int, int]]:
        size = self.layout.chunk_size
        return [(s, min(s + size, num_tokens)) for s in range(0, num_tokens, size)]

    def _chunk(self, blob_np: np.ndarray, start: int, end: int) -> np.ndarray:
        index = [slice(None)] * 5
        index[self.layout.token_dim] = slice(start, end)
        return blob_np[tuple(index)]

    def store(self, tokens, kv: torch.Tensor) -> None:
        """SET every chunk of the blob `kv` (`layout.chunk_shape(len(tokens))`), pipelined."""
        keys = self.keys(tokens)
        src = kv.view(self.layout.numpy_alias()[0]).numpy()
        slices = self._slices(kv.shape[self.layout.token_dim])
        for first in range(0, len(keys), self.batch_chunks):
            pipe = self.client.pipeline(transaction=False)
            for key, (start, end) in zip(keys[first : first + self.batch_chunks],
                                         slices[first : first + self.batch_chunks]):
                value = np.ascontiguousarray(self._chunk(src, start, end))
                pipe.set(key, memoryview(value).cast("B"))
            pipe.execute()

    def lookup(self, tokens) -> int:
        """Chunks of `tokens` present (one EXISTS of every key)."""
        return self.client.exists(*self.keys(tokens))

    def retrieve(self, tokens, out: torch.Tensor) -> int:
        """GET every chunk, pipelined, into the blob `out`; returns the chunks found."""
        keys = self.keys(tokens)
        dst = out.view(self.layout.numpy_alias()[0]).numpy()
        slices = self._slices(out.shape[self.layout.token_dim])
        found = 0
        for first in range(0, len(keys), self.batch_chunks):
            pipe = self.client.pipeline(transaction=False)
            batch = slices[first : first + self.batch_chunks]
            for key in keys[first : first + self.batch_chunks]:
                pipe.get(key)
            for value, (start, end) in zip(pipe.execute(), batch):
                if value is None:
                    return found
                chunk_dst = self._chunk(dst, start, end)
                np.copyto(chunk_dst, np.frombuffer(value, dtype=self.alias).reshape(chunk_dst.shape))
                found += 1
        return found


def bench_length(client, layout: KVLayout, num_tokens: int, repeat: int, src: torch.Tensor,
                 dst: torch.Tensor, time_it) -> dict:
    """Time Redis store (cold: after FLUSHALL), lookup and retrieve of one prompt.

    Args:
        client: redis.Redis of a private server (it is FLUSHALLed).
        layout: KV layout.
        num_tokens: prompt length.
        repeat: timed runs per op (after one warm-up).
        src / dst: touched blobs `layout.chunk_shape(num_tokens)`.
        time_it: benchmarks.common.time_it.

    Returns:
        {"nbytes", "samples": {"store", "lookup", "retrieve": [seconds]}}

    Raises:
        AssertionError: the retrieved bytes differ from the stored ones.
    """
    kv = RedisKV(client, layout)
    tokens = torch.arange(num_tokens) + 3_000_000 * num_tokens
    samples = {"store": time_it(lambda: kv.store(tokens, src), repeat, setup=client.flushall)}
    samples["lookup"] = time_it(lambda: kv.lookup(tokens), repeat)
    dst.zero_()
    assert kv.retrieve(tokens, dst) == -(-num_tokens // layout.chunk_size)
    assert torch.equal(dst, src), "Redis returned other bytes"
    samples["retrieve"] = time_it(lambda: kv.retrieve(tokens, dst), repeat)
    client.flushall()
    return {"nbytes": num_tokens * layout.token_bytes, "samples": samples}


def value_size_probe(client, time_it, total_bytes: int = 128 << 20,
                     value_sizes: tuple[int, ...] = (1 << 20, 8 << 20, 32 << 20),
                     repeat: int = 3) -> dict:
    """SET / GET GB/s of `total_bytes` cut into values of each size (pipelined, no copies).

    Shows how much of Redis' figure is owed to the value size: a Llama-3-8B chunk is one
    32 MiB value; Redis moves 1 MiB values faster.

    Returns:
        {value_bytes: {"set_gbps", "get_gbps"}}
    """
    out = {}
    for size in value_sizes:
        values = [np.full(size, i % 251, dtype=np.uint8) for i in range(total_bytes // size)]
        keys = [f"lmcb:probe:{size}:{i}" for i in range(len(values))]

        def put():
            pipe = client.pipeline(transaction=False)
            for key, value in zip(keys, values):
                pipe.set(key, memoryview(value))
            pipe.execute()

        def get():
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            pipe.execute()

        set_s = sorted(time_it(put, repeat))[repeat // 2]
        get_s = sorted(time_it(get, repeat))[repeat // 2]
        out[size] = {"set_gbps": total_bytes / set_s / 1e9, "get_gbps": total_bytes / get_s / 1e9}
        client.flushall()
    return out
