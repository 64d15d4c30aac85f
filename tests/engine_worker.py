"""Worker process for multi-process engine tests: `python tests/engine_worker.py MODE ...`.

Every chunk's KV is a deterministic function of its prefix hash (`chunk_kv`), so any
process can check every byte it retrieves without talking to the writer.
"""

import json
import random
import sys
import time

import torch

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


def main() -> None:
    mode, socket = sys.argv[1], sys.argv[2]
    if mode == "store":
        start, length, worker_id, world = map(int, sys.argv[3:7])
        layout = small_layout(worker_id, world)
        tokens = list(range(start, start + length))
        with CacheEngine.connect(layout, socket=socket, strict=True) as engine:
            print(json.dumps({"stored": engine.store(tokens, prompt_kv(layout, tokens))}))
    elif mode == "retrieve":
        start, length, worker_id, world = map(int, sys.argv[3:7])
        layout = small_layout(worker_id, world)
        tokens = list(range(start, start + length))
        with CacheEngine.connect(layout, socket=socket, strict=True) as engine:
            kv, ret_mask = engine.retrieve(tokens, return_tuple=False)
            n = int(ret_mask.sum())
            print(json.dumps({"hit": n, "mismatches": count_mismatches(layout, tokens, kv, n)}))
    elif mode == "stress":
        print(json.dumps(stress(socket, int(sys.argv[3]), float(sys.argv[4]))))
    elif mode == "hash":
        print(" ".join(h.hex() for h in hash_request_tokens(256, list(range(1000)))))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
