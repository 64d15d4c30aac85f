"""TTFT of the demo model with the prompt's KV from the arena, from the disk tier after a
warm restart, from L2, and recomputed: what the disk tier saves a prefill, next to what
L2 saves. Not a test.

The demo's Llama (lmcached/examples/demo.py, size "demo": random weights, cpu; the same
model as docs/l2.md's TTFT table), greedy first token with `generate_with_cache`:

    recompute   no cache
    arena       daemon A stored the prompt (--disk-policy write-through, and --l2: L2's
                write-through) and holds it
    disk        daemon A stopped once every chunk was on disk and in L2, daemon B started
                on the same --disk-path, without --l2 (a warm restart: empty arena); its
                first lookup fetches the prompt from disk (the fetch is in the TTFT; the
                client waits for it)
    L2          daemon C with --l2 on the same Redis and no disk tier (empty arena): its
                first lookup fetches the prompt from L2 (in the TTFT, as for disk)

Each first token is checked against the recomputed one; one untimed prefill warms up.
Redis is a private redis-server on a free loopback port (benchmarks/peers/redis_peer.py:
persistence off, stopped by pid), flushed after each prompt. Daemons are started by
`lmcached.launcher` on a temporary directory under --dir (default /var/tmp: a disk, not
tmpfs), removed after. docs/operator.md ("The disk tier") shows the figures.

    python -m benchmarks.tiers.bench_disk_ttft [--lengths 1024,4096] [--repeat 3]
                                         [--dir /var/tmp] [--out FILE.json]
"""

import argparse
import json
import os
import shutil
import tempfile

import torch


from benchmarks.tiers.bench_disk import CLIENT_TIMEOUT_S, MiB, wait_on_disk
from benchmarks.tiers.bench_l2 import check_cached_runs, wait_drained
from benchmarks.common import machine_info, median, record_block_size
from benchmarks.peers.redis_peer import running_redis
from lmcached.client import CacheEngine
from lmcached.launcher import temporary_daemon


def arena_args(layout, num_tokens: int) -> list[str]:
    """An arena of 6 prompts: write-through (disk, L2) pins at most a quarter of it."""
    nbytes = num_tokens * layout.token_bytes
    return ["--capacity", f"{max(256, 6 * nbytes // MiB)}MiB", "--block-size",
            record_block_size(layout), "--log-level", "WARNING"]


def disk_args(layout, disk_dir: str, num_tokens: int) -> list[str]:
    """A disk tier of 2 prompts per repetition, with a fetch wait long enough for a whole
    prompt."""
    nbytes = num_tokens * layout.token_bytes
    return ["--disk-path", disk_dir, "--disk-capacity", str(8 * nbytes + (64 << 20)),
            "--disk-policy", "write-through", "--disk-fetch-wait", "60"]


def l2_args(url: str) -> list[str]:
    """L2 on `url`, write-through, with a queue and a fetch wait for a whole 16k prompt
    (as bench_l2.py)."""
    return ["--l2", url, "--l2-fetch-wait", "60", "--l2-queue", "4GiB"]


def bench_ttft(root: str, lengths: list[int], repeat: int, redis) -> list[dict]:
    """TTFT recomputed, from the arena, from disk after a warm restart and from L2, per
    length; `redis` is the client of the private redis-server."""
    from lmcached.client.hf import generate_with_cache, layout_for_model
    from lmcached.examples.demo import SIZES, build_model

    size = SIZES["demo"]
    model = build_model(size, max_positions=max(lengths) + 16)
    layout = layout_for_model(model, chunk_size=size.chunk_size)

    def connect(socket: str) -> CacheEngine:
        return CacheEngine.connect(layout, socket=socket, strict=True, timeout_s=CLIENT_TIMEOUT_S,
                                   data_timeout_s=CLIENT_TIMEOUT_S)

    with torch.inference_mode():  # warm-up: the first prefill of a process is slower
        generate_with_cache(model, None, torch.arange(min(lengths)) % size.vocab_size,
                            max_new_tokens=1)
    url = "redis://127.0.0.1:%d" % redis.connection_pool.connection_kwargs["port"]
    rows = []
    for length in lengths:
        full_s, arena_s, disk_s, l2_s = [], [], [], []
        for rep in range(repeat):
            disk_dir = os.path.join(root, f"tier-{length}-{rep}")
            arena = arena_args(layout, length)
            disk = disk_args(layout, disk_dir, length)
            ids = torch.randint(0, size.vocab_size, (length,),
                                generator=torch.Generator().manual_seed(length + rep))
            num_chunks = -(-length // size.chunk_size)
            with torch.inference_mode():
                full = generate_with_cache(model, None, ids, max_new_tokens=1)
                with temporary_daemon(*arena, *disk, *l2_args(url),
                                      name=f"dskt-{os.getpid()}") as a:
                    with connect(a) as engine:
                        generate_with_cache(model, engine, ids, max_new_tokens=1)  # stores
                        wait_on_disk(a, num_chunks)
                        wait_drained(a)
                        from_arena = generate_with_cache(model, engine, ids, max_new_tokens=1,
                                                         store=False)
                with temporary_daemon(*arena, *disk, name=f"dsktb-{os.getpid()}") as b:
                    with connect(b) as engine:
                        from_disk = generate_with_cache(model, engine, ids, max_new_tokens=1,
                                                        store=False)
                with temporary_daemon(*arena, *l2_args(url), name=f"dsktc-{os.getpid()}") as c:
                    with connect(c) as engine:
                        from_l2 = generate_with_cache(model, engine, ids, max_new_tokens=1,
                                                      store=False)
            redis.flushall()
            check_cached_runs(length, full, (from_arena, from_disk, from_l2))
            full_s.append(full.ttft_s)
            arena_s.append(from_arena.ttft_s)
            disk_s.append(from_disk.ttft_s)
            l2_s.append(from_l2.ttft_s)
            shutil.rmtree(disk_dir)
        rows.append({"num_tokens": length, "kv_bytes": length * layout.token_bytes,
                     "runs": repeat, "ttft_recompute_s": full_s, "ttft_arena_s": arena_s,
                     "ttft_disk_s": disk_s, "ttft_l2_s": l2_s,
                     "speedup_arena": median(full_s) / median(arena_s),
                     "speedup_disk": median(full_s) / median(disk_s),
                     "speedup_l2": median(full_s) / median(l2_s)})
        print(f"TTFT {length} tokens ({length * layout.token_bytes / MiB:.0f} MiB of KV): "
              f"recomputed {median(full_s) * 1e3:.0f} ms, from the arena "
              f"{median(arena_s) * 1e3:.1f} ms ({rows[-1]['speedup_arena']:.1f}x), from disk "
              f"after a restart {median(disk_s) * 1e3:.1f} ms ({rows[-1]['speedup_disk']:.1f}x), "
              f"from L2 {median(l2_s) * 1e3:.1f} ms ({rows[-1]['speedup_l2']:.1f}x)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--out")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="lmcached-bench-disk-ttft-", dir=args.dir)
    try:
        with running_redis() as redis:
            redis.config_set("maxmemory", "8gb")
            redis.config_set("maxmemory-policy", "allkeys-lru")
            rows = bench_ttft(root, [int(n) for n in args.lengths.split(",")], args.repeat,
                              redis)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "ttft": rows}, f, indent=2)


if __name__ == "__main__":
    main()
