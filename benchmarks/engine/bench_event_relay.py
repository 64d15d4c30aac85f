"""What announcing the daemon's chunks costs an engine's step, and how late the announcement is.

The engine side of the KV event feed (docs/kv-events.md): a vLLM scheduler calls the
connector's `take_events()` once per step, which polls the daemon through an
`EventRelay` (client/serving/events.py) and turns each chunk event into vLLM's
`BlockStored` / `BlockRemoved` in the instance's own block hashes. Measured here, against
one private daemon, the relay in this process as the connector holds it:

    step cost, 0 events   take_events() when nothing happened: with the connector's
                          default interval (kv_events_interval_s = 0.01, most calls send
                          nothing) and with a round trip on every call (interval 0)
    step cost, N events   take_events() that returns the chunks of the prompts another
                          client stored since the last step (N chunk events, each hashed
                          into chunk_size / block_size engine blocks)
    lag                   a writer process stores a prompt every 20 ms; the time from its
                          store's return to the step that announces its first chunk, the
                          relay polled once per `step_s` (a vLLM step), median and p99
    attach                a relay attaching to the daemon holding every chunk stored
                          above: the steps its snapshot takes and their cost
    --attach-chunks N     alone, in a daemon of its own: N chunks cached (a small
                          layout: 256-token chunks of one 8-wide head, 12 KiB blocks),
                          then a relay attaches, polled once per 10 ms step, while
                          another process stores a 16-chunk prompt every 20 ms until
                          the relay's snapshot is over: the time until it announced
                          every chunk, chunk events per second, the largest poll (chunk
                          and block events, wall time), and whether it is complete (its
                          announced chunks = the daemon's cached values; nothing lost,
                          nothing unresolved)

With vLLM importable (run under the vLLM venv), `take_events()` is the connector's own
(vLLM's sha256 block hash and event classes, `client/vllm/kv_events.py`); otherwise a
stand-in hash (sha256 of the pickled block, as vLLM's) and the relay's own events.

    python -m benchmarks.engine.bench_event_relay [--quick] [--out DIR]
    python -m benchmarks.engine.bench_event_relay --attach-chunks 100000 [--out DIR]
"""

import argparse
import hashlib
import multiprocessing
import os
import pickle
import statistics
import time

import numpy as np
import torch

from benchmarks.common import machine_info, record_block_size, running_daemon, write_results
from lmcached.client import CacheEngine, KVLayout
from lmcached.client.serving.events import EventRelay
from lmcached.wire.connection import Connection
from lmcached.wire.protocol import Info

LAYOUT = KVLayout("bench-relay", num_layers=2, num_kv_heads=2, head_size=16,
                  dtype="bfloat16", chunk_size=256)
BLOCK_SIZE = 16  # vLLM's default block size
PROMPT_TOKENS = 4096  # 16 chunks a prompt


def _take_events_fn(relay: EventRelay):
    """(take_events, name): the connector's conversion when vLLM is importable."""
    try:
        from lmcached.client.vllm.kv_events import to_vllm_events
    except ImportError:
        return relay.poll, "relay.poll (stand-in sha256 hash, no vLLM)"
    return (lambda: to_vllm_events(relay.poll())), "to_vllm_events(relay.poll()) (vLLM sha256)"


def _hasher():
    """vLLM's sha256 block hash when vLLM is importable, else the same construction."""
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from lmcached.client.vllm.kv_events import vllm_block_hasher
    except ImportError:
        def block_hash(parent, token_ids, extra):
            return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra),
                                               protocol=pickle.HIGHEST_PROTOCOL)).digest()
        return block_hash
    kv_cache_utils.init_none_hash(sha256)
    return vllm_block_hasher("sha256")


def _hasher_name() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "the stand-in sha256 block hash (no vLLM)"
    return "vLLM's sha256 block hash"


def _relay(socket: str, interval_s: float, snapshot: bool = False) -> EventRelay:
    """A relay as the connector makes it; without a snapshot unless asked (the step and
    lag figures are of a relay that follows the live feed)."""
    return EventRelay(LAYOUT.to_wire(), BLOCK_SIZE, _hasher(), socket=socket,
                      max_events=1024, min_interval_s=interval_s, timeout_s=5.0,
                      snapshot=snapshot)


def _prompt(i: int) -> torch.Tensor:
    tokens = torch.arange(PROMPT_TOKENS, dtype=torch.int64) % 30_000 + 1
    tokens[0] = 100_000 + i  # a new chain per prompt
    return tokens


def _quantiles_us(samples_s: list[float]) -> dict[str, float]:
    data = np.array(samples_s) * 1e6
    return {"median_us": round(float(np.median(data)), 1),
            "p99_us": round(float(np.percentile(data, 99)), 1),
            "mean_us": round(float(data.mean()), 1), "calls": len(samples_s)}


def idle_step_cost(socket: str, interval_s: float, num_calls: int,
                   step_s: float) -> dict[str, float]:
    """take_events() with nothing to announce, called every `step_s`."""
    relay = _relay(socket, interval_s)
    take, _ = _take_events_fn(relay)
    take()  # connects and subscribes
    samples = []
    for _ in range(num_calls):
        started = time.perf_counter()
        out = take()
        samples.append(time.perf_counter() - started)
        assert out == [], out
        time.sleep(step_s)
    relay.close()
    return _quantiles_us(samples)


def busy_step_cost(socket: str, prompts_per_step: int, num_steps: int,
                   counter: list) -> dict[str, float]:
    """take_events() returning the chunks of `prompts_per_step` prompts stored since."""
    relay = _relay(socket, 0.0)
    take, _ = _take_events_fn(relay)
    take()
    engine = CacheEngine.connect(LAYOUT, socket=socket, strict=True)
    kv = torch.zeros(LAYOUT.chunk_shape(PROMPT_TOKENS), dtype=torch.bfloat16)
    samples, num_events = [], []
    for _ in range(num_steps):
        for _ in range(prompts_per_step):
            counter[0] += 1
            engine.store(_prompt(counter[0]), kv)
        started = time.perf_counter()
        out = take()
        samples.append(time.perf_counter() - started)
        num_events.append(len(out))
    engine.close()
    relay.close()
    result = _quantiles_us(samples)
    chunks = prompts_per_step * PROMPT_TOKENS // LAYOUT.chunk_size
    result.update(chunk_events_per_step=chunks, events_per_step=statistics.median(num_events),
                  us_per_chunk=round(result["median_us"] / chunks, 2))
    return result


def _writer(socket: str, first: int, count: int, period_s: float, times) -> None:
    """Store `count` prompts, one every `period_s`; report (index, monotonic time after
    the store returned) of each."""
    engine = CacheEngine.connect(LAYOUT, socket=socket, strict=True)
    kv = torch.zeros(LAYOUT.chunk_shape(PROMPT_TOKENS), dtype=torch.bfloat16)
    out = []
    for i in range(first, first + count):
        engine.store(_prompt(i), kv)
        out.append((i, time.monotonic()))
        time.sleep(period_s)
    engine.close()
    times.put(out)


def lag(socket: str, step_s: float, count: int, counter: list) -> dict[str, float]:
    """Store-to-announcement lag of prompts a writer process stores, the relay polled
    once per `step_s`."""
    relay = _relay(socket, 0.0)
    relay.poll()
    first = counter[0] + 1
    counter[0] += count
    ctx = multiprocessing.get_context("spawn")
    times = ctx.Queue()
    proc = ctx.Process(target=_writer, args=(socket, first, count, 0.02, times))
    proc.start()
    seen: dict[int, float] = {}
    deadline = time.monotonic() + 120
    while len(seen) < count and time.monotonic() < deadline:
        events = relay.poll()
        now = time.monotonic()
        for event in events:
            if event.kind == "stored" and event.parent_block_hash is None:
                i = event.token_ids[0] - 100_000
                if first <= i < first + count:
                    seen.setdefault(i, now)
        time.sleep(step_s)
    stored = dict(times.get(timeout=60))
    proc.join(timeout=30)
    relay.close()
    lags = [seen[i] - stored[i] for i in stored if i in seen]
    result = _quantiles_us(lags)
    result.update(step_s=step_s, prompts=count, announced=len(lags))
    return result


def attach_cost(socket: str, step_s: float) -> dict[str, float]:
    """A relay attaching to the daemon as it is (every chunk stored so far): the steps
    its snapshot takes (at most max_events = 1024 chunk events a step) and their cost."""
    relay = _relay(socket, 0.0, snapshot=True)
    take, _ = _take_events_fn(relay)
    samples, announced = [], 0
    while True:
        started = time.perf_counter()
        announced += len(take())
        samples.append(time.perf_counter() - started)
        if relay.stats["polls"] and not relay.snapshot_left:
            break
        time.sleep(step_s)
    result = _quantiles_us(samples)
    result.update(steps=len(samples), max_us=round(max(samples) * 1e6, 1),
                  chunks_announced=relay.stats["snapshot"], block_events=announced)
    relay.close()
    return result


ATTACH_LAYOUT = KVLayout("bench-attach", num_layers=1, num_kv_heads=1, head_size=8,
                         dtype="bfloat16", chunk_size=256)
ATTACH_PROMPT_CHUNKS = 16


def _attach_prompt(i: int) -> torch.Tensor:
    tokens = torch.arange(ATTACH_PROMPT_CHUNKS * 256, dtype=torch.int64) % 30_000 + 1
    tokens[0] = 1_000_000 + i  # a new chain per prompt
    return tokens


def _attach_writer(socket: str, first: int, period_s: float, ready, stop, times) -> None:
    """Connect, set `ready`, then store a new prompt from `first` on every `period_s`
    until `stop` is set; report (prompts stored, started, ended) (monotonic times)."""
    engine = CacheEngine.connect(ATTACH_LAYOUT, socket=socket, strict=True)
    kv = torch.zeros(ATTACH_LAYOUT.chunk_shape(ATTACH_PROMPT_CHUNKS * 256), dtype=torch.bfloat16)
    ready.set()
    started = time.monotonic()
    i = first
    while not stop.is_set():
        engine.store(_attach_prompt(i), kv)
        i += 1
        time.sleep(period_s)
    times.put((i - first, started, time.monotonic()))
    engine.close()


def attach_under_stores(num_chunks: int, step_s: float = 0.01,
                        max_events: int = 1024) -> dict:
    """A relay attaching to a daemon holding `num_chunks` chunks while another process
    stores more, one prompt every 20 ms (module docstring, --attach-chunks); the arena
    holds them all (nothing evicted: complete means every chunk)."""
    prompts = -(-num_chunks // ATTACH_PROMPT_CHUNKS)
    concurrent = max(64, prompts // 2)  # room for the writer's prompts
    # Stores wait for the daemon as long as it takes (a loaded machine): a store that
    # timed out would be skipped, and the cache smaller than asked.
    os.environ.setdefault("LMCACHED_DATA_TIMEOUT_MS", "60000")
    block = int(record_block_size(ATTACH_LAYOUT))
    total_chunks = (prompts + concurrent) * ATTACH_PROMPT_CHUNKS
    capacity = str((total_chunks + total_chunks // 20 + 64) * block)
    with running_daemon(capacity, str(block), name=f"bench-attach-{os.getpid()}") as socket:
        engine = CacheEngine.connect(ATTACH_LAYOUT, socket=socket, strict=True)
        kv = torch.zeros(ATTACH_LAYOUT.chunk_shape(ATTACH_PROMPT_CHUNKS * 256),
                         dtype=torch.bfloat16)
        started = time.monotonic()
        for i in range(prompts):
            engine.store(_attach_prompt(i), kv)
        preload_s = time.monotonic() - started
        engine.close()
        ctx = multiprocessing.get_context("spawn")
        ready, stop, times = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_attach_writer,
                           args=(socket, prompts, 0.02, ready, stop, times))
        proc.start()
        relay = EventRelay(ATTACH_LAYOUT.to_wire(), BLOCK_SIZE, _hasher(), socket=socket,
                           max_events=max_events, timeout_s=10.0)
        assert ready.wait(120), "the writer process did not connect"
        with Connection(socket) as conn:
            at_attach = {k: v for s in conn.request(Info()).sections.values()
                         for k, v in s.items()}["cached_values"]
        polls, batches, block_batches = [], [], []
        attach_started = time.monotonic()
        snapshot_s = None
        writer_done = None
        quiet = 0
        while quiet < 3:
            before = relay.stats["chunk_events"]
            t0 = time.perf_counter()
            out = relay.poll()
            polls.append(time.perf_counter() - t0)
            batches.append(relay.stats["chunk_events"] - before)
            block_batches.append(len(out))
            if snapshot_s is None and relay.stats["polls"] and not relay.snapshot_left:
                snapshot_s = time.monotonic() - attach_started
                stop.set()
            if writer_done is None and not times.empty():
                writer_done = times.get()
            busy = writer_done is None or relay.snapshot_left or batches[-1]
            quiet = 0 if busy else quiet + 1
            time.sleep(step_s)
        complete_s = time.monotonic() - attach_started - (quiet - 1) * step_s
        proc.join(timeout=60)
        with Connection(socket) as conn:
            info = {k: v for s in conn.request(Info()).sections.values() for k, v in s.items()}
        relay.close()
    chunk_events = relay.stats["chunk_events"]
    return {
        "chunks_preloaded": prompts * ATTACH_PROMPT_CHUNKS,
        "chunks_cached_at_attach": at_attach,
        "chunks_stored_by_the_writer": writer_done[0] * ATTACH_PROMPT_CHUNKS,
        "preload_s": round(preload_s, 2),
        "writer_s": round(writer_done[2] - writer_done[1], 2),
        "step_s": step_s, "max_events": max_events,
        "snapshot_done_s": round(snapshot_s, 2) if snapshot_s is not None else None,
        "all_announced_s": round(complete_s, 2),
        "chunk_events_per_s": round(chunk_events / complete_s),
        "polls": len(polls),
        "peak_chunk_events_per_poll": max(batches),
        "peak_block_events_per_poll": max(block_batches),
        "poll_wall_ms": {"median": round(statistics.median(polls) * 1e3, 2),
                         "p99": round(float(np.percentile(polls, 99)) * 1e3, 2),
                         "max": round(max(polls) * 1e3, 2)},
        "block_events": sum(block_batches),
        "announced_chunks": relay.num_announced_chunks,
        "cached_values": info["cached_values"],
        "complete": relay.num_announced_chunks == info["cached_values"],
        "relay_stats": dict(relay.stats),
        "events_lost_daemon": info.get("events_lost"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and prompts")
    parser.add_argument("--out", help="directory for results.json")
    parser.add_argument("--attach-chunks", type=int, default=0, metavar="N",
                        help="only the attach figure: N chunks cached, N/10 stored "
                             "while a relay attaches")
    args = parser.parse_args()
    if args.attach_chunks:
        results = {
            "machine": machine_info(),
            "command": "python -m benchmarks.engine.bench_event_relay --attach-chunks "
                       f"{args.attach_chunks}",
            "take_events": "relay.poll() with " + _hasher_name(),
            "attach_under_stores": attach_under_stores(args.attach_chunks),
        }
        write_results(results, args.out)
        return
    calls, steps, prompts = (200, 20, 50) if args.quick else (2000, 100, 300)
    counter = [0]
    with running_daemon("512MiB", record_block_size(LAYOUT)) as socket:
        relay = _relay(socket, 0.0)
        _, take_name = _take_events_fn(relay)
        results = {
            "machine": machine_info(),
            "command": "python -m benchmarks.engine.bench_event_relay"
                       + (" --quick" if args.quick else ""),
            "take_events": take_name,
            "chunk_size": LAYOUT.chunk_size,
            "block_size": BLOCK_SIZE,
            "step_idle_default_interval": idle_step_cost(socket, 0.01, calls, 0.002),
            "step_idle_round_trip_every_call": idle_step_cost(socket, 0.0, calls, 0.002),
            "step_16_chunks": busy_step_cost(socket, 1, steps, counter),
            "step_64_chunks": busy_step_cost(socket, 4, steps, counter),
            "lag_step_10ms": lag(socket, 0.01, prompts, counter),
            "lag_step_0": lag(socket, 0.0, prompts, counter),
            "attach_snapshot": attach_cost(socket, 0.002),
        }
    write_results(results, args.out)


if __name__ == "__main__":
    main()
