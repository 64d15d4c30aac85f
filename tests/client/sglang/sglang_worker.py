"""One SGLang-side process of the backend's tests: builds `LmcachedStorage` through
SGLang's dynamic factory with a stand-in host pool, runs one command, prints a JSON line.

    python sglang_worker.py SOCKET COMMAND KIND LAYOUT TP_RANK TP_SIZE NUM_PAGES SEED [SALT]

COMMAND: "set" (fill pages, batch_set_v1), "get" (batch_exists, then batch_get_v1 into
other host pages, compare with the expected bytes), "set-loop" (batch_set_v1 forever:
the test kills the daemon under it).
"""

import json
import sys

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from sglang_pools import fill_pages, make_pool, page_indices, read_runs


def page_keys(num_pages: int, salt: str) -> list[str]:
    """SGLang-like page keys: a SHA-256 hex chain, seeded by the salt."""
    import hashlib

    keys, prev = [], salt
    for i in range(num_pages):
        prev = hashlib.sha256(f"{prev}/{i}".encode()).hexdigest()
        keys.append(prev)
    return keys


def build(socket: str, kind: str, layout: str, tp_rank: int, tp_size: int, **geometry):
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=kind == "mla", enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name="test/model",
        extra_config={"backend_name": "lmcached", "module_path": "lmcached.client.sglang",
                      "class_name": "LmcachedStorage", "interface_v1": 1,
                      "socket": socket})
    pool = make_pool(kind, layout, **geometry)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend, pool


def main() -> None:
    socket, command, kind, layout = sys.argv[1:5]
    tp_rank, tp_size, num_pages, seed = map(int, sys.argv[5:9])
    salt = sys.argv[9] if len(sys.argv) > 9 else ""
    backend, pool = build(socket, kind, layout, tp_rank, tp_size)
    keys = page_keys(num_pages, salt)
    src = page_indices(list(range(num_pages)), pool.page_size)
    if command == "set":
        fill_pages(pool, src, seed)
        result = backend.batch_set_v1(keys, src)
        print(json.dumps({"stored": sum(result), "namespace": backend.namespace}), flush=True)
    elif command == "set-loop":
        fill_pages(pool, src, seed)
        print(json.dumps({"started": True}), flush=True)
        i = 0
        while True:
            more = page_keys(num_pages, f"{salt}/{i}")
            backend.batch_set_v1(more, src)
            i += 1
    elif command == "get":
        fill_pages(pool, src, seed)  # what A stored, to compare with
        expected = read_runs(pool, src)
        hit = backend.batch_exists(keys)
        dst = page_indices(list(range(num_pages, 2 * num_pages)), pool.page_size)
        ok = backend.batch_get_v1(keys[:hit], dst[: hit * pool.page_size])
        got = read_runs(pool, dst[: hit * pool.page_size])
        m = len(expected) // num_pages
        print(json.dumps({"hit": hit, "read": sum(ok),
                          "bit_exact": got == expected[: hit * m],
                          "stats": backend.get_stats()}), flush=True)
    backend.close()


if __name__ == "__main__":
    main()
