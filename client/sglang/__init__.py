"""lmcached as SGLang HiCache's storage backend (docs/sglang.md).

    storage.py  LmcachedStorage: the `HiCacheStorage` subclass SGLang's dynamic factory
                loads (module_path "lmcached.client.sglang", class_name "LmcachedStorage")
    page_io.py  PageIO: a batch of pages in and out of the daemon (pipelined requests,
                record checks, copies; no SGLang import)
    pages.py    a page as a chunk record: its namespace, key encoding and copies (no
                SGLang import)
    host_runs.py  where a batch's pages lie in the host pool: an affine model of its
                `get_page_buffer_meta`, checked against the pool's own answers

Importing this package imports SGLang (`sglang.srt.mem_cache.hicache_storage`); only
this package does.
"""

from lmcached.client.sglang.storage import LmcachedStorage

__all__ = ["LmcachedStorage"]
