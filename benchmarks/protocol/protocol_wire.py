"""The wire section of bench_protocol.py: the protocol's own round trips, one client and N.

Why this file exists: it measures what the daemon's protocol costs without the client
engine: a blocking `lmcached.wire.connection.Connection` on a 256 MiB arena of 1 MiB blocks
times PING, LOOKUP, ACQUIRE+RELEASE and ALLOC+COMMIT of 64 chunks (median / p99 in
microseconds, round trips per second). Then N concurrent client processes
(multiprocessing 'spawn'; each its own HELLO) run a LOOKUP-64 loop and an
ACQUIRE+RELEASE-64 loop behind barriers; the parent reports aggregate round trips per
second and p50/p99 over every client's latencies, for 1 client and for N. The daemon is
one thread: on a 2-core machine 8 clients queue behind it and compete with it for the
CPUs, so their latencies grow with the queue. Target: a LOOKUP of 64 chunks within 2x of
the raw echo round trip.

It speaks the protocol itself and detects what the protocol version offers, so the same
code measures protocol v1 and v2.
"""

import multiprocessing
import os
import platform
import time

import numpy as np

from lmcached.wire.connection import Connection, hello
from lmcached.wire.frames import encode_frame
from lmcached.wire.protocol import (
    ALLOCATED,
    EXISTS,
    Acquire,
    Alloc,
    Commit,
    Hello,
    Layout,
    Lookup,
    Ping,
    Release,
)
from benchmarks.protocol.protocol_echo import EchoClient
from benchmarks.protocol.protocol_harness import HASH_BYTES, place, placements, private_servers, summarize

RECORD_BYTES = 1 << 20  # the wire section's chunks: one 1 MiB block each
LAYOUT = Layout("bench", 1, 0, "vllm", "bfloat16", 32, 8, 128, 256, RECORD_BYTES)
CAPACITY = "256MiB"
BLOCK_SIZE = "1MiB"
NUM_CHUNKS = 64
TARGET_RATIO = 2.0

# ------------------------------------------------- protocol v1 / v2 differences
# The wire section speaks the protocol itself; these let it measure both versions
# (v2: HELLO takes a list of layouts, LOOKUP and ACQUIRE a list of namespaces, and
# RELEASE takes a lease and gets no reply).
_HELLO_LAYOUTS = "layouts" in Hello.__struct_fields__
_MULTI_NAMESPACE = "namespaces" in Lookup.__struct_fields__
# Synchronous round trips of ACQUIRE+RELEASE: 2, or 1 where RELEASE gets no reply.
ACQUIRE_RELEASE_ROUND_TRIPS = 1 if hasattr(Connection, "send") else 2


def open_session(conn: Connection, name: str) -> int:
    """HELLO with LAYOUT on `conn`; returns the session's namespace id."""
    if _HELLO_LAYOUTS:
        return hello(conn, name, [LAYOUT]).namespaces[0]
    return hello(conn, name, LAYOUT).ns


def lookup_request(ns: int, hashes: bytes) -> Lookup:
    """LOOKUP of `hashes` in namespace `ns`."""
    return Lookup([ns] if _MULTI_NAMESPACE else ns, hashes)


def acquire_request(ns: int, hashes: bytes) -> Acquire:
    """ACQUIRE of `hashes` in namespace `ns`."""
    return Acquire([ns] if _MULTI_NAMESPACE else ns, hashes)


def release(conn: Connection, reply) -> None:
    """RELEASE what an ACQUIRE reply pinned: v1 sends its block ids and waits for the
    reply; v2 sends its lease and does not wait (there is no reply)."""
    lease = getattr(reply, "lease", None)
    if lease is None:
        conn.request(Release(reply.block_ids))
    elif lease:
        conn.send(Release([lease]))


# --------------------------------------------------------------------- helpers


def hashes_for(tag: int, first: int, count: int = NUM_CHUNKS) -> bytes:
    """`count` distinct 16-byte chunk hashes (tag keeps independent sets apart)."""
    return b"".join(
        tag.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(first, first + count)
    )


def store(conn: Connection, ns: int, hashes: bytes) -> int:
    """ALLOC+COMMIT every chunk of `hashes` that is not cached. Returns how many were new."""
    n = len(hashes) // HASH_BYTES
    reply = conn.request(Alloc(ns, hashes, [RECORD_BYTES] * n))
    if reply.block_ids:
        conn.request(Commit(reply.block_ids))
    if any(s not in (ALLOCATED, EXISTS) for s in reply.status):
        raise RuntimeError(f"ALLOC refused chunks (NOSPACE): {reply.status}")
    return reply.status.count(ALLOCATED)


# ------------------------------------------------------------ single client ops


class SingleClient:
    """One blocking daemon connection and one echo connection, timing each op."""

    def __init__(self, daemon_sock: str, echo_sock: str) -> None:
        self.conn = Connection(daemon_sock)
        self.ns = open_session(self.conn, "bench-single")
        self.echo = EchoClient(echo_sock)
        self.hot = hashes_for(1, 0)
        self.echo_frame = encode_frame(lookup_request(self.ns, self.hot))
        self.next_new = 0  # counter for ALLOC+COMMIT's new chunks

    def close(self) -> None:
        self.conn.close()
        self.echo.close()

    def ensure_hot(self) -> None:
        store(self.conn, self.ns, self.hot)
        if self.conn.request(lookup_request(self.ns, self.hot)).num_chunks != NUM_CHUNKS:
            raise RuntimeError("the 64 hot chunks are not all READY")

    def run_echo(self, n: int) -> list[int]:
        rt, frame, clock = self.echo.round_trip, self.echo_frame, time.perf_counter_ns
        out = []
        for _ in range(n):
            t0 = clock()
            rt(frame)
            out.append(clock() - t0)
        return out

    def run_ping(self, n: int) -> list[int]:
        req, msg, clock = self.conn.request, Ping(), time.perf_counter_ns
        out = []
        for _ in range(n):
            t0 = clock()
            req(msg)
            out.append(clock() - t0)
        return out

    def run_lookup(self, n: int) -> list[int]:
        req, msg, clock = self.conn.request, lookup_request(self.ns, self.hot), time.perf_counter_ns
        out = []
        for _ in range(n):
            t0 = clock()
            reply = req(msg)
            out.append(clock() - t0)
        if reply.num_chunks != NUM_CHUNKS:
            raise RuntimeError(f"LOOKUP found {reply.num_chunks} of {NUM_CHUNKS} chunks")
        return out

    def run_acquire_release(self, n: int) -> list[int]:
        conn, msg, clock = self.conn, acquire_request(self.ns, self.hot), time.perf_counter_ns
        req = conn.request
        out = []
        for _ in range(n):
            t0 = clock()
            reply = req(msg)
            release(conn, reply)
            out.append(clock() - t0)
            if len(reply.block_ids) != NUM_CHUNKS:
                raise RuntimeError(f"ACQUIRE pinned {len(reply.block_ids)} blocks")
        return out

    def run_alloc_commit(self, n: int) -> list[int]:
        req, ns, clock = self.conn.request, self.ns, time.perf_counter_ns
        nbytes = [RECORD_BYTES] * NUM_CHUNKS
        requests = []
        for _ in range(n):  # build the new hashes outside the timed loop
            requests.append(Alloc(ns, hashes_for(2, self.next_new), nbytes))
            self.next_new += NUM_CHUNKS
        out = []
        for msg in requests:
            t0 = clock()
            reply = req(msg)
            req(Commit(reply.block_ids))
            out.append(clock() - t0)
            if len(reply.block_ids) != NUM_CHUNKS:
                raise RuntimeError(f"ALLOC gave {len(reply.block_ids)} blocks: {reply.status}")
        return out


# --------------------------------------------------------- concurrent clients


def client_worker(daemon_sock, hot, count, warmup, barrier, results, index) -> None:
    """One concurrent client process: HELLO, then LOOKUP and ACQUIRE+RELEASE loops."""
    try:
        conn = Connection(daemon_sock, timeout_s=60.0)
        ns = open_session(conn, f"bench-client-{index}")
        req, clock = conn.request, time.perf_counter_ns
        lookup, acquire = lookup_request(ns, hot), acquire_request(ns, hot)
        for _ in range(warmup):
            req(lookup)
            release(conn, req(acquire))
        phases = {}
        barrier.wait()
        lat = []
        start = time.monotonic_ns()  # CLOCK_MONOTONIC: comparable across processes
        for _ in range(count):
            t0 = clock()
            reply = req(lookup)
            lat.append(clock() - t0)
        phases["lookup"] = (start, time.monotonic_ns(), np.array(lat, dtype=np.int64))
        if reply.num_chunks != NUM_CHUNKS:
            raise RuntimeError(f"LOOKUP found {reply.num_chunks} chunks")
        barrier.wait()
        lat = []
        start = time.monotonic_ns()
        for _ in range(count):
            t0 = clock()
            reply = req(acquire)
            release(conn, reply)
            lat.append(clock() - t0)
        phases["acqrel"] = (start, time.monotonic_ns(), np.array(lat, dtype=np.int64))
        conn.close()
        results.put((index, phases, None))
    except BaseException as exc:  # report, never hang the parent
        barrier.abort()
        results.put((index, None, repr(exc)))


def run_concurrent(daemon_sock: str, hot: bytes, num_clients: int, count: int,
                   warmup: int) -> dict:
    """Run `num_clients` client processes; aggregate round trips/s and latencies."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(num_clients)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=client_worker,
                    args=(daemon_sock, hot, count, warmup, barrier, results, i), daemon=True)
        for i in range(num_clients)
    ]
    for p in procs:
        p.start()
    collected = []
    try:
        for _ in procs:
            index, phases, error = results.get(timeout=120)
            if error:
                raise RuntimeError(f"client {index} failed: {error}")
            collected.append(phases)
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    out = {}
    for phase, rts in (("lookup", 1), ("acqrel", ACQUIRE_RELEASE_ROUND_TRIPS)):
        starts = [c[phase][0] for c in collected]
        ends = [c[phase][1] for c in collected]
        lat = np.concatenate([c[phase][2] for c in collected])
        wall_s = (max(ends) - min(starts)) / 1e9
        stats = summarize(lat, rts)
        stats["rps"] = rts * len(lat) / wall_s  # aggregate: every client, wall clock
        stats["wall_s"] = wall_s
        out[phase] = stats
    return out


# --------------------------------------------------------------- wire section


def run_wire(args, leftovers: list[str]) -> None:
    """The wire section: single-client ops and concurrent clients; prints its report."""
    iterations = args.iterations or (2000 if args.quick else 10000)
    client_iterations = args.client_iterations or (1000 if args.quick else 3000)
    rounds = max(1, min(args.rounds or (4 if args.quick else 10), iterations))
    per_round = -(-iterations // rounds)
    warmup = 100 if args.quick else 300

    single = None
    with private_servers("wire", CAPACITY, BLOCK_SIZE, leftovers) as servers:
        try:
            single = SingleClient(servers.daemon_sock, servers.echo_sock)
            frame_bytes = len(single.echo_frame)

            ops = [
                ("raw echo", single.run_echo, 1),
                ("PING", single.run_ping, 1),
                ("LOOKUP 64", single.run_lookup, 1),
                ("ACQUIRE+RELEASE 64 (pair)", single.run_acquire_release,
                 ACQUIRE_RELEASE_ROUND_TRIPS),
                ("ALLOC+COMMIT 64 new (pair, evicting)", single.run_alloc_commit, 2),
            ]
            # Warm-up: fill the arena (so ALLOC evicts from then on) and warm every path.
            single.ensure_hot()
            single.run_alloc_commit(256 // NUM_CHUNKS + 1)
            single.ensure_hot()
            for _, fn, _ in ops:
                fn(warmup)
            # Each placement times every op: all three processes on one CPU (the software
            # path alone), then wherever the scheduler puts them. Only the one-CPU figures
            # compare the daemon with the echo (see bench_protocol.py's docstring).
            stats = {}
            for placement, cpus in placements():
                place(cpus, servers.daemon.pid, servers.echo.pid)
                samples = {label: [] for label, _, _ in ops}
                for _ in range(rounds):
                    single.ensure_hot()  # ALLOC of the previous round evicted the hot set
                    for label, fn, _ in ops:
                        samples[label].extend(fn(per_round))
                single.ensure_hot()
                stats[placement] = {label: summarize(samples[label], rts)
                                    for label, _, rts in ops}

            concurrent = {}
            for n in sorted({1, args.clients}):
                single.ensure_hot()
                concurrent[n] = run_concurrent(servers.daemon_sock, single.hot, n,
                                               client_iterations,
                                               warmup=min(warmup, client_iterations))
        finally:
            if single is not None:
                single.close()

    # ------------------------------------------------------------------ report
    mode = "quick" if args.quick else "full"
    print(f"lmcached protocol benchmark, wire section ({mode}): Python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}")
    print(f"daemon: {CAPACITY} arena, {BLOCK_SIZE} blocks; LOOKUP-64 request frame "
          f"{frame_bytes} bytes (the echo frame is the same size, both ways)")
    print(f"single blocking client: {per_round * rounds} iterations per op in {rounds} "
          f"interleaved rounds, after {warmup} warm-up; a pair is 2 round trips"
          + ("" if ACQUIRE_RELEASE_ROUND_TRIPS == 2 else
             "; ACQUIRE+RELEASE is 1 (RELEASE is sent without waiting: protocol v2)"))
    for placement, table in stats.items():
        echo_med = table["raw echo"]["median"]
        print()
        print(f"client, daemon and echo server: {placement}")
        print(f"{'op':<38} {'median us':>10} {'p99 us':>9} {'round trips/s':>14} {'x echo':>7}")
        for label, _, _ in ops:
            s = table[label]
            print(f"{label:<38} {s['median']:>10.1f} {s['p99']:>9.1f} {s['rps']:>14,.0f} "
                  f"{s['median'] / echo_med:>7.2f}")
    print()
    print(f"concurrent clients (spawned processes, each HELLO; {client_iterations} iterations "
          f"per op per client; {os.cpu_count()} CPUs, one daemon thread)")
    print(f"{'clients':>7} {'op':<26} {'round trips/s':>14} {'p50 us':>9} {'p99 us':>9} "
          f"{'wall s':>7}")
    for n, result in concurrent.items():
        for phase, label in (("lookup", "LOOKUP 64"), ("acqrel", "ACQUIRE+RELEASE 64 (pair)")):
            s = result[phase]
            print(f"{n:>7} {label:<26} {s['rps']:>14,.0f} {s['median']:>9.1f} "
                  f"{s['p99']:>9.1f} {s['wall_s']:>7.2f}")
    if os.cpu_count() and args.clients > os.cpu_count():
        print(f"note: {args.clients} clients on {os.cpu_count()} CPUs queue behind the "
              "single-threaded daemon and share the CPUs with it: per-request latency grows "
              "with the queue; aggregate throughput is bounded by the daemon's CPU time.")
    print()
    for placement, table in stats.items():
        lookup, echo_med = table["LOOKUP 64"]["median"], table["raw echo"]["median"]
        ratio = lookup / echo_med
        verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
        print(f"LOOKUP of 64 chunks within {TARGET_RATIO:g}x of the raw echo round trip "
              f"({placement}): {verdict} ({ratio:.2f}x: {lookup:.1f} us vs {echo_med:.1f} us)")

