"""Scenario 6: the daemon's memory, and whether it grows over 10,000 store/evict cycles.

Why this file exists: a node daemon runs for months; its own memory must stay flat while
the arena turns over. With a tiny KV shape (so each cycle is fast), the benchmark fills
the arena, reads INFO (RSS, and RSS less shared memory: the arena is shared memory and
counts in RSS once touched; arena capacity, used, stored bytes, block size, fill
ratio), then runs the cycles: each stores a prompt of one new chunk, which evicts the
least recently used one, and every `reconnect_every` cycles the client session is
closed and a new one opened (session churn). INFO again at the end: RSS growth,
evictions and errors.

Overhead per block: `block_bytes - KV bytes of a chunk` = the record header and token ids
(`layout.kv_offset`) plus the padding of a block to whole pages; and the daemon's private
memory per block (its metadata: KVCacheBlock objects, hash index, sessions).
"""

import time

import torch

from benchmarks.common import daemon_info, record_block_size, running_daemon
from lmcached.client import CacheEngine, KVLayout
from lmcached.client.kv_io import new_kv_buffer

# A tiny shape: 2 layers x 2 KV heads x 64, bf16 = 1 KiB per token, 256 KiB per chunk.
TINY = KVLayout("tiny", num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16",
                chunk_size=256)


def _snapshot(socket: str) -> dict:
    info = daemon_info(socket)
    server, memory, blocks, stats = info["server"], info["memory"], info["blocks"], info["stats"]
    return {
        "rss_bytes": server["rss_bytes"],
        "rss_private_bytes": server["rss_private_bytes"],
        "capacity_bytes": memory["capacity_bytes"],
        "block_bytes": memory["block_bytes"],
        "used_bytes": memory["used_bytes"],
        "stored_bytes": memory["stored_bytes"],
        "fill_ratio": memory["fill_ratio"],
        "num_blocks": blocks["num_blocks"],
        "cached_blocks": blocks["cached_blocks"],
        "cached_values": blocks["cached_values"],
        "evictions": stats["evictions"],
        "errors": stats["errors"],
        "connections_received": stats["connections_received"],
    }


def run_memory(num_cycles: int = 10_000, capacity: str = "32MiB", layout: KVLayout = TINY,
               reconnect_every: int = 1000) -> dict:
    """Fill the arena, then `num_cycles` store/evict cycles; INFO before and after.

    Returns:
        {"empty", "before", "after": INFO snapshots, "cycles", "seconds",
         "rss_growth_bytes", "rss_private_growth_bytes", "header_bytes_per_block",
         "private_bytes_per_block", ...}
    """
    chunk = layout.chunk_size
    kv = new_kv_buffer(layout.chunk_shape(chunk), layout.torch_dtype)
    kv.fill_(0.5)
    with running_daemon(capacity, record_block_size(layout),
                        name=f"bench-memory-{int(time.time())}") as socket:
        empty = _snapshot(socket)
        engine = CacheEngine.connect(layout, socket=socket, strict=True)
        try:
            num_blocks = _snapshot(socket)["num_blocks"]
            prompt = 0
            for _ in range(num_blocks):  # fill: every block cached
                prompt += 1
                engine.store(torch.arange(prompt * chunk, (prompt + 1) * chunk), kv)
            before = _snapshot(socket)
            started = time.perf_counter()
            stored = 0
            for cycle in range(num_cycles):
                prompt += 1
                stored += engine.store(torch.arange(prompt * chunk, (prompt + 1) * chunk), kv)
                if reconnect_every and (cycle + 1) % reconnect_every == 0:
                    engine.close()
                    engine = CacheEngine.connect(layout, socket=socket, strict=True)
            seconds = time.perf_counter() - started
        finally:
            engine.close()
        after = _snapshot(socket)
    record_kv_bytes = chunk * layout.token_bytes
    return {
        "layout": layout.model_name,
        "chunk_kv_bytes": record_kv_bytes,
        "cycles": num_cycles,
        "chunks_stored": stored,
        "reconnect_every": reconnect_every,
        "seconds": seconds,
        "cycles_per_s": num_cycles / seconds,
        "empty": empty,
        "before": before,
        "after": after,
        "evictions_during_cycles": after["evictions"] - before["evictions"],
        "rss_growth_bytes": after["rss_bytes"] - before["rss_bytes"],
        "rss_private_growth_bytes": after["rss_private_bytes"] - before["rss_private_bytes"],
        "record_header_bytes": layout.kv_offset,
        "block_padding_bytes": before["block_bytes"] - layout.record_bytes(chunk),
        "header_bytes_per_block": before["block_bytes"] - record_kv_bytes,
        "unused_arena_bytes": before["capacity_bytes"] - before["num_blocks"] * before["block_bytes"],
        "private_bytes_per_block": (before["rss_private_bytes"] - empty["rss_private_bytes"])
        / max(1, before["num_blocks"]),
        "errors": after["errors"],
    }
