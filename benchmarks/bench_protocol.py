"""Daemon round trips: the wire protocol, and what CacheEngine and the vLLM scheduler cost.

Every section starts its own `lmcached serve` and, as the baseline measured in the same
run, a raw Unix-socket echo server (selectors, non-blocking, one subprocess) that echoes a
4-byte-length-prefixed frame as large as the section's requests. Ops are interleaved in
rounds so that the echo baseline and the daemon ops see the same machine conditions, and
timed twice: with the client, the daemon and the echo server pinned to one CPU (the
software path alone: a wake-up across CPUs costs ~40-50 us on these VMs and the scheduler
places the two servers differently from run to run), then unpinned.

wire (256 MiB arena, 1 MiB blocks): a blocking `lmcached.protocol.Connection` times
PING, LOOKUP, ACQUIRE+RELEASE and ALLOC+COMMIT of 64 chunks (median / p99 in
microseconds, round trips per second). Then N concurrent client processes
(multiprocessing 'spawn'; each its own HELLO) run a LOOKUP-64 loop and an
ACQUIRE+RELEASE-64 loop behind barriers; the parent reports aggregate round trips per
second and p50/p99 over every client's latencies, for 1 client and for N. The daemon is
one thread: on a 2-core machine 8 clients queue behind it and compete with it for the
CPUs, so their latencies grow with the queue. Target: a LOOKUP of 64 chunks within 2x of
the raw echo round trip.

engine / scheduler (the "round-trips" sections; 4,096-token prompt, 8 MiB chunk records):
round trips per operation of the public client APIs, counted by the daemon (INFO's
`requests` counter, stats section: its delta over N operations / N, less the INFO
request itself, so requests that get no reply are counted too), and their p50 / p99.
  engine:    `CacheEngine.retrieve_views` of the prompt (Llama-3.2-1B KV); `lookup`;
             `lookup` then `retrieve_views`; and, where `lookup` takes `pin`,
             `lookup(pin=True)` then `retrieve_views`.
  scheduler: one vLLM request through `LMCachedConnectorScheduler` at TP=4 (Llama-3-8B
             KV, 4 namespaces, every chunk stored in each): get_num_new_matched_tokens
             + update_state_after_alloc + request_finished (which releases the pins).
             No vLLM needed: Request and KVCacheBlocks are stand-ins with the
             attributes the scheduler side reads.
Only public APIs are used and newer features are detected, so the same script measures
protocol v1 and v2 ("before" and "after").

    python benchmarks/bench_protocol.py [--section all|wire|round-trips|engine|scheduler]
                                        [--quick] [--iterations N] [--clients 8] [--json PATH]

The daemons and echo servers are always stopped (SIGTERM, then SIGKILL by pid);
no socket and no /dev/shm/lmcached.* segment is left behind.
"""

import argparse
import contextlib
import dataclasses
import inspect
import itertools
import json
import multiprocessing
import os
import platform
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np

from lmcached.launcher import start_daemon, stop_daemon
from lmcached.protocol import (
    ALLOCATED,
    EXISTS,
    Acquire,
    Alloc,
    Commit,
    Connection,
    Hello,
    Info,
    Layout,
    Lookup,
    Ping,
    Release,
    encode_frame,
    hello,
)

RECORD_BYTES = 1 << 20  # the wire section's chunks: one 1 MiB block each
LAYOUT = Layout("bench", 1, 0, "vllm", "bfloat16", 32, 8, 128, 256, RECORD_BYTES)
CAPACITY = "256MiB"
BLOCK_SIZE = "1MiB"
NUM_CHUNKS = 64
HASH_BYTES = 16
TARGET_RATIO = 2.0
START_DEADLINE_S = 30.0
STOP_TIMEOUT_S = 15.0
_LENGTH = struct.Struct("<I")
SECTIONS = ("all", "wire", "round-trips", "engine", "scheduler")

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
    try:
        with open(path, errors="replace") as f:
            return f.read()[-4000:]
    except OSError:
        return "(no log)"


# ------------------------------------------------------------ raw echo baseline


def echo_server(path: str) -> None:
    """A selectors echo server of length-prefixed frames (runs in its own process).

    Non-blocking like the daemon's loop: recv into a buffer, cut whole frames, send each
    back. Stops on SIGTERM and unlinks its socket.
    """
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    sel = selectors.DefaultSelector()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ, None)
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    buffers: dict[socket.socket, bytearray] = {}
    try:
        while not stop:
            for key, _ in sel.select():
                if key.data == "wake":
                    try:
                        wake_r.recv(64)
                    except BlockingIOError:
                        pass
                    continue
                if key.fileobj is listener:
                    sock, _ = listener.accept()
                    sock.setblocking(False)
                    buffers[sock] = bytearray()
                    sel.register(sock, selectors.EVENT_READ, "client")
                    continue
                sock = key.fileobj
                try:
                    data = sock.recv(256 * 1024)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(sock)
                    sock.close()
                    buffers.pop(sock, None)
                    continue
                inbuf = buffers[sock]
                inbuf += data
                while len(inbuf) >= 4:
                    end = 4 + int.from_bytes(inbuf[:4], "little")
                    if len(inbuf) < end:
                        break
                    frame = bytes(inbuf[:end])
                    del inbuf[:end]
                    sock.sendall(frame)  # small frames: the kernel buffer takes them whole
    finally:
        for sock in list(buffers):
            sock.close()
        listener.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class EchoClient:
    """Blocking client of the echo server: same framing work as `Connection.request`."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10.0)
        self.sock.connect(path)
        self.header = bytearray(4)

    def round_trip(self, frame: bytes) -> bytes:
        self.sock.sendall(frame)
        self._recv_exactly(self.header)
        (length,) = _LENGTH.unpack(self.header)
        payload = bytearray(length)
        self._recv_exactly(payload)
        return payload

    def _recv_exactly(self, buf: bytearray) -> None:
        view = memoryview(buf)
        while view:
            n = self.sock.recv_into(view)
            if n == 0:
                raise ConnectionResetError("echo server closed the connection")
            view = view[n:]

    def close(self) -> None:
        self.sock.close()


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


# ------------------------------------------------------------------ servers


def start_echo(sock: str, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--echo-server", sock]
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
        daemon = start_daemon(name, daemon_sock, "--capacity", capacity, "--block-size", block_size,
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
    (see the module docstring for why both; `place` applies one)."""
    all_cpus = os.sched_getaffinity(0)
    return [("one CPU", {min(all_cpus)}), ("unpinned", all_cpus)]


def place(cpus: set[int], *pids: int) -> None:
    """Pin this process's calling thread and `pids` to `cpus`."""
    for pid in (0, *pids):
        os.sched_setaffinity(pid, cpus)


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
            # compare the daemon with the echo (see the module docstring).
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


# ----------------------------------------- engine and scheduler round trips

PROMPT_TOKENS = 4096
CHUNK_TOKENS = 256
NUM_PROMPT_CHUNKS = PROMPT_TOKENS // CHUNK_TOKENS
TP_SIZE = 4
VLLM_BLOCK_TOKENS = 16
# (model, num_layers, num_kv_heads, head_size): both give 8 MiB bfloat16 chunk records.
ENGINE_MODEL = ("llama-3.2-1b", 16, 8, 64)
TP_MODEL = ("llama-3-8b", 32, 8 // TP_SIZE, 128)  # one TP rank's share of the KV heads
SPARE_BLOCKS = 16
SETTLE_S = 0.05  # lets the daemon read requests that get no reply before INFO counts
ECHO_LABEL = "raw echo (baseline)"
PIN_LABEL = "lookup(pin=True) + retrieve_views 4k"
PIN_MISSING = "n/a (not in this version)"


class StandInRequest:
    """What the connector's scheduler side reads of vLLM's `Request` (vllm.v1.request).

    A plain, unsalted text request without LoRA, multi-modal inputs or prompt embeddings,
    nothing computed by vLLM yet.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = prompt_token_ids
        self.num_tokens = self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.lora_request = None
        self.mm_features = []
        self.cache_salt = None
        self.prompt_embeds = None
        self.kv_transfer_params = None


class StandInBlocks:
    """vLLM's `KVCacheBlocks` as the scheduler side reads it: one KV cache group's ids."""

    def __init__(self, block_ids: list[int]) -> None:
        self._block_ids = (list(block_ids),)

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The vLLM block ids of each KV cache group (one group here)."""
        return self._block_ids


class RequestCounter:
    """The daemon's request counter (INFO, stats section, `requests`) on an admin session.

    The daemon counts every request it reads, one that gets no reply (a v2 RELEASE) too;
    the INFO that reads the counter counts itself.
    """

    def __init__(self, socket: str) -> None:
        self.conn = Connection(socket, timeout_s=30.0)
        hello(self.conn, "bench-request-counter")

    def read(self) -> int:
        """The counter now (one INFO request, included in the value)."""
        return int(self.conn.request(Info("stats")).sections["stats"]["requests"])

    def pinned_blocks(self) -> int:
        """INFO's `pinned_blocks` (blocks section), after the daemon read what was sent."""
        time.sleep(SETTLE_S)
        return int(self.conn.request(Info("blocks")).sections["blocks"]["pinned_blocks"])

    def per_op(self, run, n: int) -> float:
        """Requests the daemon counted per call of `run(n)`'s op, less the INFO reading it.

        Args:
            run: runs its op n times.
            n: calls to count over, >= 1.
        """
        before = self.read()
        run(n)
        time.sleep(SETTLE_S)
        return (self.read() - before - 1) / n

    def close(self) -> None:
        self.conn.close()


def accepts(fn, name: str) -> bool:
    """Whether callable `fn` takes a parameter `name` (features of a newer client)."""
    return name in inspect.signature(fn).parameters


def time_op(op, n: int, label: str) -> list[int]:
    """Latencies (ns) of n back-to-back calls of `op`.

    Raises:
        RuntimeError: `op` returned a token count other than the whole prompt (None:
            nothing to check).
    """
    clock, out = time.perf_counter_ns, []
    for _ in range(n):
        t0 = clock()
        found = op()
        out.append(clock() - t0)
        if found is not None and found != PROMPT_TOKENS:
            raise RuntimeError(f"{label}: found {found} of {PROMPT_TOKENS} tokens")
    return out


class RoundTripBench:
    """The public client APIs against one daemon, as ops for `time_op`.

    `setup` stores the prompt in each namespace used (untimed): once for the engine
    (Llama-3.2-1B layout), once per TP rank for the scheduler (Llama-3-8B at TP=4).

    Attributes:
        ops: (label, op) of every op set up, the echo baseline first. An op does one
            operation and returns the prompt tokens it found (None for the echo).
        has_pin: whether `CacheEngine.lookup` takes `pin` (the pinned op is in `ops`).
    """

    def __init__(self) -> None:
        self.ops: list[tuple[str, Callable[[], int | None]]] = []
        self.has_pin = False
        self.echo = self.engine = self.scheduler = None

    @staticmethod
    def layouts():
        """(engine layout, scheduler layouts per TP rank): KVLayouts, 8 MiB records."""
        from lmcached.client.layout import KVLayout

        name, layers, heads, head_size = ENGINE_MODEL
        engine = KVLayout(name, layers, heads, head_size, "bfloat16", CHUNK_TOKENS)
        name, layers, heads, head_size = TP_MODEL
        ranks = [KVLayout(name, layers, heads, head_size, "bfloat16", CHUNK_TOKENS, "vllm",
                          world_size=TP_SIZE, worker_id=rank) for rank in range(TP_SIZE)]
        return engine, ranks

    def setup(self, daemon_sock: str, echo_sock: str, engine: bool, scheduler: bool) -> None:
        """Connect, store the prompt where needed, and fill `ops`.

        Raises:
            RuntimeError: a store did not leave the whole prompt cached.
        """
        # Imported here, not at the top: the echo server and the wire section's spawned
        # clients re-import this module and need neither torch nor the client.
        import torch

        from lmcached.client.engine import CacheEngine
        from lmcached.client.vllm.scheduler import LMCachedConnectorScheduler
        from lmcached.client.vllm.specs import ConnectorSettings

        self.echo = EchoClient(echo_sock)
        payload = bytes(NUM_PROMPT_CHUNKS * HASH_BYTES + 32)  # as large as an ACQUIRE of it
        echo_frame, round_trip = _LENGTH.pack(len(payload)) + payload, self.echo.round_trip

        def echo() -> None:
            round_trip(echo_frame)

        self.ops.append((ECHO_LABEL, echo))
        tokens = np.arange(1000, 1000 + PROMPT_TOKENS, dtype=np.int64)
        engine_layout, rank_layouts = self.layouts()
        options = {"socket": daemon_sock, "strict": True}
        if accepts(CacheEngine.connect, "data_timeout_s"):  # no degrade to misses under load
            options["data_timeout_s"] = 30.0
        kv = torch.zeros(engine_layout.chunk_shape(PROMPT_TOKENS), dtype=torch.bfloat16)

        def store(layout) -> CacheEngine:
            cache = CacheEngine.connect(layout, **options)
            cache.store(tokens, kv.view(layout.chunk_shape(PROMPT_TOKENS)))
            if cache.lookup(tokens) != PROMPT_TOKENS:
                cache.close()
                raise RuntimeError(f"the prompt is not all cached after a store ({layout})")
            return cache

        if engine:
            self.engine = cache = store(engine_layout)

            def retrieve() -> int:
                with cache.retrieve_views(tokens) as views:
                    return views.num_tokens

            self.ops += [("retrieve_views 4k", retrieve),
                         ("lookup 4k", lambda: cache.lookup(tokens)),
                         ("lookup + retrieve_views 4k",
                          lambda: min(cache.lookup(tokens), retrieve()))]
            self.has_pin = accepts(CacheEngine.lookup, "pin")
            if self.has_pin:
                self.ops.append((PIN_LABEL, lambda: min(cache.lookup(tokens, pin=True),
                                                        retrieve())))
        if scheduler:
            for layout in rank_layouts:
                store(layout).close()  # the chunks stay cached
            settings = ConnectorSettings(
                layouts=rank_layouts, chunk_size=CHUNK_TOKENS, block_size=VLLM_BLOCK_TOKENS,
                world_size=TP_SIZE, socket=daemon_sock, daemon_name="unused", timeout_s=30.0,
            )
            self.scheduler = sched = LMCachedConnectorScheduler(settings)
            # vLLM leaves at least one prompt token to compute: one more than the chunks.
            prompt = tokens.tolist() + [7]
            blocks = StandInBlocks(list(range(-(-len(prompt) // VLLM_BLOCK_TOKENS))))
            # request_finished(request) here; vLLM's hook also passes the block ids.
            finished = inspect.signature(sched.request_finished).parameters
            finish_args = (blocks.get_block_ids()[0],) if len(finished) > 1 else ()
            request_ids = itertools.count()

            def vllm_request() -> int:
                """A new request: match, allocate (pins the chunks), finish (unpins)."""
                request = StandInRequest(f"bench-{next(request_ids)}", prompt)
                matched = sched.get_num_new_matched_tokens(request, 0)
                if isinstance(matched, tuple):  # vLLM's hook answers (tokens, load async)
                    matched = matched[0]
                sched.update_state_after_alloc(request, blocks, matched)
                sched.request_finished(request, *finish_args)
                return matched

            self.ops.append((f"vLLM scheduler request, TP={TP_SIZE}", vllm_request))

    def close(self) -> None:
        """Close every session and the echo connection (the daemon drops their pins)."""
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.engine is not None:
            self.engine.close()
        if self.echo is not None:
            self.echo.close()


def run_round_trips(args, engine: bool, scheduler: bool, leftovers: list[str]) -> dict:
    """The engine and/or scheduler sections: round trips counted, then timed; prints them.

    Returns:
        The figures, as written by --json.
    """
    import lmcached
    from lmcached.protocol import PROTOCOL_VERSION

    from common import record_block_size

    iterations = args.iterations or (600 if args.quick else 5000)
    rounds = max(1, min(args.rounds or (4 if args.quick else 10), iterations))
    per_round = -(-iterations // rounds)
    warmup = 100 if args.quick else 300
    count_ops = 50 if args.quick else 500
    engine_layout, rank_layouts = RoundTripBench.layouts()
    block_size = record_block_size(engine_layout)
    assert record_block_size(rank_layouts[0]) == block_size, "the two layouts' records differ"
    num_blocks = NUM_PROMPT_CHUNKS * (engine + TP_SIZE * scheduler) + SPARE_BLOCKS
    capacity = str(num_blocks * int(block_size))

    load_before = os.getloadavg()
    started = time.monotonic()
    bench, counter = RoundTripBench(), None
    with private_servers("rt", capacity, block_size, leftovers) as servers:
        try:
            bench.setup(servers.daemon_sock, servers.echo_sock, engine, scheduler)
            setup_s = time.monotonic() - started
            counter = RequestCounter(servers.daemon_sock)
            for label, op in bench.ops:
                time_op(op, warmup, label)
            round_trips = {label: counter.per_op(lambda n: time_op(op, n, label), count_ops)
                           for label, op in bench.ops if label != ECHO_LABEL}
            stats = {}
            for placement, cpus in placements():
                place(cpus, servers.daemon.pid, servers.echo.pid)
                samples = {label: [] for label, _ in bench.ops}
                for _ in range(rounds):
                    for label, op in bench.ops:
                        samples[label].extend(time_op(op, per_round, label))
                stats[placement] = {label: summarize(samples[label]) for label, _ in bench.ops}
            pinned = counter.pinned_blocks()
            if pinned:
                raise RuntimeError(f"{pinned} blocks still pinned after every op was done")
        finally:
            if counter is not None:
                counter.close()
            bench.close()

    mode = "quick" if args.quick else "full"
    sections = [name for name, on in (("engine", engine), ("scheduler", scheduler)) if on]
    print(f"lmcached protocol benchmark, {' + '.join(sections)} round trips ({mode}): "
          f"protocol v{PROTOCOL_VERSION}, lmcached from {os.path.dirname(lmcached.__file__)}, "
          f"Python {platform.python_version()}, {os.cpu_count()} CPUs")
    print(f"prompt: {PROMPT_TOKENS:,} tokens = {NUM_PROMPT_CHUNKS} chunks of {CHUNK_TOKENS}; "
          f"engine: {ENGINE_MODEL[0]} KV; scheduler: {TP_MODEL[0]} KV at TP={TP_SIZE} "
          f"({TP_SIZE} namespaces), vLLM blocks of {VLLM_BLOCK_TOKENS} tokens, one more "
          "prompt token to compute; 8 MiB chunk records")
    print(f"daemon: {num_blocks} blocks of {int(block_size) / 2**20:.2f} MiB, started and "
          f"the prompt stored in {setup_s:.1f} s; "
          f"{per_round * rounds} timed iterations per op in {rounds} interleaved rounds after "
          f"{warmup} warm-up; round trips counted over {count_ops} ops")
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; "
          f"after {', '.join(f'{x:.2f}' for x in load_after)} (other processes share the CPUs)")
    print("round trips/op: requests the daemon counted per op (INFO stats `requests`, less "
          "the INFO itself); a fire-and-forget RELEASE (protocol v2) is counted as a request "
          "but costs no wait")
    result = {"protocol_version": PROTOCOL_VERSION,
              "lmcached": os.path.dirname(lmcached.__file__), "mode": mode,
              "iterations": per_round * rounds, "load_before": load_before,
              "load_after": load_after, "lookup_pin": bench.has_pin,
              "round_trips": round_trips, "latency_us": {}}
    for placement, table in stats.items():
        echo_p50 = table[ECHO_LABEL]["median"]
        print()
        print(f"client, daemon and echo server: {placement}")
        print(f"{'op':<38} {'round trips/op':>14} {'p50 us':>9} {'p99 us':>9} {'x echo p50':>11}")
        result["latency_us"][placement] = {}
        for label, _ in bench.ops:
            s = table[label]
            rts = f"{round_trips[label]:.2f}" if label in round_trips else "1"
            print(f"{label:<38} {rts:>14} {s['median']:>9.1f} {s['p99']:>9.1f} "
                  f"{s['median'] / echo_p50:>11.2f}")
            result["latency_us"][placement][label] = {
                "p50": s["median"], "p99": s["p99"], "x_echo_p50": s["median"] / echo_p50}
        if engine and not bench.has_pin:
            print(f"{PIN_LABEL:<38} {PIN_MISSING}")
    print()
    return result


# ---------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Prints, per section, a table of p50/p99 latencies and their ratio to the raw "
               "echo round trip measured in the same run; the wire section also says whether "
               "LOOKUP-64 is within 2x of it, the engine and scheduler sections how many "
               "round trips each op costs.",
    )
    parser.add_argument("--section", choices=SECTIONS, default="all",
                        help="what to measure: the wire protocol, the engine's and the vLLM "
                             "scheduler's round trips (round-trips = both), or all [all]")
    parser.add_argument("--quick", action="store_true",
                        help="fewer iterations (each of wire and round-trips then runs "
                             "in under ~35 s on 2 busy cores)")
    parser.add_argument("--iterations", type=int,
                        help="timed iterations per single-client op [default: wire 10000, "
                             "round-trips 5000; quick 2000 and 600]")
    parser.add_argument("--rounds", type=int,
                        help="interleaved rounds the iterations are split into "
                             "[default 10, quick 4]")
    parser.add_argument("--clients", type=int, default=8,
                        help="concurrent client processes of the wire section [default 8]")
    parser.add_argument("--client-iterations", type=int,
                        help="timed iterations per op per concurrent client "
                             "[default 3000, quick 1000]")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the engine and scheduler figures to PATH as JSON")
    parser.add_argument("--echo-server", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        echo_server(args.echo_server)
        return 0

    started = time.monotonic()
    leftovers: list[str] = []
    if args.section in ("all", "wire"):
        run_wire(args, leftovers)
        print()
    engine = args.section in ("all", "round-trips", "engine")
    scheduler = args.section in ("all", "round-trips", "scheduler")
    if engine or scheduler:
        result = run_round_trips(args, engine, scheduler, leftovers)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    print(f"total {time.monotonic() - started:.1f} s; leftovers: "
          f"{', '.join(leftovers) if leftovers else 'none'}")
    return 0 if not leftovers else 1


if __name__ == "__main__":
    sys.exit(main())
