"""Block-pool metadata cost: allocate+commit+free (a store) and acquire+free (a hit).

Prints, for 1-, 64- and 1024-block requests over a 16k-block pool kept full of cached
values (so every allocate also evicts), the time per request and block operations per
second. Target: a 64-chunk request's metadata work under 100 us.

    python -m benchmarks.engine.bench_block_pool [--num-blocks 16384] [--repeat 200]
"""

import argparse
import statistics
import time

from lmcached.daemon.block_pool import BlockPool

TARGET_US_64 = 100.0


def make_key(i: int) -> bytes:
    """A daemon-style key: 4-byte namespace id + 16-byte chunk hash."""
    return (7).to_bytes(4, "little") + i.to_bytes(16, "little")


def time_store(pool: BlockPool, batch: int, keys: list) -> float:
    """One store request: allocate `batch` blocks, commit each under its key, free all."""
    start = time.perf_counter()
    blocks = pool.allocate(batch)
    pool.commit_many([[block] for block in blocks], keys)
    pool.free(blocks)
    return time.perf_counter() - start


def time_hit(pool: BlockPool, keys: list) -> float:
    """One hit request: acquire the cached prefix, then free it (tail first)."""
    start = time.perf_counter()
    spans = pool.acquire_prefix(keys)
    pool.free([b for span in spans for b in span])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()

    print(f"block pool of {args.num_blocks} blocks, median of {args.repeat} requests")
    print(f"{'batch':>6} {'op':>18} {'us/request':>11} {'p90 us':>8} {'block ops/s':>12}")
    results = {}
    for batch in (1, 64, 1024):
        pool = BlockPool(args.num_blocks)
        counter = 0
        # Fill the pool with cached values so later allocations evict (steady state).
        while pool.num_empty_blocks >= batch:
            time_store(pool, batch, [make_key(counter + i) for i in range(batch)])
            counter += batch
        store_s, hit_s = [], []
        for _ in range(args.repeat):
            keys = [make_key(counter + i) for i in range(batch)]
            counter += batch
            store_s.append(time_store(pool, batch, keys))
            hit_s.append(time_hit(pool, keys))
        pool.check_invariants()
        for op, samples in (("allocate+commit+free", store_s), ("acquire+free", hit_s)):
            med = statistics.median(samples) * 1e6
            p90 = statistics.quantiles(samples, n=10)[-1] * 1e6
            results[(batch, op)] = med
            print(f"{batch:>6} {op:>18} {med:>11.1f} {p90:>8.1f} {batch / med * 1e6:>12,.0f}")
    worst = max(results[(64, "allocate+commit+free")], results[(64, "acquire+free")])
    verdict = "met" if worst < TARGET_US_64 else "NOT met"
    print(f"target: 64-chunk request metadata < {TARGET_US_64:.0f} us: {verdict} ({worst:.1f} us)")


if __name__ == "__main__":
    main()
