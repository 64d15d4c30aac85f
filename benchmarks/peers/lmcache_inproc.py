"""LMCache's in-process CPU engine on lmcached's shapes (runs in LMCache's own venv).

Why this file exists: the suite compares lmcached with LMCache. This script runs inside a
separate virtualenv that has `lmcache` (and torch==2.13.0+cpu) installed, so it imports
neither lmcached nor anything of this repository; lmcache_peer.py starts it and reads the
JSON it writes.

LMCache 0.5.6's `LMCacheEngine.store` / `retrieve` move KV through a "GPU connector";
it ships connectors for CUDA, XPU, HPU and MUSA only (VLLMPagedMemGPUConnectorV2
asserts a CUDA device). `CPUBlobConnector` below is the smallest CPU one: it copies a
vllm-format blob `[num_layers, 2, T, num_kv_heads, head_size]` into and out of LMCache's
memory objects (format KV_2LTD: `[2, num_layers, t, num_kv_heads * head_size]`) with
numpy `copyto`, the routine lmcached uses, so the copy routine is not what differs.
Storage: LMCache's local CPU backend (`local_cpu=True`, `max_local_cpu_size` GiB).

Ops per prompt length (each `--repeat` runs after one warm-up):
    memcpy          np.copyto of the blob between touched buffers (in this process)
    store cold      engine.store after engine.clear()
    store existing  engine.store of a stored prompt (LMCache's store does not skip
                    cached chunks; a vLLM connector would lookup first)
    lookup          engine.lookup
    retrieve        engine.retrieve into a touched blob

    python lmcache_inproc.py --shape '{"name": ..., "num_layers": ...}' --tokens 1024 4096
        --repeat 5 --out result.json
"""

import argparse
import json
import os
import sys
import time

import torch  # before lmcache: importing lmcache first breaks torch's import (0.5.6)
import numpy as np

os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")

from lmcache._version import version as lmcache_version  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402


class CPUBlobConnector(GPUConnectorInterface):
    """Copies between a CPU vllm-format KV blob (kwarg `kvcaches`) and memory objects."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.shape = (num_layers, num_kv_heads, head_size)

    def _obj(self, memory_obj, num_tokens: int) -> np.ndarray:
        num_layers, num_kv_heads, head_size = self.shape
        # [2, num_layers, t, num_kv_heads, head_size], int16 alias of bfloat16
        return memory_obj.tensor.view(torch.int16).view(
            2, num_layers, num_tokens, num_kv_heads, head_size).numpy()

    @staticmethod
    def _blob(kwargs, start: int, end: int) -> np.ndarray:
        # [num_layers, 2, T, H, D] -> the chunk as [2, num_layers, t, H, D] (a view)
        return kwargs["kvcaches"].view(torch.int16).numpy()[:, :, start:end].transpose(1, 0, 2, 3, 4)

    def from_gpu(self, memory_obj, start, end, **kwargs):
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj, start, end, **kwargs):
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends):
            np.copyto(self._obj(obj, end - start), self._blob(kwargs, start, end))

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends):
            if obj is not None:
                np.copyto(self._blob(kwargs, start, end), self._obj(obj, end - start))

    def get_shape(self, num_tokens):
        num_layers, num_kv_heads, head_size = self.shape
        return torch.Size([num_layers, 2, num_tokens, num_kv_heads, head_size])


def time_it(fn, repeat, setup=None, warmup=1):
    samples = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            samples.append(elapsed)
    return samples


def bench_shape(shape: dict, token_counts: list[int], repeat: int) -> dict:
    num_layers, num_kv_heads, head_size = shape["num_layers"], shape["num_kv_heads"], shape["head_size"]
    chunk = shape["chunk_size"]
    token_bytes = num_layers * 2 * num_kv_heads * head_size * 2
    cpu_gib = (max(token_counts) * token_bytes * 1.25 + (256 << 20)) / 2**30
    config = LMCacheEngineConfig.from_defaults(chunk_size=chunk, local_cpu=True,
                                               max_local_cpu_size=cpu_gib)
    metadata = LMCacheMetadata(
        model_name=shape["name"], world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.bfloat16,
        kv_shape=(num_layers, 2, chunk, num_kv_heads, head_size))
    instance = f"bench-{shape['name']}"
    engine = LMCacheEngineBuilder.get_or_create(
        instance, config, metadata, CPUBlobConnector(num_layers, num_kv_heads, head_size),
        None, None)
    engine.post_init()
    out = {"local_cpu_gib": cpu_gib}
    try:
        for num_tokens in token_counts:
            blob_shape = (num_layers, 2, num_tokens, num_kv_heads, head_size)
            src = torch.from_numpy(np.full(blob_shape, 0, dtype=np.int16)).view(torch.bfloat16)
            src.fill_(1.25)
            dst = torch.from_numpy(np.zeros(blob_shape, dtype=np.int16)).view(torch.bfloat16)
            src_np, dst_np = src.view(torch.int16).numpy(), dst.view(torch.int16).numpy()
            tokens = torch.arange(num_tokens) + 5_000_000 * num_tokens
            samples = {"memcpy": time_it(lambda: np.copyto(dst_np, src_np), repeat)}
            samples["store cold"] = time_it(lambda: engine.store(tokens, kvcaches=src), repeat,
                                            setup=engine.clear)
            samples["store existing"] = time_it(lambda: engine.store(tokens, kvcaches=src), repeat)
            samples["lookup"] = time_it(lambda: engine.lookup(tokens), repeat)
            dst.zero_()
            ret_mask = engine.retrieve(tokens, kvcaches=dst)
            hit = int(ret_mask.sum())
            if hit != num_tokens or not torch.equal(dst, src):
                raise RuntimeError(f"LMCache retrieved {hit} of {num_tokens} tokens "
                                   f"(bytes equal: {torch.equal(dst, src)})")
            samples["retrieve"] = time_it(lambda: engine.retrieve(tokens, kvcaches=dst), repeat)
            out[str(num_tokens)] = {"nbytes": num_tokens * token_bytes, "samples": samples}
            engine.clear()
            print(f"lmcache in-process {shape['name']} {num_tokens}: done", file=sys.stderr,
                  flush=True)
    finally:
        LMCacheEngineBuilder.destroy(instance)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", required=True,
                        help="JSON: name, num_layers, num_kv_heads, head_size, chunk_size")
    parser.add_argument("--tokens", type=int, nargs="+", required=True, help="prompt lengths")
    parser.add_argument("--max-tokens", action="append", default=[],
                        help="NAME=N: longest prompt for shape NAME")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    limits = dict(item.split("=") for item in args.max_tokens)
    result = {"lmcache": lmcache_version, "torch": torch.__version__, "shapes": {}}
    for text in args.shape:
        shape = json.loads(text)
        limit = int(limits.get(shape["name"], max(args.tokens)))
        result["shapes"][shape["name"]] = bench_shape(
            shape, [n for n in args.tokens if n <= limit], args.repeat)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
