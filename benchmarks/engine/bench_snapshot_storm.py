"""What a storm of snapshot SUBSCRIBEs costs another client: its PING latency.

The daemon serves every client from one loop thread (lmcached/daemon/server.py), so a
request that holds the loop delays everyone's. A KV-event subscriber may ask for a
snapshot of what the node holds (SUBSCRIBE `snapshot`, docs/kv-events.md); a hostile
local process, or a router reconnecting in a loop, may ask for one again and again.
Measured here, against one private daemon holding `--chunks` chunks (a small layout:
256-token chunks of one 8-wide head):

    baseline   a client sends PING back to back, alone: round trip p50, p99, max
    storm      the same client's PINGs while another process pipelines `--subscribes`
               snapshot SUBSCRIBEs, each followed by its first EVENTS poll (a page of
               `--page` events with token ids), over `--connections` connections

and prints the ratio storm / baseline of each figure (same run, same daemon).

    python -m benchmarks.engine.bench_snapshot_storm [--chunks 16384]
        [--subscribes 4000] [--connections 1] [--page 256] [--out DIR]
"""

import argparse
import multiprocessing
import os
import selectors
import socket as socket_module
import statistics
import time

import torch

from benchmarks.common import machine_info, record_block_size, running_daemon, write_results
from lmcached.client import CacheEngine, KVLayout
from lmcached.wire.connection import Connection, hello
from lmcached.wire.frames import FRAME_LENGTH, encode_frame
from lmcached.wire.protocol import PROTOCOL_VERSION, Events, Hello, Ping, Subscribe

LAYOUT = KVLayout("bench-storm", num_layers=1, num_kv_heads=1, head_size=8,
                  dtype="bfloat16", chunk_size=256)
PROMPT_CHUNKS = 16


def _prompt(i: int) -> torch.Tensor:
    tokens = torch.arange(PROMPT_CHUNKS * 256, dtype=torch.int64) % 30_000 + 1
    tokens[0] = 1_000_000 + i  # a new chain per prompt
    return tokens


def _read_frames(sock, count: int) -> int:
    """Read `count` reply frames from blocking `sock`; returns the bytes read."""
    buf = bytearray()
    total = 0
    while _drop_frames(buf) < count:
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError("the daemon closed the storm's connection")
        total += len(data)
        buf += data
    return total


def _drop_frames(buf: bytearray) -> int:
    """Drop the complete frames at the start of `buf`; returns how many."""
    done = pos = 0
    while len(buf) - pos >= FRAME_LENGTH.size:
        (length,) = FRAME_LENGTH.unpack_from(buf, pos)
        if len(buf) - pos < FRAME_LENGTH.size + length:
            break
        pos += FRAME_LENGTH.size + length
        done += 1
    del buf[:pos]
    return done


def _storm(socket_path: str, subscribes: int, connections: int, page: int, ready, go,
           done) -> None:
    """Open `connections` sessions, set `ready`, wait for `go`, then pipeline
    `subscribes` snapshot SUBSCRIBE + EVENTS pairs spread over them (one thread, a
    selector: the storm's own CPU stays small), read every reply, and put (seconds,
    reply bytes, connections the daemon dropped) on `done`."""
    socks = []
    for _ in range(connections):
        sock = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
        sock.connect(socket_path)
        sock.sendall(encode_frame(Hello(PROTOCOL_VERSION, os.getpid(), "storm",
                                        [LAYOUT.to_wire()])))
        _read_frames(sock, 1)
        sock.setblocking(False)
        socks.append(sock)
    ready.set()
    go.wait()
    started = time.monotonic()
    pair = encode_frame(Subscribe([], 0, True)) + encode_frame(Events(1, page, True))
    shares = [subscribes // connections + (i < subscribes % connections)
              for i in range(connections)]
    selector = selectors.DefaultSelector()
    state = {}
    for sock, share in zip(socks, shares):
        if share:
            state[sock] = [memoryview(pair * share), bytearray(), 2 * share]
            selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    received = dropped = 0
    while state:
        for key, mask in selector.select():
            sock = key.fileobj
            out, buf, left = state[sock]
            if mask & selectors.EVENT_WRITE and out:
                try:
                    sent = sock.send(out[:1 << 16])
                except BlockingIOError:
                    sent = 0
                except ConnectionError:
                    sent = len(out)  # dropped: its read says so
                out = state[sock][0] = out[sent:]
                if not out:
                    selector.modify(sock, selectors.EVENT_READ)
            if mask & selectors.EVENT_READ:
                try:
                    data = sock.recv(1 << 20)
                except BlockingIOError:
                    continue
                except ConnectionError:
                    data = b""
                if not data:  # dropped by the daemon (e.g. over --buffer-budget)
                    dropped += 1
                    selector.unregister(sock)
                    del state[sock]
                    continue
                received += len(data)
                buf += data
                left = state[sock][2] = left - _drop_frames(buf)
                if not left:
                    selector.unregister(sock)
                    del state[sock]
    done.put((time.monotonic() - started, received, dropped))
    for sock in socks:
        sock.close()


def _ping_until(conn: Connection, stop) -> list[float]:
    """PING back to back until `stop()`; the round trips, seconds."""
    out = []
    while not stop():
        t0 = time.perf_counter()
        conn.request(Ping())
        out.append(time.perf_counter() - t0)
    return out


def _figures_ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "pings": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
        "max_ms": round(ordered[-1] * 1e3, 3),
    }


def run(chunks: int, subscribes: int, connections: int, page: int,
        baseline_s: float = 2.0) -> dict:
    """The module docstring's figures, one daemon."""
    prompts = -(-chunks // PROMPT_CHUNKS)
    block = int(record_block_size(LAYOUT))
    capacity = str((prompts * PROMPT_CHUNKS + 1024) * block)
    with running_daemon(capacity, str(block), name=f"bench-storm-{os.getpid()}") as socket:
        engine = CacheEngine.connect(LAYOUT, socket=socket, strict=True)
        kv = torch.zeros(LAYOUT.chunk_shape(PROMPT_CHUNKS * 256), dtype=torch.bfloat16)
        for i in range(prompts):
            engine.store(_prompt(i), kv)
        engine.close()
        ctx = multiprocessing.get_context("spawn")
        ready, go, done = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_storm,
                           args=(socket, subscribes, connections, page, ready, go, done))
        proc.start()
        try:
            assert ready.wait(120), "the storm process did not connect"
            with Connection(socket, timeout_s=60) as conn:
                hello(conn, "pinger")
                for _ in range(200):  # warm up
                    conn.request(Ping())
                until = time.monotonic() + baseline_s
                baseline = _ping_until(conn, lambda: time.monotonic() >= until)
                go.set()
                result = []
                storm = _ping_until(conn, lambda: result or (not done.empty()
                                                             and result.append(done.get())))
            storm_s, reply_bytes, dropped = result[0]
            proc.join(30)
        finally:
            if proc.is_alive():
                proc.kill()
    base, under = _figures_ms(baseline), _figures_ms(storm)
    return {
        "cached_chunks": prompts * PROMPT_CHUNKS,
        "subscribes": subscribes,
        "connections": connections,
        "page": page,
        "storm_s": round(storm_s, 3),
        "storm_reply_mib": round(reply_bytes / 2**20, 1),
        "storm_connections_dropped": dropped,
        "ping_alone": base,
        "ping_under_storm": under,
        "ratio_storm_over_alone": {key: round(under[key] / base[key], 1)
                                   for key in ("p50_ms", "p99_ms", "max_ms")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=16384)
    parser.add_argument("--subscribes", type=int, default=4000)
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--page", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {
        "machine": machine_info(),
        "command": "python -m benchmarks.engine.bench_snapshot_storm --chunks %d "
                   "--subscribes %d --connections %d --page %d"
                   % (args.chunks, args.subscribes, args.connections, args.page),
        "storm": run(args.chunks, args.subscribes, args.connections, args.page),
    }
    write_results(results, args.out)


if __name__ == "__main__":
    main()
