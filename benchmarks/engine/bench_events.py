"""What the chunk event feed costs a store, and how many events per second it delivers.

One daemon; one client stores prompts of new tokens (CacheEngine.store: hashing, ALLOC,
record writes, COMMIT; a small layout, so that the store is mostly the daemon's work and
the feed's share is as large as it can be). Three modes, alternated round by round so that
drift hits each alike, each the median over rounds (docs/kv-events.md):

    none      no subscriber
    idle      one subscriber that never polls (it lags, then loses events: counted)
    busy      one subscriber process polling EVENTS (with token ids) as fast as it can

The ratios idle/none and busy/none are store throughputs in the same run. Events per
second: the events the busy subscriber received per second of its polling, and the events
the daemon published per second of storing. The feed publishes whether anyone listens
(sequence numbers must show every gap), so "none" already pays it: `publish_ns_per_event`
is that cost alone (EventFeed.stored, in process), against `store_us_per_chunk_none`.

    python -m benchmarks.engine.bench_events [--quick] [--out benchmarks/results/DATE-events]
"""

import argparse
import multiprocessing
import random
import statistics
import time
import timeit

import torch

from benchmarks.common import machine_info, record_block_size, running_daemon, write_results
from lmcached.client import CacheEngine, KVLayout
from lmcached.daemon.events import EventFeed
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Events, Info, Subscribe

LAYOUT = KVLayout("bench-events", num_layers=2, num_kv_heads=2, head_size=16,
                  dtype="bfloat16", chunk_size=256)
PROMPT_TOKENS = 4096  # 16 chunks a store


def _stats(socket: str) -> dict:
    with Connection(socket, timeout_s=30) as conn:
        return conn.request(Info("stats")).sections["stats"]


def _wait_subscribers(socket: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while _stats(socket)["events_subscribers"] != n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"expected {n} subscribers")
        time.sleep(0.01)


def _busy_subscriber(socket: str, stop, result) -> None:
    """Poll EVENTS with token ids until `stop` is set; report events and seconds."""
    with Connection(socket, timeout_s=30) as conn:
        cursor = conn.request(Subscribe([])).cursor
        received = lost = 0
        started = time.perf_counter()
        while not stop.is_set():
            reply = conn.request(Events(cursor, 0, True))
            cursor = reply.cursor
            received += len(reply.events)
            lost += reply.lost
        result.put((received, lost, time.perf_counter() - started))


def _store_rate(engine: CacheEngine, kv: torch.Tensor, seconds: float, counter: list) -> float:
    """Stores per second of new prompts for about `seconds`."""
    num_stores = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        first = counter[0]
        counter[0] += PROMPT_TOKENS
        tokens = torch.arange(first, first + PROMPT_TOKENS, dtype=torch.int64) % 120_000
        tokens[0] = first  # unique per store: a new chain every time
        if engine.store(tokens, kv) == 0:
            raise RuntimeError("a store wrote nothing")
        num_stores += 1
    return num_stores / (time.perf_counter() - started)


def publish_ns() -> float:
    """Nanoseconds one `EventFeed.stored` takes (what a COMMIT pays per chunk), in process."""
    feed = EventFeed()
    key = b"c" + bytes(20)
    number = 200_000
    best = min(timeit.repeat(lambda: feed.stored(key, b"", 0), number=number, repeat=5))
    return best / number * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1 s per mode")
    parser.add_argument("--out", help="directory for results.json")
    args = parser.parse_args()
    rounds, seconds = (3, 1.0) if args.quick else (7, 2.0)
    ctx = multiprocessing.get_context("spawn")
    rates: dict[str, list[float]] = {"none": [], "idle": [], "busy": []}
    received_per_s, published_per_s = [], []
    with running_daemon("256MiB", record_block_size(LAYOUT)) as socket:
        engine = CacheEngine.connect(LAYOUT, socket=socket, strict=True)
        kv = torch.zeros(LAYOUT.chunk_shape(PROMPT_TOKENS), dtype=torch.bfloat16)
        counter = [1]
        _store_rate(engine, kv, seconds, counter)  # warm-up: the arena fills, evictions start
        order = random.Random(0)
        for _ in range(rounds):
            modes = list(rates)
            order.shuffle(modes)  # no mode always runs first (or after the busy one)
            for mode in modes:
                _wait_subscribers(socket, 0)
                if mode == "none":
                    rates["none"].append(_store_rate(engine, kv, seconds, counter))
                elif mode == "idle":
                    idle = Connection(socket, timeout_s=30)
                    hello(idle, "bench-idle-subscriber")
                    idle.request(Subscribe([]))
                    rates["idle"].append(_store_rate(engine, kv, seconds, counter))
                    idle.close()
                else:
                    stop, result = ctx.Event(), ctx.Queue()
                    proc = ctx.Process(target=_busy_subscriber, args=(socket, stop, result))
                    proc.start()
                    _wait_subscribers(socket, 1)
                    before = _stats(socket)["events_published"]
                    started = time.perf_counter()
                    rates["busy"].append(_store_rate(engine, kv, seconds, counter))
                    published_per_s.append((_stats(socket)["events_published"] - before)
                                           / (time.perf_counter() - started))
                    stop.set()
                    received, _lost, polled_s = result.get(timeout=60)
                    proc.join(timeout=30)
                    received_per_s.append(received / polled_s)
        engine.close()
        final = _stats(socket)
    none = statistics.median(rates["none"])
    results = {
        "machine": machine_info(),
        "command": "python -m benchmarks.engine.bench_events" + (" --quick" if args.quick else ""),
        "prompt_tokens": PROMPT_TOKENS,
        "chunks_per_store": PROMPT_TOKENS // LAYOUT.chunk_size,
        "record_bytes": LAYOUT.record_bytes(LAYOUT.chunk_size),
        "rounds": rounds,
        "seconds_per_mode": seconds,
        "stores_per_s": {mode: round(statistics.median(r), 1) for mode, r in rates.items()},
        "ratio_idle_to_none": round(statistics.median(rates["idle"]) / none, 3),
        "ratio_busy_to_none": round(statistics.median(rates["busy"]) / none, 3),
        "events_received_per_s_busy": round(statistics.median(received_per_s)),
        "events_published_per_s_busy": round(statistics.median(published_per_s)),
        "events_lost_total": final["events_lost"],
        "publish_ns_per_event": round(publish_ns(), 1),
        "store_us_per_chunk_none": round(1e6 / none / (PROMPT_TOKENS // LAYOUT.chunk_size), 2),
    }
    write_results(results, args.out)


if __name__ == "__main__":
    main()
