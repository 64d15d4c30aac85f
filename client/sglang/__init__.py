"""lmcached as SGLang HiCache's storage backend (docs/sglang.md).

    storage.py  LmcachedStorage: the `HiCacheStorage` subclass SGLang's dynamic factory
                loads (module_path "lmcached.client.sglang", class_name "LmcachedStorage")
    pages.py    a page as a chunk record: its namespace, key encoding and copies (no
                SGLang import)

Importing this package imports SGLang (`sglang.srt.mem_cache.hicache_storage`); only
this package does.
"""

from lmcached.client.sglang.storage import LmcachedStorage

__all__ = ["LmcachedStorage"]
