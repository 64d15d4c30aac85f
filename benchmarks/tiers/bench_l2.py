"""The L2 tier on Redis: fetch GB/s, TTFT from L2 / the arena / recomputed, value size,
and what write-through costs a store. Ratios are to baselines measured in the same run.

Everything runs on this node: a private redis-server on loopback (benchmarks/peers/
redis_peer.py starts it, persistence off, and stops it by pid), daemons started by
`lmcached.launcher` with `--l2`. docs/l2.md explains the figures.

    fetch     node A stores a prompt (write-through) and its writes drain; node B (its own
              empty arena, same Redis) looks the prompt up with a long --l2-fetch-wait:
              the time of that one LOOKUP is the fetch (EXISTS, GETs in batches,
              verification, install into the arena). Baseline: one client's pipelined
              GETs of the same values from the same Redis, copied into a touched buffer.
    value     the same at several chunk sizes (one value per chunk: 512 KiB to 32 MiB)
    store     CacheEngine.store (cold, new tokens each time) on a daemon with --l2
              (write-through) against one without, used in turn; and how long the L2
              writes take to drain after the store returned
    TTFT      the demo's Llama (examples/demo.py "demo" size, random weights, cpu):
              greedy first token with the prompt's KV from node A's arena, from L2 into
              node B's empty arena, and recomputed (no cache)

    python -m benchmarks.tiers.bench_l2 [--quick] [--out benchmarks/results/DATE-l2]
"""

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
import torch


from benchmarks import RESULTS
from benchmarks.common import GB, machine_info, median, record_block_size
from benchmarks.peers.redis_peer import running_redis
from lmcached.client import CacheEngine, KVLayout
from lmcached.client.hashing import hash_request_tokens
from lmcached.daemon.l2.values import l2_key
from lmcached.daemon.spill.envelope import namespace_fingerprint
from lmcached.launcher import temporary_daemon
from lmcached.wire.connection import Connection
from lmcached.wire.protocol import Info

MiB = 1 << 20
CLIENT_TIMEOUT_S = 120.0  # the benchmark waits for whole fetches (serving uses 200 ms)


def llama_1b(chunk_size: int) -> KVLayout:
    """Llama-3.2-1B KV (16 layers x 8 KV heads x 64, bf16: 32 KiB per token)."""
    return KVLayout("llama-3.2-1b", num_layers=16, num_kv_heads=8, head_size=64,
                    dtype="bfloat16", chunk_size=chunk_size)


def l2_info(socket: str) -> dict:
    with Connection(socket, timeout_s=30) as conn:
        return conn.request(Info("l2")).sections["l2"]


def check_cached_runs(length: int, full, results) -> None:
    """Raise unless every `generate_with_cache` result reused all but the last of the
    `length` prompt tokens and gave the full prefill's first token."""
    for result in results:
        if result.num_cached_tokens != length - 1 or int(result.output_ids[0]) != \
                int(full.output_ids[0]):
            raise RuntimeError(f"{length}: cached {result.num_cached_tokens}, or another "
                               "first token than the full prefill")


def wait_drained(socket: str, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = l2_info(socket)
        if info["l2_queue_values"] == 0:
            return info
        time.sleep(0.01)
    raise RuntimeError("L2 writes did not drain")


# Arenas are 6x the prompt: write-through pins at most a quarter of the arena while its
# chunks wait for Redis (lmcached/daemon/l2/tier.py, PINNED_SHARE), and a prompt must fit whole.
def daemon_args(layout: KVLayout, url: str | None, capacity: str, fetch_wait: str = "60") -> list[str]:
    args = ["--capacity", capacity, "--block-size", record_block_size(layout),
            "--log-level", "WARNING"]
    # The queue holds a whole prompt: a 16k-token prompt's KV is larger than the default.
    return args + (["--l2", url, "--l2-fetch-wait", fetch_wait, "--l2-queue", "4GiB"]
                   if url else [])


def connect(layout: KVLayout, socket: str) -> CacheEngine:
    return CacheEngine.connect(layout, socket=socket, strict=True, timeout_s=CLIENT_TIMEOUT_S,
                               data_timeout_s=CLIENT_TIMEOUT_S)


def raw_get(client, keys: list[bytes], dest: np.ndarray, batch_bytes: int) -> int:
    """Pipelined GETs of `keys` in batches of about `batch_bytes`, each value copied into
    `dest` (touched); returns the bytes read. The baseline of a fetch."""
    offset, pos = 0, 0
    value_bytes = None
    while pos < len(keys):
        per_batch = 1 if value_bytes is None else max(1, batch_bytes // value_bytes)
        pipe = client.pipeline(transaction=False)
        for key in keys[pos : pos + per_batch]:
            pipe.get(key)
        for value in pipe.execute():
            n = len(value)
            value_bytes = n
            dest[offset : offset + n] = np.frombuffer(value, np.uint8)
            offset += n
        pos += per_batch
    return offset


def bench_fetch(url: str, client, chunk_size: int, num_tokens: int, repeat: int) -> dict:
    """Fetch GB/s through a daemon against raw pipelined GETs, at one chunk size."""
    from lmcached.daemon.l2.fetch import FETCH_BATCH_BYTES

    layout = llama_1b(chunk_size)
    fp = namespace_fingerprint(layout.to_wire())
    capacity = f"{max(256, 6 * num_tokens * layout.token_bytes // MiB)}MiB"
    fetch_s, raw_s, nbytes = [], [], 0
    with temporary_daemon(*daemon_args(layout, url, capacity), name=f"l2a-{os.getpid()}") as a:
        engine_a = connect(layout, a)
        for rep in range(repeat + 1):  # the first round warms up
            tokens = torch.arange(rep * 10**6, rep * 10**6 + num_tokens)
            engine_a.store(tokens, torch.randn(layout.chunk_shape(num_tokens)).to(torch.bfloat16))
            wait_drained(a)
            keys = [l2_key(fp, h) for h in hash_request_tokens(chunk_size, tokens)]
            with temporary_daemon(*daemon_args(layout, url, capacity),
                                  name=f"l2b-{os.getpid()}-{rep}") as b:
                with connect(layout, b) as engine_b:
                    started = time.perf_counter()
                    hit = engine_b.lookup(tokens)
                    elapsed = time.perf_counter() - started
                    info = l2_info(b)
            if hit != num_tokens:
                raise RuntimeError(f"node B found {hit} of {num_tokens} tokens in L2: {info}")
            nbytes = info["l2_fetch_bytes"]
            dest = np.empty(nbytes + len(keys) * 64, np.uint8)
            dest.fill(1)
            started = time.perf_counter()
            raw_get(client, keys, dest, FETCH_BATCH_BYTES)
            raw = time.perf_counter() - started
            if rep:
                fetch_s.append(elapsed)
                raw_s.append(raw)
        engine_a.close()
    value_bytes = nbytes // len(keys)
    return {"chunk_tokens": chunk_size, "value_bytes": value_bytes, "num_tokens": num_tokens,
            "bytes": nbytes, "fetch_s": fetch_s, "raw_get_s": raw_s,
            "fetch_gbps": nbytes / median(fetch_s) / GB, "raw_get_gbps": nbytes / median(raw_s) / GB,
            "ratio": median(raw_s) / median(fetch_s)}


def bench_store(url: str, num_tokens: int, repeat: int) -> dict:
    """Cold store with write-through on and off, in turn; and the drain time of L2 writes."""
    layout = llama_1b(256)
    nbytes = num_tokens * layout.token_bytes
    capacity = f"{max(512, 6 * nbytes // MiB)}MiB"
    on_s, off_s, drain_s = [], [], []
    kv = torch.randn(layout.chunk_shape(num_tokens)).to(torch.bfloat16)
    with temporary_daemon(*daemon_args(layout, url, capacity), name=f"l2on-{os.getpid()}") as on, \
            temporary_daemon(*daemon_args(layout, None, capacity), name=f"l2off-{os.getpid()}") as off:
        with connect(layout, on) as engine_on, connect(layout, off) as engine_off:
            for rep in range(repeat + 1):
                tokens = torch.arange(rep * 10**6, rep * 10**6 + num_tokens)
                order = [(engine_off, off_s), (engine_on, on_s)]
                for engine, samples in order if rep % 2 else order[::-1]:
                    started = time.perf_counter()
                    engine.store(tokens, kv)
                    elapsed = time.perf_counter() - started
                    if engine is engine_on:
                        wait_drained(on)
                        drain = time.perf_counter() - started
                        if rep:
                            drain_s.append(drain)
                    if rep:
                        samples.append(elapsed)
            info = l2_info(on)
    return {"num_tokens": num_tokens, "bytes": nbytes, "store_l2_s": on_s, "store_no_l2_s": off_s,
            "store_l2_gbps": nbytes / median(on_s) / GB, "store_no_l2_gbps": nbytes / median(off_s) / GB,
            "ratio_on_off": median(off_s) / median(on_s),
            "drain_s": drain_s, "l2_write_gbps": nbytes / median(drain_s) / GB,
            "write_drops": info["l2_write_drops_queue_full"] + info["l2_write_drops_down"]}


def bench_fetch_wait(url: str, num_tokens: int, waits: list[float]) -> list[dict]:
    """What a client sees of a fetch in flight: node B's first LOOKUP of a prompt in L2
    at each --l2-fetch-wait (hits, latency), and a second LOOKUP 2 s later."""
    layout = llama_1b(256)
    capacity = f"{max(256, 6 * num_tokens * layout.token_bytes // MiB)}MiB"
    tokens = torch.arange(7 * 10**6, 7 * 10**6 + num_tokens)
    with temporary_daemon(*daemon_args(layout, url, capacity), name=f"l2w-{os.getpid()}") as a:
        with connect(layout, a) as engine_a:
            engine_a.store(tokens, torch.randn(layout.chunk_shape(num_tokens)).to(torch.bfloat16))
            wait_drained(a)
    rows = []
    for wait in waits:
        with temporary_daemon(*daemon_args(layout, url, capacity, str(wait)),
                              name=f"l2wb-{os.getpid()}") as b, connect(layout, b) as engine_b:
            started = time.perf_counter()
            first = engine_b.lookup(tokens)
            first_s = time.perf_counter() - started
            time.sleep(2.0)
            second = engine_b.lookup(tokens)
        rows.append({"fetch_wait_s": wait, "num_tokens": num_tokens, "first_hit_tokens": first,
                     "first_lookup_s": first_s, "second_hit_tokens": second})
        print(f"  fetch wait {wait:g} s: first lookup {first} tokens in {first_s * 1e3:.0f} ms, "
              f"2 s later {second}", flush=True)
    return rows


def bench_ttft(url: str, lengths: list[int], repeat: int) -> list[dict]:
    """TTFT of the demo model with the prompt's KV from the arena, from L2, recomputed."""
    from lmcached.client.hf import generate_with_cache, layout_for_model
    from lmcached.examples.demo import SIZES, build_model

    size = SIZES["demo"]
    model = build_model(size, max_positions=max(lengths) + 16)
    layout = layout_for_model(model, chunk_size=size.chunk_size)
    rows = []
    for length in lengths:
        nbytes = length * layout.token_bytes
        capacity = f"{max(256, 6 * nbytes // MiB)}MiB"
        reps = repeat if length <= 4096 else 1
        arena_s, l2_s, full_s = [], [], []
        with temporary_daemon(*daemon_args(layout, url, capacity),
                              name=f"l2t-{os.getpid()}") as a, torch.inference_mode():
            with connect(layout, a) as engine_a:
                for rep in range(reps):
                    ids = torch.randint(0, size.vocab_size, (length,),
                                        generator=torch.Generator().manual_seed(length + rep))
                    full = generate_with_cache(model, None, ids, max_new_tokens=1)
                    generate_with_cache(model, engine_a, ids, max_new_tokens=1)  # stores
                    wait_drained(a)
                    arena = generate_with_cache(model, engine_a, ids, max_new_tokens=1, store=False)
                    with temporary_daemon(*daemon_args(layout, url, capacity),
                                          name=f"l2tb-{os.getpid()}-{rep}") as b:
                        with connect(layout, b) as engine_b:
                            from_l2 = generate_with_cache(model, engine_b, ids, max_new_tokens=1,
                                                          store=False)
                    check_cached_runs(length, full, (arena, from_l2))
                    full_s.append(full.ttft_s)
                    arena_s.append(arena.ttft_s)
                    l2_s.append(from_l2.ttft_s)
        rows.append({"num_tokens": length, "kv_bytes": nbytes, "runs": reps,
                     "ttft_recompute_s": full_s, "ttft_arena_s": arena_s, "ttft_l2_s": l2_s,
                     "speedup_arena": median(full_s) / median(arena_s),
                     "speedup_l2": median(full_s) / median(l2_s)})
        print(f"  TTFT {length}: recompute {median(full_s) * 1e3:.0f} ms, arena "
              f"{median(arena_s) * 1e3:.1f} ms, L2 {median(l2_s) * 1e3:.1f} ms", flush=True)
    return rows


def render(results: dict) -> str:
    """The markdown report of `results`."""
    m = results["machine"]
    lines = [f"# L2 tier on Redis ({results['date']})", "",
             f"Command: `{results['command']}`; {results['wall_s']:.0f} s in all. Machine: "
             f"{m['cpu']}, {m['num_cpus']} CPUs, torch {m['torch']}, load average at start "
             f"{m['loadavg_at_start'][0]:.2f}. Redis {results['redis_version']} on loopback "
             "(one redis-server, persistence off).", "",
             "## Fetch from L2 into an empty arena, by chunk (value) size",
             f"{results['fetch'][0]['num_tokens']} tokens of Llama-3.2-1B KV (32 KiB per token) per "
             "prompt. fetch: node B's LOOKUP that fetches the whole prompt (EXISTS, GET "
             "batches, verification, install); raw GET: one client's pipelined GETs of the "
             "same values into a touched buffer, in the same run. Medians.", "",
             "| chunk tokens | value | fetch GB/s | raw GET GB/s | fetch / raw GET |",
             "|---|---|---|---|---|"]
    for row in results["fetch"]:
        lines.append(f"| {row['chunk_tokens']} | {row['value_bytes'] / MiB:.1f} MiB | "
                     f"{row['fetch_gbps']:.2f} | {row['raw_get_gbps']:.2f} | {row['ratio']:.2f}x |")
    s = results["store"]
    lines += ["", "## What write-through costs a store",
              f"Cold `CacheEngine.store` of {s['num_tokens']} tokens ({s['bytes'] / MiB:.0f} MiB), "
              "daemons with and without --l2 used in turn. Drain: from the store's start until "
              "the L2 queue is empty.", "",
              "| store, no L2 | store, write-through | with / without | L2 drain | L2 write GB/s | drops |",
              "|---|---|---|---|---|---|",
              f"| {s['store_no_l2_gbps']:.2f} GB/s | {s['store_l2_gbps']:.2f} GB/s | "
              f"{s['ratio_on_off']:.2f}x | {median(s['drain_s']) * 1e3:.0f} ms | "
              f"{s['l2_write_gbps']:.2f} | {s['write_drops']} |"]
    lines += ["", "## A fetch in flight, as a client sees it",
              f"Node B (empty arena) looks up a {results['fetch_wait'][0]['num_tokens']}-token "
              "prompt that is in L2 (Llama-3.2-1B KV, 256-token chunks), at each "
              "--l2-fetch-wait; then again 2 s later.", "",
              "| --l2-fetch-wait | first lookup: hit tokens | its latency | 2 s later: hit tokens |",
              "|---|---|---|---|"]
    for row in results["fetch_wait"]:
        lines.append(f"| {row['fetch_wait_s']:g} s | {row['first_hit_tokens']} | "
                     f"{row['first_lookup_s'] * 1e3:.0f} ms | {row['second_hit_tokens']} |")
    lines += ["", "## TTFT of the demo model (random weights, cpu)",
              "Greedy first token; the prompt's KV from node A's arena, from L2 into node B's "
              "empty arena (fetch included), or recomputed. Median of the runs.", "",
              "| tokens | KV | runs | recompute ms | arena ms | L2 ms | speed-up arena | speed-up L2 |",
              "|---|---|---|---|---|---|---|---|"]
    for row in results["ttft"]:
        lines.append(f"| {row['num_tokens']} | {row['kv_bytes'] / MiB:.0f} MiB | {row['runs']} | "
                     f"{median(row['ttft_recompute_s']) * 1e3:.0f} | "
                     f"{median(row['ttft_arena_s']) * 1e3:.1f} | {median(row['ttft_l2_s']) * 1e3:.1f} | "
                     f"{row['speedup_arena']:.1f}x | {row['speedup_l2']:.1f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 repeat (minutes)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=None, help="results path without extension")
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    started = time.perf_counter()
    results = {"date": datetime.date.today().isoformat(), "machine": machine_info(),
               "command": ("python -m benchmarks.tiers.bench_l2"
                           + (" --quick" if args.quick else ""))}
    with running_redis() as client:
        port = client.connection_pool.connection_kwargs["port"]
        url = f"redis://127.0.0.1:{port}"
        results["redis_version"] = client.info("server")["redis_version"]
        client.config_set("maxmemory", "8gb")
        client.config_set("maxmemory-policy", "allkeys-lru")
        fetch_tokens = 1024 if args.quick else 4096
        results["fetch"] = []
        for chunk in (16, 64, 256, 1024):
            row = bench_fetch(url, client, chunk, fetch_tokens, repeat)
            print(f"  fetch chunk {chunk}: {row['fetch_gbps']:.2f} GB/s, raw GET "
                  f"{row['raw_get_gbps']:.2f} GB/s ({row['ratio']:.2f}x)", flush=True)
            results["fetch"].append(row)
            client.flushall()
        results["store"] = bench_store(url, fetch_tokens, repeat)
        print(f"  store: {results['store']['ratio_on_off']:.2f}x with write-through", flush=True)
        client.flushall()
        results["fetch_wait"] = bench_fetch_wait(url, fetch_tokens, [0, 0.02, 0.1, 1.0])
        client.flushall()
        lengths = [1024, 4096] if args.quick else [1024, 4096, 16384]
        results["ttft"] = bench_ttft(url, lengths, repeat)
    results["wall_s"] = time.perf_counter() - started
    out = args.out or os.path.join(RESULTS,
                                   f"{results['date']}-l2{'-quick' if args.quick else ''}")
    with open(out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(render(results))
    print(render(results))
    print(f"wrote {out}.json and {out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
