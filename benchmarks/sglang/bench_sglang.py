"""SGLang HiCache storage: lmcached's `batch_get_v1` / `batch_set_v1` against memcpy of the
same pages, and against SGLang's own file backend (HiCacheFile) on /dev/shm and on disk.

One process, one host pool (SGLang's MHA pointer layouts, `--layout`), one daemon
started here. Each figure is GB/s of page bytes moved between the host pool and the store, best of
`--repeat` runs of a batch of `--pages` pages. The memcpys, get and set take turns in
rounds, in a new random order each round; `*_vs_memcpy` compares the bests,
`*_vs_<baseline>_median_round` is the median over rounds of each round's ratio to that
round's baseline. The pool and the memcpy buffers start on 4 KiB boundaries, as SGLang's
pinned host pool and the arena's pages do:

- memcpy: the faster, in each round, of one `np.copyto` of the batch's KV (its K runs and
  its V runs are contiguous: the batch is the pool's first pages), and one `memmove` per
  page run (the same runs the backend copies), into a private buffer: the fastest copy
  of the same bytes;
- memcpy_into_shm / memcpy_from_shm: one `memmove` per page run into / out of a mapping
  of a /dev/shm file, the kind of memory a set writes and a get reads (the daemon's
  arena is a shared memory segment);
- lmcached set/get: `batch_set_v1` (fresh keys each run) / `batch_get_v1`;
- file set/get: what SGLang's generic page path does with HiCacheFile: per page,
  `get_data_page` + `set` / `get` into a flat page + `set_from_flat_data_page`.

    # 1 MiB pages, 64 MiB a batch; Llama-3-8B's KV, 8 MiB pages, 512 MiB a batch
    python -m benchmarks.sglang.bench_sglang --pages 64 --layers 4 --repeat 30
    python -m benchmarks.sglang.bench_sglang --pages 64 --layers 32 --repeat 12
"""

import argparse
import ctypes
import itertools
import json
import mmap
import os
import random
import shutil
import tempfile
import time

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from lmcached import launcher
from lmcached.launcher import stop_daemon


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 cpu tensor of `nbytes` starting on a 4 KiB boundary."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return torch.from_numpy(raw[start : start + nbytes])


class HostPool:
    """A host pool with SGLang's MHA layouts: KV `[2, size, layers, heads, dim]`
    (page_first) or `[2, layers, size, heads, dim]` (layer_first), flat, cpu, bf16; the
    methods the backends use, with SGLang's pointer arithmetic
    (`MHATokenToKVPoolHost.get_page_buffer_meta`: per page, K then V, per layer in
    layer_first)."""

    def __init__(self, layout: str, num_pages: int, page_size: int, layers: int, heads: int,
                 dim: int):
        self.layout = layout
        self.page_size, self.size = page_size, num_pages * page_size
        self.layer_num, self.head_num, self.head_dim = layers, heads, dim
        self.dtype = torch.bfloat16
        shape = ((2, self.size, layers, heads, dim) if layout == "page_first"
                 else (2, layers, self.size, heads, dim))
        # Page-aligned, as SGLang's pinned host pool is (torch's CPU allocator aligns to 64).
        self.kv = aligned_empty(2 * self.size * layers * heads * dim * 2).view(
            torch.bfloat16).view(shape)
        self.kv.copy_(torch.randn(shape))
        self.kv_buffer = self.kv.view(-1)
        self.token_bytes = layers * heads * dim * 2  # one of K or V, all layers

    def tokens(self, start: int, end: int) -> torch.Tensor:
        """The KV of tokens [start, end): `[2, n, ...]` or `[2, layers, n, ...]`."""
        return (self.kv[:, start:end] if self.layout == "page_first"
                else self.kv[:, :, start:end])

    def get_page_buffer_meta(self, indices):
        base, v_offset = self.kv_buffer.data_ptr(), self.size * self.token_bytes
        ptrs = []
        if self.layout == "page_first":
            for index in indices.tolist()[:: self.page_size]:
                k = base + index * self.token_bytes
                ptrs += [k, k + v_offset]
            return ptrs, [self.page_size * self.token_bytes] * len(ptrs)
        layer_token = self.token_bytes // self.layer_num
        for index in indices.tolist()[:: self.page_size]:
            for layer in range(self.layer_num):
                k = base + index * layer_token + layer * self.size * layer_token
                ptrs += [k, k + v_offset]
        return ptrs, [self.page_size * layer_token] * len(ptrs)

    def get_data_page(self, index, flat=True):
        return self.tokens(index, index + self.page_size).flatten()

    def get_dummy_flat_data_page(self):
        return torch.empty(2 * self.page_size * self.token_bytes // 2, dtype=self.dtype)

    def set_from_flat_data_page(self, index, data_page):
        view = self.tokens(index, index + self.page_size)
        view.copy_(data_page.view(view.shape))


def config(extra=None) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, True, "bench/model",
                                extra_config=extra)


def shm_buffer(nbytes: int) -> np.ndarray:
    """A uint8 array of `nbytes` mapping a /dev/shm file (unlinked at once: nothing is
    left behind), as the daemon's arena maps its segment."""
    fd, path = tempfile.mkstemp(prefix="lmc-bench-", dir="/dev/shm")
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        return np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    finally:
        os.close(fd)


def best(fn, repeat: int) -> float:
    times = []
    for i in range(repeat):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--layout", choices=("page_first", "layer_first"), default="page_first",
                        help="the host pool's layout (layer_first: 2 * layers runs a page)")
    parser.add_argument("--disk-dir", default=None, help="file backend on disk (default: a temp dir under /tmp)")
    parser.add_argument("--skip-file", action="store_true", help="lmcached and memcpy only")
    args = parser.parse_args()
    n, ps = args.pages, args.page_size
    pool = HostPool(args.layout, 2 * n, ps, args.layers, args.heads, args.dim)
    page_bytes = 2 * ps * pool.token_bytes
    batch_bytes = n * page_bytes
    src = torch.arange(n * ps, dtype=torch.int64)
    dst = torch.arange(n * ps, 2 * n * ps, dtype=torch.int64)
    gb = batch_bytes / 1e9
    results = {"layout": args.layout, "pages": n, "page_bytes": page_bytes,
               "batch_bytes": batch_bytes}

    # memcpy of the same bytes: the batch's pages are the pool's first n, so its K runs and
    # its V runs (of each layer, in layer_first) are contiguous. Two ways, the faster one
    # in each round is that round's memcpy: one np.copyto of the batch's tokens (one
    # memcpy per contiguous stretch: glibc may pick non-temporal stores for 32 MiB), one
    # memmove per page run (512 KiB at the default shape: ordinary stores). And the page
    # runs into and out of a mapping of /dev/shm, the memory a set writes and a get reads
    # (the arena is a shared memory segment).
    out = aligned_empty(batch_bytes).numpy()
    batch_kv = pool.tokens(0, n * ps).view(torch.int16).numpy()  # numpy has no bfloat16
    out_kv = out.view(np.int16).reshape(batch_kv.shape)
    page_runs = pool.get_page_buffer_meta(src)
    shm_out = shm_buffer(batch_bytes)

    def memcpy_copyto(i):
        np.copyto(out_kv, batch_kv)

    def runs_copy(address: int, into: bool):
        """Per page run, one memmove into (or out of) the buffer at `address`."""
        def copy(i):
            for ptr, size, offset in zip(*page_runs, itertools.accumulate(page_runs[1], initial=0)):
                if into:
                    ctypes.memmove(address + offset, ptr, size)
                else:
                    ctypes.memmove(ptr, address + offset, size)
        return copy

    tmp = tempfile.mkdtemp(prefix="lmc-bench-", dir="/tmp")
    socket = os.path.join(tmp, "d.sock")
    capacity = max(4 * batch_bytes + (64 << 20), 256 << 20)
    proc = launcher.start_daemon(f"bench-sglang-{os.getpid()}", socket,
                                 "--capacity", str(capacity), log_path=os.path.join(tmp, "d.log"),
                                 timeout_s=60)
    try:
        ours = StorageBackendFactory.create_backend("dynamic", config(
            {"backend_name": "lmcached", "module_path": "lmcached.client.sglang",
             "class_name": "LmcachedStorage", "interface_v1": 1, "socket": socket}), pool)
        ours.register_mem_pool_host(pool)
        keys = [[f"{i:04d}-{p:060d}" for p in range(n)] for i in range(args.repeat + 1)]
        ours.batch_get_v1(keys[-1], dst)  # warm: the session, the arena mapping
        assert all(ours.batch_set_v1(keys[-1], src))
        assert all(ours.batch_get_v1(keys[-1], dst))
        assert torch.equal(pool.tokens(n * ps, 2 * n * ps), pool.tokens(0, n * ps))
        # The machine is shared (its memory bandwidth swings with other load): the
        # memcpys, get and set take turns in rounds, in a new random order each round
        # (what ran just before changes what the caches hold); each round gives a ratio
        # to its own memcpy. Fresh keys for each set (a key already held is not copied
        # again); the arena evicts the least recently used batches to make room.
        ops = {"memcpy_copyto": memcpy_copyto,
               "memcpy_runs": runs_copy(out.ctypes.data, True),
               "memcpy_into_shm": runs_copy(shm_out.ctypes.data, True),
               "memcpy_from_shm": runs_copy(shm_out.ctypes.data, False),
               "lmcached_get": lambda i: ours.batch_get_v1(keys[-1], dst),
               "lmcached_set": lambda i: ours.batch_set_v1(keys[i], src)}
        for op in ops.values():  # warm: the first touch of each buffer's pages
            op(len(keys) - 1)
        order, shuffle = list(ops), random.Random(0).shuffle
        times = {name: [] for name in ops}
        for i in range(args.repeat):
            shuffle(order)
            for name in order:
                start = time.perf_counter()
                ops[name](i)
                times[name].append(time.perf_counter() - start)
        times["memcpy"] = list(map(min, times["memcpy_copyto"], times["memcpy_runs"]))
        for name, runs in times.items():
            results[f"{name}_gbps"] = gb / min(runs)
        for name, base in (("lmcached_set", "memcpy"), ("lmcached_get", "memcpy"),
                           ("lmcached_set", "memcpy_into_shm"),
                           ("lmcached_get", "memcpy_from_shm")):
            ratios = [m / t for m, t in zip(times[base], times[name])]
            results[f"{name}_vs_{base}_median_round"] = float(np.median(ratios))
        ours.close()

        for where, path in () if args.skip_file else (
                ("shm", tempfile.mkdtemp(prefix="lmc-bench-", dir="/dev/shm")),
                ("disk", args.disk_dir or tempfile.mkdtemp(prefix="lmc-bench-", dir="/tmp"))):
            try:
                store = HiCacheFile(config({"file_storage_path": path}))
                pages = list(range(0, n * ps, ps))

                def file_set(i):
                    for key, index in zip(keys[i], pages):
                        store.set(key, pool.get_data_page(index))

                def file_get(i):
                    for key, index in zip(keys[-1], pages):
                        page = store.get(key, pool.get_dummy_flat_data_page())
                        pool.set_from_flat_data_page(n * ps + index, page)

                file_set(len(keys) - 1)
                results[f"file_{where}_set_gbps"] = gb / best(file_set, args.repeat)
                results[f"file_{where}_get_gbps"] = gb / best(file_get, args.repeat)
            finally:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        stop_daemon(proc, 15)
        shutil.rmtree(tmp, ignore_errors=True)
    for name in ("lmcached_set", "lmcached_get"):
        results[f"{name}_vs_memcpy"] = results[f"{name}_gbps"] / results["memcpy_gbps"]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in results.items()},
                     indent=1))


if __name__ == "__main__":
    main()
