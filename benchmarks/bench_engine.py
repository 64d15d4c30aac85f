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

    python benchmarks/bench_engine.py [--tokens 4096 16384] [--repeat 5] [--quick]
"""

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import textwrap
import time
from typing import Callable

import numpy as np
import torch

from common import GB, LLAMA_8B, median, p90, record_block_size, running_daemon, time_it
from lmcached.client import CacheEngine, KVLayout
from lmcached.client.hashing import as_token_array, hash_request_tokens
from lmcached.client.kv_io import ChunkCopier, copy_tensor, new_kv_buffer
from lmcached.client.records import RecordIO
from lmcached.protocol import Clear, Connection, hello

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1k and 4k tokens, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeat = [1024, 4096], 3
    torch.set_num_threads(2)
    longest = max(args.tokens)
    capacity_mib = longest * LAYOUT.token_bytes * 5 // 4 // 2**20 + 256
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
