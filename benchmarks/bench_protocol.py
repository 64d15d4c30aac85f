"""Daemon round trips: PING, LOOKUP, ACQUIRE+RELEASE and ALLOC+COMMIT of 64 chunks.

Starts its own `lmcached serve` (256 MiB arena, 1 MiB blocks) and, as the baseline
measured in the same run, a raw Unix-socket echo server (selectors, non-blocking, one
subprocess) that echoes a 4-byte-length-prefixed frame as large as a LOOKUP-64 request.
A blocking `lmcached.protocol.Connection` then times each request (median / p99 in
microseconds, round trips per second). The ops are interleaved in rounds so that the
echo baseline and the daemon ops see the same machine conditions.

Then N concurrent client processes (multiprocessing 'spawn'; each its own HELLO) run a
LOOKUP-64 loop and an ACQUIRE+RELEASE-64 loop behind barriers; the parent reports
aggregate round trips per second and p50/p99 over every client's latencies, for 1 client
and for N. The daemon is one thread: on a 2-core machine 8 clients queue behind it and
compete with it for the CPUs, so their latencies grow with the queue.

Target: a LOOKUP of 64 chunks within 2x of the raw echo round trip. The single-client ops
run twice: with the client, the daemon and the echo server pinned to one CPU (the
software path alone: a wake-up across CPUs costs ~40-50 us on these VMs and the scheduler
places the two servers differently from run to run), then unpinned.

    python benchmarks/bench_protocol.py [--quick] [--iterations N] [--clients 8]

The daemon and the echo server are always stopped (SIGTERM, then SIGKILL by pid);
no socket and no /dev/shm/lmcached.* segment is left behind.
"""

import argparse
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

import numpy as np

from lmcached.launcher import start_daemon, stop_daemon
from lmcached.protocol import (
    ALLOCATED,
    EXISTS,
    Acquire,
    Alloc,
    Commit,
    Connection,
    Layout,
    Lookup,
    Ping,
    Release,
    encode_frame,
    hello,
)

LAYOUT = Layout("bench", 1, 0, "vllm", "bfloat16", 32, 8, 128, 256, 1 << 20)
CAPACITY = "256MiB"
BLOCK_SIZE = "1MiB"
NUM_CHUNKS = 64
HASH_BYTES = 16
TARGET_RATIO = 2.0
START_DEADLINE_S = 30.0
STOP_TIMEOUT_S = 15.0
_LENGTH = struct.Struct("<I")

# --------------------------------------------------------------------- helpers


def hashes_for(tag: int, first: int, count: int = NUM_CHUNKS) -> bytes:
    """`count` distinct 16-byte chunk hashes (tag keeps independent sets apart)."""
    return b"".join(
        tag.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(first, first + count)
    )


def store(conn: Connection, ns: int, hashes: bytes) -> int:
    """ALLOC+COMMIT every chunk of `hashes` that is not cached. Returns how many were new."""
    n = len(hashes) // HASH_BYTES
    reply = conn.request(Alloc(ns, hashes, [LAYOUT.chunk_bytes] * n))
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
        self.ns = hello(self.conn, "bench-single", LAYOUT).ns
        self.echo = EchoClient(echo_sock)
        self.hot = hashes_for(1, 0)
        self.echo_frame = encode_frame(Lookup(self.ns, self.hot))
        self.next_new = 0  # counter for ALLOC+COMMIT's new chunks

    def close(self) -> None:
        self.conn.close()
        self.echo.close()

    def ensure_hot(self) -> None:
        store(self.conn, self.ns, self.hot)
        if self.conn.request(Lookup(self.ns, self.hot)).num_chunks != NUM_CHUNKS:
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
        req, msg, clock = self.conn.request, Lookup(self.ns, self.hot), time.perf_counter_ns
        out = []
        for _ in range(n):
            t0 = clock()
            reply = req(msg)
            out.append(clock() - t0)
        if reply.num_chunks != NUM_CHUNKS:
            raise RuntimeError(f"LOOKUP found {reply.num_chunks} of {NUM_CHUNKS} chunks")
        return out

    def run_acquire_release(self, n: int) -> list[int]:
        req, msg, clock = self.conn.request, Acquire(self.ns, self.hot), time.perf_counter_ns
        out = []
        for _ in range(n):
            t0 = clock()
            reply = req(msg)
            req(Release(reply.block_ids))
            out.append(clock() - t0)
            if len(reply.block_ids) != NUM_CHUNKS:
                raise RuntimeError(f"ACQUIRE pinned {len(reply.block_ids)} blocks")
        return out

    def run_alloc_commit(self, n: int) -> list[int]:
        req, ns, clock = self.conn.request, self.ns, time.perf_counter_ns
        nbytes = [LAYOUT.chunk_bytes] * NUM_CHUNKS
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
        ns = hello(conn, f"bench-client-{index}", LAYOUT).ns
        req, clock = conn.request, time.perf_counter_ns
        lookup, acquire = Lookup(ns, hot), Acquire(ns, hot)
        for _ in range(warmup):
            req(lookup)
            req(Release(req(acquire).block_ids))
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
            req(Release(reply.block_ids))
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
    for phase, rts in (("lookup", 1), ("acqrel", 2)):
        starts = [c[phase][0] for c in collected]
        ends = [c[phase][1] for c in collected]
        lat = np.concatenate([c[phase][2] for c in collected])
        wall_s = (max(ends) - min(starts)) / 1e9
        stats = summarize(lat, rts)
        stats["rps"] = rts * len(lat) / wall_s  # aggregate: every client, wall clock
        stats["wall_s"] = wall_s
        out[phase] = stats
    return out


# ---------------------------------------------------------------------- main


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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Prints a table of median/p99 round trips, their ratio to the raw echo "
               "round trip, and whether LOOKUP-64 is within 2x of it.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="fewer iterations (under ~40 s in all)")
    parser.add_argument("--iterations", type=int,
                        help="timed iterations per single-client op [default 10000, quick 2000]")
    parser.add_argument("--rounds", type=int,
                        help="interleaved rounds the iterations are split into "
                             "[default 10, quick 4]")
    parser.add_argument("--clients", type=int, default=8,
                        help="concurrent client processes [default 8]")
    parser.add_argument("--client-iterations", type=int,
                        help="timed iterations per op per concurrent client "
                             "[default 3000, quick 1000]")
    parser.add_argument("--echo-server", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        echo_server(args.echo_server)
        return 0

    iterations = args.iterations or (2000 if args.quick else 10000)
    client_iterations = args.client_iterations or (1000 if args.quick else 3000)
    rounds = max(1, min(args.rounds or (4 if args.quick else 10), iterations))
    per_round = -(-iterations // rounds)
    warmup = 100 if args.quick else 300

    started = time.monotonic()
    name = f"bench-{os.getpid()}"
    tmp = tempfile.mkdtemp(prefix="lmcb-", dir="/tmp")
    daemon_sock = os.path.join(tmp, "d.sock")
    echo_sock = os.path.join(tmp, "e.sock")
    daemon = echo = single = None
    leftovers = []
    try:
        daemon = start_daemon(name, daemon_sock, "--capacity", CAPACITY, "--block-size", BLOCK_SIZE,
                              log_path=os.path.join(tmp, "daemon.log"), timeout_s=START_DEADLINE_S)
        echo = start_echo(echo_sock, os.path.join(tmp, "echo.log"))
        single = SingleClient(daemon_sock, echo_sock)
        frame_bytes = len(single.echo_frame)

        ops = [
            ("raw echo", single.run_echo, 1),
            ("PING", single.run_ping, 1),
            ("LOOKUP 64", single.run_lookup, 1),
            ("ACQUIRE+RELEASE 64 (pair)", single.run_acquire_release, 2),
            ("ALLOC+COMMIT 64 new (pair, evicting)", single.run_alloc_commit, 2),
        ]
        # Warm-up: fill the arena (so ALLOC evicts from then on) and warm every path.
        single.ensure_hot()
        single.run_alloc_commit(256 // NUM_CHUNKS + 1)
        single.ensure_hot()
        for _, fn, _ in ops:
            fn(warmup)
        # Each placement times every op: all three processes on one CPU (the software
        # path alone), then wherever the scheduler puts them. A wake-up across CPUs costs
        # ~40-50 us on these VMs, and the scheduler places the two servers differently
        # from run to run, so only the one-CPU figures compare the daemon with the echo.
        all_cpus = os.sched_getaffinity(0)
        stats = {}
        for placement, cpus in (("one CPU", {min(all_cpus)}), ("unpinned", all_cpus)):
            for pid in (0, daemon.pid, echo.pid):
                os.sched_setaffinity(pid, cpus)
            samples = {label: [] for label, _, _ in ops}
            for _ in range(rounds):
                single.ensure_hot()  # ALLOC of the previous round evicted the hot set
                for label, fn, _ in ops:
                    samples[label].extend(fn(per_round))
            single.ensure_hot()
            stats[placement] = {label: summarize(samples[label], rts) for label, _, rts in ops}

        concurrent = {}
        for n in sorted({1, args.clients}):
            single.ensure_hot()
            concurrent[n] = run_concurrent(daemon_sock, single.hot, n, client_iterations,
                                           warmup=min(warmup, client_iterations))
        single.close()
        single = None
    finally:
        if single is not None:
            single.close()
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

    # ------------------------------------------------------------------ report
    mode = "quick" if args.quick else "full"
    print(f"lmcached protocol benchmark ({mode}): Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, {platform.machine()}")
    print(f"daemon: {CAPACITY} arena, {BLOCK_SIZE} blocks; LOOKUP-64 request frame "
          f"{frame_bytes} bytes (the echo frame is the same size, both ways)")
    print(f"single blocking client: {per_round * rounds} iterations per op in {rounds} "
          f"interleaved rounds, after {warmup} warm-up; a pair is 2 round trips")
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
    print(f"total {time.monotonic() - started:.1f} s; leftovers: "
          f"{', '.join(leftovers) if leftovers else 'none'}")
    return 0 if not leftovers else 1


if __name__ == "__main__":
    sys.exit(main())
