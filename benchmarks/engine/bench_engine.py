"""CacheEngine throughput on Llama-3-8B-shaped KV, as ratios to memcpy in the same run.

KV: 32 layers, 8 KV heads, head_size 128, bfloat16 = 128 KiB per token, chunk 256
(one chunk = 32 MiB). For each prompt length, median of --repeat runs of:

    memcpy          np.copyto of the same bytes between touched buffers (the ceiling;
                    glibc copies more than x86_non_temporal_threshold, 192 MiB here,
                    with non-temporal stores: ~15 GB/s against ~10 for 32 MiB copies)
    memcpy chunked  the same bytes copied chunk by chunk on 2 threads (ChunkCopier),
                    the engine's own copy strategy without the daemon
    alloc+fill      a fresh numpy buffer filled with the same bytes (bound for a
                    retrieve that allocates its result)
    store cold      engine.store after CLEAR (the daemon has none of the chunks)
    store existing  engine.store of a stored prompt (one ALLOC round trip, no copies)
    lookup          engine.lookup
    retrieve out=   engine.retrieve into a touched destination
    retrieve alloc  engine.retrieve allocating its result
    views           engine.retrieve_views, open and close (pins, checks every header)
    views+copy      views copied into a touched destination (RetrievedViews.copy_to)
    verify          the header and token-id checks alone (part of every retrieve)
    cross-process   a separate process stored the prompt; this one retrieves (out=)
    ... +ck         store cold, retrieve out= and views by a second engine with
                    verify="checksum" (writes an xxh3-64 payload checksum into every
                    record before COMMIT, recomputes it before serving), printed as
                    ratios to the same op without checksums in this run

    python -m benchmarks.engine.bench_engine [--tokens 4096 16384] [--repeat 5] [--quick]

With --metrics-cost it measures instead what Prometheus metrics cost (docs/metrics.md):
two daemons, one with --metrics-port and a scrape of it every second, one without,
used in turn in each round, half of the rounds in reverse order (store cold, retrieve
out=, and a one-chunk lookup round trip), printed as on/off ratios; and the cost of one latency observation in the loop
(`RequestLatency.observe`) against prometheus_client's `Histogram.observe`.

    python -m benchmarks.engine.bench_engine --metrics-cost [--quick] [--repeat 10]
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import socket as socketlib
import subprocess
import sys
import textwrap
import threading
import time
import timeit
import typing
import urllib.request
from typing import Callable

import numpy as np
import torch

from benchmarks.common import GB, LLAMA_8B, median, p90, record_block_size, running_daemon, time_it
from lmcached.client import CacheEngine, KVLayout
from lmcached.client.hashing import as_token_array, hash_request_tokens
from lmcached.client.kv_io import ChunkCopier, copy_tensor, new_kv_buffer
from lmcached.client.records import RecordIO
from lmcached.launcher import temporary_daemon
from lmcached.daemon.stats import RequestLatency
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Clear, Lookup

LAYOUT = LLAMA_8B
CROSS_PROCESS_STORE = """
import json, sys, torch
from lmcached.client import CacheEngine, KVLayout
layout = KVLayout(**json.loads(sys.argv[4]))
num_tokens, offset = int(sys.argv[2]), int(sys.argv[3])
kv = torch.full(layout.chunk_shape(num_tokens), 0.5, dtype=layout.torch_dtype)
with CacheEngine.connect(layout, socket=sys.argv[1], strict=True) as engine:
    print(engine.store(torch.arange(offset, offset + num_tokens), kv))
"""


def filled_blob(num_tokens: int, value: float, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """A touched KV blob `layout.chunk_shape(num_tokens)` of layout.dtype, filled with `value`."""
    blob = new_kv_buffer(layout.chunk_shape(num_tokens), layout.torch_dtype)
    blob.fill_(value)
    return blob


def chunked_copy(copier: ChunkCopier, dst: torch.Tensor, src: torch.Tensor, layout: KVLayout) -> None:
    """dst = src, one task per chunk of layout.chunk_size tokens, on `copier`'s threads."""
    num_tokens, dim = src.shape[layout.token_dim], layout.token_dim
    copier.run([
        functools.partial(copy_tensor, dst.narrow(dim, start, min(layout.chunk_size, num_tokens - start)),
                          src.narrow(dim, start, min(layout.chunk_size, num_tokens - start)))
        for start in range(0, num_tokens, layout.chunk_size)
    ])


def time_in_turn(fns: dict[str, Callable[[], object]], repeat: int,
                 setup: Callable[[], object] | None = None, warmup: int = 1) -> dict:
    """Seconds per call of each of `fns`, all called in turn in each of `repeat` rounds.

    Returns:
        {name: [seconds per run]}, `setup` (before every call) untimed.
    """
    samples = {name: [] for name in fns}
    for i in range(warmup + repeat):
        for name, fn in fns.items():
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            if i >= warmup:
                samples[name].append(time.perf_counter() - start)
    return samples


def with_checked(fns: dict[str, Callable[[], object]], checked: CacheEngine | None) -> dict:
    """`fns` without the "+ck" ops when there is no checksum engine."""
    return fns if checked is not None else {k: f for k, f in fns.items() if not k.endswith("+ck")}


def bench_length(engine: CacheEngine, admin: Connection, socket: str, num_tokens: int,
                 repeat: int, src: torch.Tensor | None = None,
                 dst: torch.Tensor | None = None, checked: CacheEngine | None = None) -> dict:
    """Time every op of the module docstring for one prompt length.

    Args:
        engine: a CacheEngine connected to the daemon on `socket` (its layout is used).
        admin: a session for CLEAR.
        num_tokens: prompt length.
        repeat: timed runs per op (after one warm-up run).
        src / dst: touched blobs `layout.chunk_shape(num_tokens)` to reuse (allocated if
            None): src is the KV stored, dst is overwritten.
        checked: optional engine of the same layout with verify="checksum": adds the
            "+ck" ops.

    Returns:
        {"nbytes": KV bytes of the prompt, "samples": {op: [seconds per run]}}
    """
    layout = engine.layout
    nbytes = num_tokens * layout.token_bytes
    tokens = torch.arange(num_tokens) + 1_000_000 * num_tokens
    src = filled_blob(num_tokens, 1.25, layout) if src is None else src
    dst = filled_blob(num_tokens, 0.0, layout) if dst is None else dst
    alias = layout.numpy_alias()[0]
    src_np, dst_np = src.view(alias).numpy(), dst.view(alias).numpy()
    results = {}

    results["memcpy"] = time_it(lambda: np.copyto(dst_np, src_np), repeat)
    results["memcpy chunked"] = time_it(
        lambda: chunked_copy(engine.copier, dst, src, layout), repeat)
    results["alloc+fill"] = time_it(lambda: np.copyto(np.empty_like(src_np), src_np), repeat)
    # An op and its "+ck" twin run in turn in each round, so that the load of this shared
    # machine changes both alike; the +ck store runs last: the records carry checksums.
    results.update(time_in_turn(with_checked({
        "store cold": lambda: engine.store(tokens, src),
        "store cold +ck": lambda: checked.store(tokens, src),
    }, checked), repeat, setup=lambda: admin.request(Clear())))
    results["store existing"] = time_it(lambda: engine.store(tokens, src), repeat)
    results["lookup"] = time_it(lambda: engine.lookup(tokens), repeat)
    results.update(time_in_turn(with_checked({
        "retrieve out=": lambda: engine.retrieve(tokens, return_tuple=False, out=dst),
        "retrieve out= +ck": lambda: checked.retrieve(tokens, return_tuple=False, out=dst),
    }, checked), repeat))
    if checked is not None:
        got, ret_mask = checked.retrieve(tokens, return_tuple=False, out=dst)
        assert bool(ret_mask.all()) and torch.equal(got, src), "checksummed retrieve differs"
    got, ret_mask = engine.retrieve(tokens, return_tuple=False)
    assert bool(ret_mask.all()) and torch.equal(got, src), "retrieved bytes differ"
    del got
    results["retrieve alloc"] = time_it(lambda: engine.retrieve(tokens, return_tuple=False), repeat)

    def open_close_views(eng: CacheEngine) -> None:
        with eng.retrieve_views(tokens) as views:
            assert views.num_tokens == num_tokens

    results.update(time_in_turn(with_checked({
        "views": lambda: open_close_views(engine),
        "views +ck": lambda: open_close_views(checked),
    }, checked), repeat))
    assert checked is None or checked.num_checksum_failures == 0, "a record failed its checksum"

    def views_and_copy():
        with engine.retrieve_views(tokens) as views:
            views.copy_to(dst)

    results["views+copy"] = time_it(views_and_copy, repeat)

    token_array = as_token_array(tokens)
    chunk = layout.chunk_size
    hashes = hash_request_tokens(chunk, token_array)
    with engine.retrieve_views(tokens) as views:
        records = RecordIO(engine.link.arena, layout)  # the arena the views pin
        fingerprint = layout.fingerprint

        def verify_all():
            for i, (block_id, h) in enumerate(zip(views.block_ids, hashes)):
                chunk_tokens = token_array[i * chunk : (i + 1) * chunk]
                assert records.verify([block_id], h, chunk_tokens, fingerprint)

        results["verify"] = time_it(verify_all, repeat)

    offset = 7_000_000 + num_tokens
    stored = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CROSS_PROCESS_STORE), socket,
         str(num_tokens), str(offset), json.dumps(dataclasses.asdict(layout))],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert int(stored) == -(-num_tokens // chunk), f"cross-process store wrote {stored} chunks"
    other_tokens = torch.arange(offset, offset + num_tokens)
    results["cross-process"] = time_it(
        lambda: engine.retrieve(other_tokens, return_tuple=False, out=dst), repeat)
    assert bool((dst == 0.5).all()), "cross-process bytes differ"
    return {"nbytes": nbytes, "samples": results}


def report(num_tokens: int, data: dict) -> list[tuple[str, bool, str]]:
    nbytes, res = data["nbytes"], data["samples"]
    copy_s = median(res["memcpy"])
    alloc_s = median(res["alloc+fill"])
    print(f"\n{num_tokens} tokens ({nbytes / 2**30:.2f} GiB of KV)")
    print(f"{'op':>16} {'median ms':>10} {'p90 ms':>9} {'GB/s':>7} {'vs memcpy':>10}")
    moves_bytes = {"memcpy", "memcpy chunked", "alloc+fill", "store cold", "retrieve out=",
                   "retrieve alloc", "views+copy", "cross-process", "store cold +ck",
                   "retrieve out= +ck"}
    for op, samples in res.items():
        med = median(samples)
        gbps = f"{nbytes / med / GB:7.2f}" if op in moves_bytes else f"{'-':>7}"
        print(f"{op:>16} {med * 1e3:10.3f} {p90(samples) * 1e3:9.3f} {gbps} {copy_s / med:9.2f}x")
    ratio = lambda op, base: base / median(res[op])  # noqa: E731
    checksum_rows = []
    if "store cold +ck" in res:
        print("payload checksum (verify='checksum'), throughput with / without:")
        for op in ("store cold", "retrieve out="):
            with_ck = ratio(f"{op} +ck", median(res[op]))
            print(f"{op:>16} {with_ck:9.2f}x  ({nbytes / median(res[op + ' +ck']) / GB:.2f} "
                  f"against {nbytes / median(res[op]) / GB:.2f} GB/s)")
            checksum_rows.append((f"{op} with checksum / without @{num_tokens}", True,
                                  f"{with_ck:.2f}x"))
        views_ms = median(res["views +ck"]) * 1e3
        print(f"{'views':>16} {views_ms:9.3f} ms with, {median(res['views']) * 1e3:.3f} ms without"
              f" ({nbytes / median(res['views +ck']) / GB:.2f} GB/s checked)")
        checksum_rows.append((f"views open+close with checksum @{num_tokens}", True,
                              f"{views_ms:.3f} ms"))
    return [
        (f"store cold >= 0.7x memcpy @{num_tokens}", ratio("store cold", copy_s) >= 0.7,
         f"{ratio('store cold', copy_s):.2f}x"),
        (f"retrieve out= >= 0.7x memcpy @{num_tokens}", ratio("retrieve out=", copy_s) >= 0.7,
         f"{ratio('retrieve out=', copy_s):.2f}x"),
        (f"views+copy >= 0.7x memcpy @{num_tokens}", ratio("views+copy", copy_s) >= 0.7,
         f"{ratio('views+copy', copy_s):.2f}x"),
        (f"retrieve alloc >= 0.7x alloc+fill @{num_tokens}",
         ratio("retrieve alloc", alloc_s) >= 0.7, f"{ratio('retrieve alloc', alloc_s):.2f}x"),
        (f"store existing < 2% of store cold @{num_tokens}",
         median(res["store existing"]) < 0.02 * median(res["store cold"]),
         f"{median(res['store existing']) / median(res['store cold']) * 100:.2f}%"),
        (f"verify share of retrieve out= @{num_tokens}", True,
         f"{median(res['verify']) / median(res['retrieve out=']) * 100:.2f}%"),
    ] + checksum_rows


def scrape_every(port: int, interval_s: float, stop: threading.Event, took: list) -> None:
    """GET /metrics every `interval_s` until `stop`; appends each scrape's seconds to `took`."""
    while not stop.wait(interval_s):
        started = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            reply.read()
        took.append(time.perf_counter() - started)


def observe_cost_ns(n: int = 200_000) -> tuple[float, float]:
    """ns per latency observation: (RequestLatency.observe, prometheus_client Histogram
    child .observe with the same buckets), median of 5 runs of n each."""
    from prometheus_client import CollectorRegistry, Histogram

    from lmcached.daemon.stats import LATENCY_BUCKETS_S

    ours = RequestLatency([Lookup])
    theirs = Histogram("bench_seconds", "bench", ["type"], registry=CollectorRegistry(),
                       buckets=LATENCY_BUCKETS_S).labels("lookup")
    ours_s = median(timeit.repeat(lambda: ours.observe(Lookup, 3e-5), number=n, repeat=5))
    theirs_s = median(timeit.repeat(lambda: theirs.observe(3e-5), number=n, repeat=5))
    return ours_s / n * 1e9, theirs_s / n * 1e9


def snapshot_cost_us(num_namespaces: int = 8, n: int = 200) -> tuple[float, float]:
    """us per scrape, in process: (take_snapshot, the loop's share; building the metric
    families and encoding the text, the scrape thread's share), for a daemon with
    `num_namespaces` namespaces and every request type in the latency histogram."""
    from prometheus_client import CollectorRegistry, generate_latest

    from lmcached.daemon.server_config import ServerConfig
    from lmcached.daemon.metrics import DaemonCollector, take_snapshot
    from lmcached.wire.protocol import PROTOCOL_VERSION, Hello, Request
    from lmcached.daemon.service import CacheService
    from lmcached.shm.arena import Arena

    name = f"bench-snapshot-{os.getpid()}"
    arena = Arena.create(name, 64 << 20, 4096, prefault=False)
    try:
        service = CacheService(ServerConfig(name=name, socket="/nonexistent", metrics_port=1),
                               arena)
        session = service.open_session(os.getpid(), os.getuid(), os.getgid())
        layouts = [dataclasses.replace(LAYOUT, model_name=f"model-{i}").to_wire()
                   for i in range(num_namespaces)]
        service.handle(session, Hello(PROTOCOL_VERSION, os.getpid(), "bench", layouts))
        for request_type in typing.get_args(Request):
            service.latency.observe(request_type, 3e-5)
        loop_s = median(timeit.repeat(lambda: take_snapshot(service), number=n, repeat=5))
        snapshot = take_snapshot(service)

        class Fixed:  # the scrape thread's work alone: the loop already answered
            def request(self):
                return snapshot

        registry = CollectorRegistry()
        registry.register(DaemonCollector(Fixed()))
        text_s = median(timeit.repeat(lambda: generate_latest(registry), number=n, repeat=5))
        service.close_session(session)
    finally:
        arena.close()
    return loop_s / n * 1e6, text_s / n * 1e6


def in_both_orders(fns: dict[str, Callable[[], object]], rounds: int,
                   setup: Callable[[], object] | None = None) -> dict:
    """`time_in_turn` of `fns` for `rounds` rounds, half of them in reverse order, so that
    neither op always runs first."""
    samples = time_in_turn(fns, rounds - rounds // 2, setup)
    backwards = time_in_turn(dict(reversed(fns.items())), rounds // 2, setup)
    return {name: samples[name] + backwards[name] for name in fns}


def bench_metrics_cost(token_counts: list[int], rounds: int, capacity_mib: int) -> None:
    """Print store / retrieve GB/s and a lookup round trip with metrics on (scraped every
    second) and off, the two daemons used in turn in each round."""
    with socketlib.socket() as probe:  # a free port, chosen by the kernel
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ["--capacity", f"{capacity_mib}MiB", "--block-size", record_block_size(LAYOUT),
            "--log-level", "WARNING"]
    stop, took = threading.Event(), []
    with contextlib.ExitStack() as stack:
        pid = os.getpid()
        sockets = {
            "off": stack.enter_context(temporary_daemon(*args, name=f"bench-off-{pid}")),
            "on": stack.enter_context(temporary_daemon(*args, "--metrics-port", str(port),
                                                       name=f"bench-on-{pid}")),
        }
        engines = {c: stack.enter_context(CacheEngine.connect(LAYOUT, socket=s, strict=True))
                   for c, s in sockets.items()}
        admins = {c: stack.enter_context(Connection(s)) for c, s in sockets.items()}
        for admin in admins.values():
            hello(admin, "bench-admin")
        scraper = threading.Thread(target=scrape_every, args=(port, 1.0, stop, took))
        scraper.start()
        stack.callback(scraper.join)
        stack.callback(stop.set)
        print(f"\nmetrics cost: 'on' has --metrics-port {port} and a scrape every 1 s; "
              f"{rounds} rounds, on and off in turn")
        print(f"{'tokens':>7} {'op':>9} {'off GB/s':>9} {'on GB/s':>8} {'on/off median':>14} "
              f"{'on/off mean':>12}")
        for num_tokens in token_counts:
            nbytes = num_tokens * LAYOUT.token_bytes
            tokens = torch.arange(num_tokens) + 1_000_000 * num_tokens
            src, dst = filled_blob(num_tokens, 1.25), filled_blob(num_tokens, 0.0)
            alias = LAYOUT.numpy_alias()[0]
            src_np, dst_np = src.view(alias).numpy(), dst.view(alias).numpy()
            memcpy_s = median(time_it(lambda: np.copyto(dst_np, src_np), rounds))
            print(f"{num_tokens:>7} {'memcpy':>9} {nbytes / memcpy_s / GB:9.2f}")
            samples = in_both_orders({f"store {c}": functools.partial(e.store, tokens, src)
                                      for c, e in engines.items()}, rounds,
                                     setup=lambda: [a.request(Clear()) for a in admins.values()])
            for engine in engines.values():  # the last CLEAR emptied the other daemon
                engine.store(tokens, src)
            samples.update(in_both_orders({
                f"retrieve {c}": functools.partial(e.retrieve, tokens, return_tuple=False, out=dst)
                for c, e in engines.items()}, rounds))
            for engine in engines.values():
                dst.zero_()
                _, ret_mask = engine.retrieve(tokens, return_tuple=False, out=dst)
                assert bool(ret_mask.all()) and torch.equal(dst, src), "retrieved bytes differ"
            for op in ("store", "retrieve"):
                off, on = samples[f"{op} off"], samples[f"{op} on"]
                print(f"{num_tokens:>7} {op:>9} {nbytes / median(off) / GB:9.2f} "
                      f"{nbytes / median(on) / GB:8.2f} {median(off) / median(on):13.3f}x "
                      f"{sum(off) / sum(on):11.3f}x")
        one_chunk = torch.arange(LAYOUT.chunk_size) + 42
        for engine in engines.values():
            engine.store(one_chunk, filled_blob(LAYOUT.chunk_size, 1.0))
        lookups = 500
        samples = in_both_orders({c: lambda e=e: [e.lookup(one_chunk) for _ in range(lookups)]
                                  for c, e in engines.items()}, rounds)
        off_us, on_us = (median(samples[c]) / lookups * 1e6 for c in ("off", "on"))
        print(f"lookup round trip (1 chunk): off {off_us:.1f} us, on {on_us:.1f} us "
              f"(time on/off {on_us / off_us:.3f}x)")
    print(f"scrapes: {len(took)}, median {median(took) * 1e3:.1f} ms each" if took else
          "scrapes: none (the run took less than 1 s)")
    ours_ns, theirs_ns = observe_cost_ns()
    print(f"one latency observation: RequestLatency.observe {ours_ns:.0f} ns, prometheus_client "
          f"Histogram.observe {theirs_ns:.0f} ns")
    loop_us, text_us = snapshot_cost_us()
    print(f"one scrape in process (8 namespaces, every request type): take_snapshot on the "
          f"loop {loop_us:.0f} us, families + text on the scrape thread {text_us:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1k and 4k tokens, 3 repeats "
                        "(10 rounds with --metrics-cost)")
    parser.add_argument("--metrics-cost", action="store_true",
                        help="store / retrieve with metrics scraped every second vs off")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeat = [1024, 4096], 10 if args.metrics_cost else 3
    torch.set_num_threads(2)
    longest = max(args.tokens)
    capacity_mib = longest * LAYOUT.token_bytes * 5 // 4 // 2**20 + 256
    if args.metrics_cost:
        bench_metrics_cost(args.tokens, args.repeat, capacity_mib)
        return
    print(f"layout: {LAYOUT.num_layers} layers x {LAYOUT.num_kv_heads} KV heads x "
          f"{LAYOUT.head_size} x bf16 = {LAYOUT.token_bytes // 1024} KiB/token, "
          f"chunk {LAYOUT.chunk_size}; arena {capacity_mib} MiB; median of {args.repeat}")
    verdicts = []
    with running_daemon(f"{capacity_mib}MiB", record_block_size(LAYOUT)) as socket:
        with CacheEngine.connect(LAYOUT, socket=socket, strict=True) as engine, \
                CacheEngine.connect(LAYOUT, socket=socket, strict=True,
                                    verify="checksum") as checked, \
                Connection(socket) as admin:
            hello(admin, "bench-admin")
            for num_tokens in args.tokens:
                verdicts += report(num_tokens, bench_length(engine, admin, socket, num_tokens,
                                                            args.repeat, checked=checked))
                admin.request(Clear())
            half = torch.arange(longest) + 123_456_789
            engine.store(half, filled_blob(longest, 2.0))
            lookup_tokens = torch.cat([half, torch.arange(longest) + 987_654_321])
            lookup_s = median(time_it(lambda: engine.lookup(lookup_tokens), 20))
            views_s = median(time_it(lambda: engine.retrieve_views(half).release(), 20))
    print(f"\nlookup of {len(lookup_tokens)} tokens ({longest} cached): {lookup_s * 1e6:.0f} us")
    print(f"retrieve_views of {longest} tokens: {views_s * 1e3:.3f} ms")
    verdicts.append((f"lookup of {len(lookup_tokens)} tokens < 300 us", lookup_s < 300e-6,
                     f"{lookup_s * 1e6:.0f} us"))
    verdicts.append((f"retrieve_views of {longest} tokens < 1 ms", views_s < 1e-3,
                     f"{views_s * 1e3:.3f} ms"))
    print("\ntargets:")
    for name, met, value in verdicts:
        print(f"  {name}: {'met' if met else 'NOT met'} ({value})")


if __name__ == "__main__":
    main()
