"""`LmcachedStorage`: lmcached as SGLang HiCache's storage tier (L3).

Why this file exists: SGLang keeps KV in GPU memory, then in a host pool per instance,
then in a storage backend. This backend keeps the pages in the lmcached daemon's shared
memory, so every SGLang process on the node (and any other lmcached client) shares one
L3, with the daemon's disk tier, warm restart and L2 under it. SGLang loads it by module
path (docs/sglang.md)::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "lmcached", "module_path": "lmcached.client.sglang",
      "class_name": "LmcachedStorage", "interface_v1": 1}'

and constructs it as `LmcachedStorage(storage_config, kwargs)`. It is glue only: the
pages are chunk records of the client's chunk-chain core (`lmcached.client.chain`:
LOOKUP, ACQUIRE with record checks, ALLOC -> fill -> COMMIT), laid out by
`client/sglang/pages.py`, moved in batches by `client/sglang/page_io.py`, found in the
host pool by `client/sglang/host_runs.py`.

Guarantees (as every lmcached client):
- a page is verified on read: its record must hold its key (`pages.key_tokens`), so a
  key never returns another key's bytes; a page evicted between `batch_exists` and
  `batch_get_v1`, or whose pins did not hold while it was copied, is a miss;
- `batch_exists` is one LOOKUP; `batch_get_v1` and `batch_set_v1` pipeline their
  requests on the session (`page_io.pipeline_parts`): the ACQUIRE (ALLOC) of the first
  few pages goes out alone and the rest's together, the host pool's page runs are read while the
  daemon answers, and a part is copied while the daemon pins (allocates) the next; a
  store sends one COMMIT of all parts but the last before it writes the last, and one
  COMMIT of the last after. The RELEASE is not waited for. One memcpy per page run
  between the host pool and the arena; each part's records are checked before any of
  its bytes is copied. Gets and stores go through two sessions of their own: a get
  never waits for a store, which holds its session while it writes (two SGLang
  threads' stores take turns); a get copies its last part after letting go of its
  session;
- a daemon that is down, loading or restarting is a miss (and a skipped store), never an
  exception in SGLang's cache controller: every method catches, logs once, and answers
  a miss.
"""

from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from lmcached.client.chain import Chain
from lmcached.client.daemon_link import CacheUnavailable, DaemonLink
from lmcached.client.serving.hook_guard import HookGuard
from lmcached.client.sglang.host_runs import HostPageRuns
from lmcached.client.sglang.page_io import PageIO
from lmcached.client.sglang.pages import keys_tokens, namespace_name, page_layout
from lmcached.wire.connection import DaemonError
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import Clear

logger = init_logger(__name__)

EXTRA_CONFIG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "socket",
                     "daemon_name", "verify", "allow_clear")


class LmcachedStorage(HiCacheStorage):
    """SGLang HiCache storage backend over the lmcached daemon.

    Args:
        storage_config: SGLang's `HiCacheStorageConfig`. Its `extra_config` (the
            `--hicache-storage-backend-extra-config` JSON) holds the dynamic factory's
            fields and "interface_v1": 1 (SGLang then calls `batch_get_v1` /
            `batch_set_v1`), and may hold "socket" (the daemon's socket path; default: that of
            "daemon_name"), "daemon_name" (default "default"), "verify" ("tokens", the
            default, or "checksum": also a payload checksum per page), "allow_clear"
            (true: `clear()` sends the daemon's CLEAR, which empties the whole daemon,
            for every client).
        kwargs: the factory's extra arguments (unused).

    Raises:
        ValueError: an unknown extra_config key or "verify" value, or no "interface_v1"
            (the message names it).

    Attributes:
        num_exists_pages / num_hit_pages / num_miss_pages / num_stored_pages /
        num_skipped_pages: plain counters (`get_stats`).
        hook_guard: failures other than the daemon's absence, per call (`get_stats`
            "failures"; the serving core's `HookGuard`, as the vLLM connector's hooks).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"lmcached: unknown extra_config keys {unknown}; known: "
                             f"{list(EXTRA_CONFIG_KEYS)}")
        if not extra.get("interface_v1"):
            raise ValueError(
                "lmcached: add \"interface_v1\": 1 to --hicache-storage-backend-extra-config: "
                "without it SGLang moves each page through get_data_page and batch_set, a "
                "copy more per page, in another byte order than batch_set_v1 writes "
                "(docs/sglang.md)")
        self.verify = extra.get("verify", "tokens")
        if self.verify not in ("tokens", "checksum"):
            raise ValueError(f"lmcached: extra_config verify={self.verify!r}: use "
                             "\"tokens\" or \"checksum\"")
        self.storage_config = storage_config
        self.socket = extra.get("socket")
        self.daemon_name = extra.get("daemon_name", "default")
        self.allow_clear = bool(extra.get("allow_clear", False))
        self.link: DaemonLink | None = None  # gets, lookups, CLEAR
        self.store_link: DaemonLink | None = None  # stores: their own session
        self.chain: Chain | None = None
        self.page_size = 0
        self.host_runs: HostPageRuns | None = None
        self.page_bytes = 0
        self.num_exists_pages = self.num_hit_pages = self.num_miss_pages = 0
        self.num_stored_pages = self.num_skipped_pages = 0
        self.hook_guard = HookGuard()
        self.io: PageIO | None = None  # over `link`
        self.store_io: PageIO | None = None  # over `store_link`

    # ----------------------------------------------------------- namespace
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Take the host pool, derive the page namespace from it and open the session.

        The namespace (`pages.namespace_name`): the model, the pool's layout and dtype,
        the page size and the byte sizes of a page's runs, and the ranks: TP rank and
        size (MLA: none, one copy for every TP rank, as SGLang's own backends), PP,
        attention CP and DCP where they are more than one. Two sessions: one for gets
        and lookups, one for stores, so that a get (SGLang's prefetch thread) never
        waits for a store (its backup thread) copying its pages with the session held.
        A daemon that is not up yet is tried again at the next call (a miss until then).
        """
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.storage_config
        self.page_size = mem_pool_host.page_size
        self.host_runs = HostPageRuns.learn(mem_pool_host)
        sizes = self.host_runs.sizes
        self.page_bytes = self.host_runs.page_bytes
        parts = []
        if cfg.is_mla_model:
            world_size, worker_id = 1, 0
            if cfg.dcp_size > 1:
                parts.append(f"dcp{cfg.dcp_rank}of{cfg.dcp_size}")
        else:
            world_size, worker_id = cfg.tp_size, cfg.tp_rank
        if cfg.pp_size > 1:
            parts.append(f"pp{cfg.pp_rank}of{cfg.pp_size}")
        if cfg.attn_cp_size > 1:
            parts.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
        dtype = str(mem_pool_host.dtype).removeprefix("torch.")
        name = namespace_name(cfg.model_name, mem_pool_host.layout, dtype, self.page_size,
                              [int(n) for n in sizes], parts)
        layout = page_layout(name, world_size, worker_id, self.page_bytes)
        self.link = DaemonLink(self.socket, self.daemon_name, [layout.to_wire()],
                               client_name=f"sglang-tp{cfg.tp_rank}")
        self.chain = Chain(self.link, layout, self.verify)
        self.io = PageIO(self.link, self.chain, self.page_bytes, self.verify)
        self.store_link = DaemonLink(self.socket, self.daemon_name, [layout.to_wire()],
                                     client_name=f"sglang-tp{cfg.tp_rank}-store")
        self.store_io = PageIO(self.store_link, Chain(self.store_link, layout, self.verify),
                               self.page_bytes, self.verify)
        self.link.try_connect()
        self.store_link.try_connect()

    @property
    def namespace(self) -> str | None:
        """The page namespace's model name, or None before `register_mem_pool_host`."""
        return None if self.chain is None else self.chain.layout.model_name

    # ------------------------------------------------------------ v1 batch
    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading pages of `keys` the daemon holds (one LOOKUP; no pins).

        Pages on the daemon's disk tier or in L2 count: the daemon fetches them back
        into the arena while it answers (within its fetch wait). 0 when the daemon is
        unavailable.
        """
        if self.chain is None or not keys:
            return 0
        try:
            found = self.io.lookup(keys)
        except Exception as exc:  # never fail SGLang's prefetch
            return self._failed("exists", exc, 0)
        self.num_exists_pages += found
        return found

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Copy the pages of `keys` into the host pool at `host_indices` (pipelined
        ACQUIREs, `_read`).

        Args:
            keys: page keys.
            host_indices: int64 `[len(keys) * page_size]` host pool token indices.

        Returns:
            Per key, True when its page was copied; the pages after the first miss are
            False (a miss: not held, failed its check, or the pins did not hold).
        """
        num_pages = len(keys)
        if self.chain is None or not num_pages:
            return [False] * num_pages
        try:
            self._check_indices(host_indices, num_pages)
            num_ok = self.io.read(keys, lambda: self._page_runs(host_indices, num_pages))
        except Exception as exc:
            return self._failed("get", exc, [False] * num_pages)
        self.num_hit_pages += num_ok
        self.num_miss_pages += num_pages - num_ok
        return [True] * num_ok + [False] * (num_pages - num_ok)

    def _page_runs(self, host_indices: torch.Tensor, num_pages: int) -> list:
        """Per page, its (address, bytes) runs in the host pool (`HostPageRuns.runs`:
        `get_page_buffer_meta`'s answer).

        Raises:
            ValueError: host_indices do not cover `num_pages` pages of page_size tokens.
        """
        self._check_indices(host_indices, num_pages)
        return self.host_runs.runs(host_indices, num_pages)

    def _check_indices(self, host_indices: torch.Tensor, num_pages: int) -> None:
        """Raise ValueError unless host_indices cover `num_pages` pages of page_size."""
        if host_indices.numel() != num_pages * self.page_size:
            raise ValueError(f"{host_indices.numel()} host indices for {num_pages} pages "
                             f"of {self.page_size} tokens")

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store the host pool's pages at `host_indices` under `keys` (ALLOC, one copy
        per page run into the arena, COMMIT).

        Returns:
            Per key, True when its page is now held (stored, or already there); False
            when it was not stored (no space for it, or no daemon).
        """
        num_pages = len(keys)
        if self.chain is None or not num_pages:
            return [False] * num_pages
        try:
            self._check_indices(host_indices, num_pages)
            results = self.store_io.store(keys_tokens(keys),
                                        lambda: self._page_runs(host_indices, num_pages))
        except Exception as exc:
            return self._failed("set", exc, [False] * num_pages)
        stored = sum(results)
        self.num_stored_pages += stored
        self.num_skipped_pages += num_pages - stored
        return results

    # ------------------------------------------------- HiCacheStorage (tensors)
    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """The page of `key` as bytes (its runs in `get_page_buffer_meta` order), copied
        into `target_location` (a contiguous cpu tensor of page_bytes) when given, else a
        new uint8 tensor; None on a miss."""
        return self.batch_get([key], [target_location] if target_location is not None
                              else None)[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """`get` of each key, with one ACQUIRE; None from the first miss on."""
        if self.chain is None or not keys:
            return [None] * len(keys)
        try:
            targets = list(target_locations) if target_locations is not None else [
                torch.empty(self.page_bytes, dtype=torch.uint8) for _ in keys]
            if any(not t.is_contiguous() or t.device.type != "cpu"
                   or t.numel() * t.element_size() != self.page_bytes for t in targets):
                raise ValueError(f"get targets must be contiguous cpu tensors of "
                                 f"{self.page_bytes} bytes (one page)")
            num_ok = self.io.read(keys, lambda: [[(t.data_ptr(), self.page_bytes)]
                                               for t in targets])
        except Exception as exc:
            return self._failed("get", exc, [None] * len(keys))
        return [targets[i] if i < num_ok else None for i in range(len(keys))]

    def set(self, key: str, value: Optional[Any] = None,
            target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """Store `value` (a contiguous cpu tensor of page_bytes) under `key`."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store each of `values` (contiguous cpu tensors of page_bytes) under its key;
        True when every page is held."""
        if self.chain is None or not keys or values is None:
            return False
        try:
            values = list(values)
            if len(values) != len(keys) or any(
                    v is None or not v.is_contiguous() or v.device.type != "cpu"
                    or v.numel() * v.element_size() != self.page_bytes for v in values):
                raise ValueError(f"set values must be contiguous cpu tensors of "
                                 f"{self.page_bytes} bytes (one page), one per key")
            results = self.store_io.store(
                keys_tokens(keys), lambda: [[(v.data_ptr(), self.page_bytes)] for v in values])
        except Exception as exc:
            return self._failed("set", exc, False)
        return all(results)

    def exists(self, key: str) -> bool:
        """Whether the daemon holds the page of `key`."""
        return self.batch_exists([key]) == 1

    # --------------------------------------------------------------- admin
    def clear(self) -> bool:
        """Empty the daemon (CLEAR) when extra_config allows it ("allow_clear"): the
        daemon is shared with every other client, so by default nothing is dropped and
        a warning says so. Returns True once cleared."""
        if not self.allow_clear or self.link is None:
            logger.warning("lmcached: clear() drops nothing: the daemon's cache is shared "
                           "by every client of it; run `lmcached clear`, or set "
                           "\"allow_clear\": true in the extra config")
            return False
        try:
            self.link.request(Clear())
        except (CacheUnavailable, DaemonError) as exc:
            logger.warning("lmcached: CLEAR failed: %s", exc)
            return False
        return True

    def get_stats(self) -> dict:
        """This backend's counters (pages), and whether the daemon is connected (both
        sessions: gets and stores)."""
        return {
            "namespace": self.namespace,
            "connected": all(link is not None and link.hello_reply is not None
                             for link in (self.link, self.store_link)),
            "exists_pages": self.num_exists_pages,
            "hit_pages": self.num_hit_pages,
            "miss_pages": self.num_miss_pages,
            "stored_pages": self.num_stored_pages,
            "skipped_pages": self.num_skipped_pages,
            "failures": self.hook_guard.num_failures,
            "verify_failures": self.chain.num_verify_failures if self.chain else 0,
        }

    def close(self) -> None:
        """End the daemon sessions (the pages stay in the daemon)."""
        for io in (self.io, self.store_io):
            if io is not None:
                io.forget_arena()
        for link in (self.link, self.store_link):
            if link is not None:
                link.close()

    def _failed(self, what: str, exc: BaseException, default):
        """Count a failure that is not the daemon's absence (`HookGuard`: logged at most
        once a minute per call), answer `default` (a miss)."""
        self.hook_guard.caught(what, exc, "answered as a miss")
        return default
