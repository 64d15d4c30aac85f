"""Worker process for multi-process engine tests: `python tests/engine_worker.py MODE ...`.

Every chunk's KV is a deterministic function of its prefix hash (`chunk_kv`), so any
process can check every byte it retrieves without talking to the writer.

The chaos modes (tests/system/test_chaos.py): `step` stops a client at one protocol step and
prints `{"stopped": step}` before it waits to be SIGKILLed there; `torn_writer` /
`torn_reader` store and check prompts of a pool against a small arena; `restart_client`
keeps storing and checking through a daemon restart until a stop file appears.
"""

import json
import os
import random
import sys
import time

import torch

import lmcached.client.chain.core as chain_core
from lmcached.client import CacheEngine, KVLayout, hash_request_tokens


def small_layout(worker_id: int = 0, world_size: int = 1) -> KVLayout:
    return KVLayout("stress-llama", num_layers=2, num_kv_heads=2, head_size=16, chunk_size=16,
                    world_size=world_size, worker_id=worker_id)


def chunk_kv(layout: KVLayout, chunk_hash: bytes, num_tokens: int) -> torch.Tensor:
    """KV of one chunk, `layout.chunk_shape(num_tokens)`, derived from its hash."""
    gen = torch.Generator().manual_seed(int.from_bytes(chunk_hash[:8], "little"))
    return torch.randn(layout.chunk_shape(num_tokens), generator=gen).to(layout.torch_dtype)


def prompt_kv(layout: KVLayout, tokens: list[int]) -> torch.Tensor:
    hashes = hash_request_tokens(layout.chunk_size, tokens)
    parts = []
    for i, h in enumerate(hashes):
        n = min(layout.chunk_size, len(tokens) - i * layout.chunk_size)
        parts.append(chunk_kv(layout, h, n))
    return torch.cat(parts, dim=layout.token_dim)


def count_mismatches(layout: KVLayout, tokens: list[int], kv: torch.Tensor | None, n: int) -> int:
    """1 when the n retrieved tokens' KV differs from what their hashes determine."""
    if n == 0:
        return 0
    expected = prompt_kv(layout, tokens).narrow(layout.token_dim, 0, n)
    return int(not torch.equal(kv, expected))


def stress(socket: str, seed: int, duration_s: float) -> dict:
    """Store and retrieve random overlapping prompts until the deadline; check every byte."""
    rng = random.Random(seed)
    layout = small_layout()
    docs = [[d * 1000 + j for j in range(48)] for d in range(12)]  # shared by all workers
    stats = {"stores": 0, "retrieves": 0, "views": 0, "hit_tokens": 0, "mismatches": 0}
    with CacheEngine.connect(layout, socket=socket, strict=True) as engine:
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            prompt = [t for d in rng.sample(docs, rng.randint(1, 4)) for t in d]
            prompt += [rng.randrange(50_000, 60_000) for _ in range(rng.randint(0, 20))]
            op = rng.random()
            if op < 0.45:
                engine.store(prompt, prompt_kv(layout, prompt))
                stats["stores"] += 1
            elif op < 0.85:
                kv, ret_mask = engine.retrieve(prompt, return_tuple=False)
                n = int(ret_mask.sum())
                stats["retrieves"] += 1
                stats["hit_tokens"] += n
                stats["mismatches"] += count_mismatches(layout, prompt, kv, n)
            else:
                with engine.retrieve_views(prompt) as views:
                    stats["views"] += 1
                    if views.num_tokens:
                        kv = torch.cat(views.chunks, dim=layout.token_dim)
                        stats["mismatches"] += count_mismatches(layout, prompt, kv, views.num_tokens)
        stats["verify_failures"] = engine.num_verify_failures
    return stats


# --------------------------------------------------------------------------- chaos
STEP_TOKENS = list(range(5000, 5056))  # 3 full chunks and a partial one of 8 tokens
STEPS = ("alloc", "copy", "commit", "views", "lease")


def stop_at(step: str) -> None:
    """Tell the test we reached `step`, then wait to be killed (never returns)."""
    print(json.dumps({"stopped": step}), flush=True)
    while True:
        time.sleep(3600)


def run_to_step(socket: str, step: str) -> None:
    """Store/retrieve STEP_TOKENS and stop at `step` of the protocol:

    alloc: ALLOC answered, nothing written (blocks WRITING);
    copy: the first chunk written, the second one half written (layer 0 of 2), no COMMIT;
    commit: the store committed, nothing held;
    views: the prompt pinned by an open retrieve_views;
    lease: retrieve's ACQUIRE pinned and copied it, RELEASE not sent.
    """
    layout = small_layout()
    kv = prompt_kv(layout, STEP_TOKENS)
    engine = CacheEngine.connect(layout, socket=socket, strict=True, copy_threads=1,
                                 data_timeout_s=10.0)
    if step == "alloc":
        chain_core.fill_and_commit = lambda *args: stop_at(step)
    elif step == "copy":
        records = engine.chain.records(engine.link.snapshot())
        write = records.write

        def half_write(span, chunk_hash, chunk_tokens, source, start, end):
            if start == 0:
                return write(span, chunk_hash, chunk_tokens, source, start, end)

            def fill_layer_0(dst: torch.Tensor) -> None:
                full = torch.empty_like(dst)
                source.copy_chunk(start, end, full)
                dst[0].copy_(full[0])
                stop_at(step)

            records.write_with(span, chunk_hash, chunk_tokens, fill_layer_0)

        records.write = half_write
    assert engine.store(STEP_TOKENS, kv) == 4
    if step == "commit":
        stop_at(step)
    if step == "views":
        views = engine.retrieve_views(STEP_TOKENS).__enter__()
        assert views.num_tokens == len(STEP_TOKENS)
        stop_at(step)
    assert step == "lease", step
    engine.link.release = lambda *args: stop_at(step)
    engine.retrieve(STEP_TOKENS)


def pool_prompt(index: int) -> list[int]:
    """Prompt `index` of the stress pool: 2-6 full chunks and 0, 5 or 10 more tokens."""
    return [index * 1000 + j for j in range(16 * (2 + index % 5) + 5 * (index % 3))]


def check_retrieve(engine: CacheEngine, rng: random.Random, tokens: list[int],
                   stats: dict) -> None:
    """Retrieve `tokens` (a copy or views, at random) and count hits and mismatches."""
    layout = engine.layout
    stats["retrieves"] += 1
    if rng.random() < 0.7:
        kv, ret_mask = engine.retrieve(tokens, return_tuple=False)
        n = int(ret_mask.sum())
    else:
        with engine.retrieve_views(tokens) as views:
            n = views.num_tokens
            kv = torch.cat(views.chunks, dim=layout.token_dim) if n else None
            # Compare while the views are still pinned (a torn read would show here).
            stats["mismatches"] += count_mismatches(layout, tokens, kv, n)
            kv = None
    if kv is not None:
        stats["mismatches"] += count_mismatches(layout, tokens, kv, n)
    stats["hits"] += bool(n)
    stats["hit_tokens"] += n


def torn_writer(socket: str, seed: int, duration_s: float, pool_size: int) -> dict:
    """Store prompts of the pool in random order until the deadline (checksums on)."""
    rng = random.Random(seed)
    layout = small_layout()
    stats = {"stores": 0, "chunks": 0}
    with CacheEngine.connect(layout, socket=socket, strict=True, verify="checksum",
                             data_timeout_s=2.0) as engine:
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            tokens = pool_prompt(rng.randrange(pool_size))
            stats["chunks"] += engine.store(tokens, prompt_kv(layout, tokens))
            stats["stores"] += 1
    return stats


def torn_reader(socket: str, seed: int, duration_s: float, pool_size: int) -> dict:
    """Retrieve prompts of the pool until the deadline; compare every byte served."""
    rng = random.Random(seed)
    stats = {"retrieves": 0, "hits": 0, "hit_tokens": 0, "mismatches": 0}
    with CacheEngine.connect(small_layout(), socket=socket, strict=True, verify="checksum",
                             data_timeout_s=2.0) as engine:
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            check_retrieve(engine, rng, pool_prompt(rng.randrange(pool_size)), stats)
        stats["verify_failures"] = engine.num_verify_failures
        stats["checksum_failures"] = engine.num_checksum_failures
    return stats


def restart_client(socket: str, seed: int, stop_file: str) -> dict:
    """Store and retrieve prompts of a small pool until `stop_file` exists.

    Uses the engine's default (serving) timeouts and degrade-on-failure behaviour: the
    daemon may be killed and restarted meanwhile; any exception fails the process.
    """
    rng = random.Random(seed)
    layout = small_layout()
    stats = {"ops": 0, "retrieves": 0, "hits": 0, "hit_tokens": 0, "mismatches": 0,
             "generations": []}
    with CacheEngine.connect(layout, socket=socket, strict=True) as engine:
        print(json.dumps({"connected": engine.link.generation}), flush=True)
        while not os.path.exists(stop_file):
            tokens = pool_prompt(rng.randrange(12))
            if rng.random() < 0.4:
                engine.store(tokens, prompt_kv(layout, tokens))
            else:
                check_retrieve(engine, rng, tokens, stats)
            stats["ops"] += 1
            generation = engine.link.generation
            if generation is not None and generation not in stats["generations"]:
                stats["generations"].append(generation)
        stats["arena_generation"] = engine.link.arena.generation if engine.link.arena else None
        stats["reconnects"] = engine.link.num_reconnects
    return stats


def tier_views(engine: CacheEngine, layout: KVLayout, tokens: list[int]) -> dict:
    """retrieve_views of `tokens`: hits, mismatches, and how many views alias the
    engine's device tier mapping (zero copy from the tier) rather than the host arena."""
    tiers = engine.link.tiers
    ranges = [(t.u8.data_ptr() if hasattr(t, "u8") else t.numpy_view(0, 1).ctypes.data,
               t.capacity_bytes) for t in tiers.values()]
    with engine.retrieve_views(tokens) as views:
        n = views.num_tokens
        kv = torch.cat([v.cpu() for v in views.chunks], dim=layout.token_dim) if n else None
        in_tier = sum(any(base <= v.data_ptr() < base + size for base, size in ranges)
                      for v in views.chunks)
        devices = sorted({v.device.type for v in views.chunks})
        mismatches = count_mismatches(layout, tokens, kv, n)
    return {"hit": n, "mismatches": mismatches, "views_in_tier": in_tier, "devices": devices}


def main() -> None:
    mode, socket = sys.argv[1], sys.argv[2]
    # A device tier to map (`lmcached serve --gpu-backend fake`: "fake-0"), or none; the
    # device the stored KV lives on ("cuda" for the GPU tier tests).
    tier_device = os.environ.get("LMCACHED_TEST_TIER_DEVICE") or None
    kv_device = os.environ.get("LMCACHED_TEST_KV_DEVICE", "cpu")
    if mode == "store":
        start, length, worker_id, world = map(int, sys.argv[3:7])
        layout = small_layout(worker_id, world)
        tokens = list(range(start, start + length))
        with CacheEngine.connect(layout, socket=socket, strict=True,
                                 tier_device=tier_device) as engine:
            kv = prompt_kv(layout, tokens).to(kv_device)
            print(json.dumps({"stored": engine.store(tokens, kv)}))
    elif mode == "retrieve":
        start, length, worker_id, world = map(int, sys.argv[3:7])
        layout = small_layout(worker_id, world)
        tokens = list(range(start, start + length))
        with CacheEngine.connect(layout, socket=socket, strict=True,
                                 tier_device=tier_device) as engine:
            kv, ret_mask = engine.retrieve(tokens, return_tuple=False)
            n = int(ret_mask.sum())
            kv = kv.cpu() if n else kv
            print(json.dumps({"hit": n, "mismatches": count_mismatches(layout, tokens, kv, n)}))
    elif mode == "views":
        start, length = map(int, sys.argv[3:5])
        layout = small_layout()
        tokens = list(range(start, start + length))
        with CacheEngine.connect(layout, socket=socket, strict=True,
                                 tier_device=tier_device) as engine:
            print(json.dumps(tier_views(engine, layout, tokens)))
    elif mode == "hold":  # pin a prompt, say so, and wait to be killed
        start, length = map(int, sys.argv[3:5])
        engine = CacheEngine.connect(small_layout(), socket=socket, strict=True,
                                     tier_device=tier_device)
        run = engine.acquire(list(range(start, start + length)))
        print(json.dumps({"pinned_chunks": len(run.spans)}), flush=True)
        time.sleep(600)
    elif mode == "stress":
        print(json.dumps(stress(socket, int(sys.argv[3]), float(sys.argv[4]))))
    elif mode == "step":
        run_to_step(socket, sys.argv[3])
    elif mode in ("torn_writer", "torn_reader"):
        run = torn_writer if mode == "torn_writer" else torn_reader
        print(json.dumps(run(socket, int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))))
    elif mode == "restart_client":
        print(json.dumps(restart_client(socket, int(sys.argv[3]), sys.argv[4])))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
