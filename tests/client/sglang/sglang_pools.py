"""Host pools for the SGLang backend's tests, with SGLang's own page pointer math.

SGLang's host pools (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`) need device pools
and pinned memory to be built, so the tests use stand-ins: a flat cpu KV buffer and the
attributes that SGLang's real `get_page_buffer_meta` reads, with that very function
bound as the stand-in's method (the pointers the backend copies from and to are the ones
SGLang would give). test_sglang_backend.py checks the stand-ins' signatures against
SGLang's classes.
"""

import ast
import ctypes
import hashlib
import os

import sglang.srt.mem_cache.hicache_storage as hicache_storage
import torch

# SGLang's pool_host package imports its model configs (torchvision and more) when
# imported, so its methods are read from the installed source and compiled here.
POOL_HOST_DIR = os.path.join(os.path.dirname(hicache_storage.__file__), "pool_host")


def sglang_method(module: str, class_name: str, name: str) -> tuple:
    """(function, ast.FunctionDef) of `class_name.name` in pool_host/`module`.py, compiled
    from SGLang's installed source.

    Raises:
        LookupError: the class or method is not there (SGLang changed).
    """
    path = os.path.join(POOL_HOST_DIR, f"{module}.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    item.decorator_list = []
                    code = compile(ast.Module([item], []), path, "exec")
                    namespace = {"torch": torch}
                    exec(code, namespace)
                    return namespace[name], item
    raise LookupError(f"{class_name}.{name} not found in {path}")


class MHAStandIn:
    """An MHA host pool: KV `[2, layer_num, size, head_num, head_dim]` (layer_first) or
    `[2, size, layer_num, head_num, head_dim]` (page_first), flat, cpu."""

    get_page_buffer_meta = sglang_method("mha", "MHATokenToKVPoolHost", "get_page_buffer_meta")[0]

    def __init__(self, layout: str, size: int = 64, page_size: int = 4, layer_num: int = 3,
                 head_num: int = 2, head_dim: int = 16, dtype=torch.bfloat16) -> None:
        self.layout, self.size, self.page_size = layout, size, page_size
        self.layer_num, self.head_num, self.head_dim, self.dtype = layer_num, head_num, head_dim, dtype
        self.kv_buffer = torch.zeros(2 * layer_num * size * head_num * head_dim, dtype=dtype)


class MLAStandIn:
    """An MLA host pool: KV `[layer_num, size, 1, kv_cache_dim]` (layer_first) or
    `[size, layer_num, 1, kv_cache_dim]` (page_first), flat, cpu."""

    get_page_buffer_meta = sglang_method("mla", "MLATokenToKVPoolHost", "get_page_buffer_meta")[0]
    _storage_page_index = sglang_method("mla", "MLATokenToKVPoolHost", "_storage_page_index")[0]
    dcp_size = 1

    def __init__(self, layout: str, size: int = 64, page_size: int = 4, layer_num: int = 3,
                 kv_cache_dim: int = 40, dtype=torch.bfloat16) -> None:
        self.layout, self.size, self.page_size = layout, size, page_size
        self.logical_page_size = page_size
        self.layer_num, self.kv_cache_dim, self.dtype = layer_num, kv_cache_dim, dtype
        self.kv_buffer = torch.zeros(layer_num * size * kv_cache_dim, dtype=dtype)


def make_pool(kind: str, layout: str, **geometry):
    return (MLAStandIn if kind == "mla" else MHAStandIn)(layout, **geometry)


def fill_pages(pool, host_indices: torch.Tensor, seed: int) -> None:
    """Fill the pages at `host_indices` with bytes derived from `seed` and each page's
    position in the list (so every page's bytes differ)."""
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    for j, (ptr, n) in enumerate(zip(ptrs, sizes)):
        data = page_bytes_for(seed, j, n)
        ctypes.memmove(ptr, data, n)


def page_bytes_for(seed: int, run: int, n: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}/{run}/{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def read_runs(pool, host_indices: torch.Tensor) -> list[bytes]:
    """The bytes of every run of the pages at `host_indices`."""
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    return [ctypes.string_at(ptr, n) for ptr, n in zip(ptrs, sizes)]


def page_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """int64 host indices of whole pages `pages`."""
    return torch.tensor([p * page_size + t for p in pages for t in range(page_size)],
                        dtype=torch.int64)
