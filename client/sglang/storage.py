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
`client/sglang/pages.py`.

Guarantees (as every lmcached client):
- a page is verified on read: its record must hold its key (`pages.key_tokens`), so a
  key never returns another key's bytes; a page evicted between `batch_exists` and
  `batch_get_v1`, or whose pins did not hold while it was copied, is a miss;
- `batch_exists` is one LOOKUP; `batch_get_v1` and `batch_set_v1` pipeline their
  requests on the session (`pipeline_parts`): the ACQUIRE (ALLOC) of the first few pages
  goes out alone and the rest's together, the host pool's page runs are read while the
  daemon answers, and a part is copied while the daemon pins (allocates) the next; a
  store sends one COMMIT of all parts but the last before it writes the last, and one
  COMMIT of the last after. The RELEASE is not waited for. One memcpy per page run
  between the host pool and the arena; each part's records are checked before any of
  its bytes is copied. A batch holds the session while replies are in flight: a get
  copies its last part after letting go, a store holds the session while it writes
  (two SGLang threads' stores take turns);
- a daemon that is down, loading or restarting is a miss (and a skipped store), never an
  exception in SGLang's cache controller: every method catches, logs once, and answers
  a miss.
"""

import functools
from typing import Any, Callable, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from lmcached.client.chain import Chain, chunks_per_request
from lmcached.client.chain.frames import wire_parent
from lmcached.client.chain.pins import PinnedChunks, Pins
from lmcached.client.daemon_link import CacheUnavailable, DaemonLink
from lmcached.client.records import RecordIO
from lmcached.client.serving.hook_guard import HookGuard
from lmcached.client.sglang.host_runs import HostPageRuns
from lmcached.client.sglang.pages import (
    copy_runs,
    keys_slots,
    keys_tokens,
    namespace_name,
    page_hash,
    page_layout,
    record_runs,
    zero_runs,
)
from lmcached.wire.connection import DaemonError
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import EXISTS, Abort, Acquire, Alloc, Clear, Commit
from lmcached.wire.record_format import ROOT_HASH
from lmcached.wire.record_format import header_rows, write_header

logger = init_logger(__name__)

# Pages of a separate first request of a batch (`pipeline_parts`), and of a separate
# last part of a store: the daemon pins (allocates) the rest while the first part is
# copied, and commits all but the last part while the last one is copied (0: none, a
# batch that fits one request is one). On the shared 2-core VM this was faster with an
# idle core for the daemon, slower when every core was busy (docs/sglang.md).
FIRST_GET_PAGES = 4
FIRST_STORE_PAGES = 8
LAST_STORE_PAGES = 8

EXTRA_CONFIG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "socket",
                     "daemon_name", "verify", "allow_clear")


def pipeline_parts(num_pages: int, per_request: int, first: int,
                   last: int | None = None) -> list[tuple[int, int]]:
    """`[start, end)` pages of each pipelined request of a batch of `num_pages`: the
    first `first` (the daemon answers it while the client hashes the rest and reads the
    page runs), then the rest in requests of at most `per_request`
    (`chunks_per_request`); with `last`, the final part has at most `last` pages (a
    store's last COMMIT is the one the caller waits for)."""
    first = min(num_pages, first, per_request)
    parts = [(0, first)] if first else []
    for start in range(first, num_pages, per_request):
        end = min(num_pages, start + per_request)
        if last and end == num_pages and end - start > last:
            parts.append((start, end - last))
            start = end - last
        parts.append((start, end))
    return parts


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
        self.link: DaemonLink | None = None
        self.chain: Chain | None = None
        self.page_size = 0
        self.host_runs: HostPageRuns | None = None
        self.runs_per_page = 0
        self.page_bytes = 0
        self.num_exists_pages = self.num_hit_pages = self.num_miss_pages = 0
        self.num_stored_pages = self.num_skipped_pages = 0
        self.hook_guard = HookGuard()
        self._rows_arena = None  # the arena `_rows` views
        self._rows: dict[tuple[int, int], np.ndarray] = {}

    # ----------------------------------------------------------- namespace
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Take the host pool, derive the page namespace from it and open the session.

        The namespace (`pages.namespace_name`): the model, the pool's layout and dtype,
        the page size and the byte sizes of a page's runs, and the ranks: TP rank and
        size (MLA: none, one copy for every TP rank, as SGLang's own backends), PP,
        attention CP and DCP where they are more than one. A daemon that is not up yet
        is tried again at the next call (a miss until then).
        """
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.storage_config
        self.page_size = mem_pool_host.page_size
        self.host_runs = HostPageRuns.learn(mem_pool_host)
        sizes = self.host_runs.sizes
        self.runs_per_page = self.host_runs.runs_per_page
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
        self.link.try_connect()

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
            hashes = [page_hash(t) for t in keys_tokens(keys)]
            found = self.chain.lookup(hashes)
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
            num_ok = self._read(keys, lambda: self._page_runs(host_indices, num_pages))
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

    @staticmethod
    def _submit_parts(snapshot, tokens: np.ndarray, parts: list[tuple[int, int]],
                      request: Callable[[list[bytes], int, int], Any]) -> list[bytes]:
        """Hash the pages of `tokens` and submit `request(hashes, start, end)` for each
        part: the first as soon as its pages are hashed, the others together after.
        Returns the page hashes."""
        hashes: list[bytes] = []
        start, end = parts[0]
        hashes += [page_hash(t) for t in tokens[start:end]]
        snapshot.submit(request(hashes, start, end))
        if len(parts) > 1:
            hashes += [page_hash(t) for t in tokens[end:]]
            snapshot.submit(*[request(hashes, a, b) for a, b in parts[1:]])
        return hashes

    def _check_indices(self, host_indices: torch.Tensor, num_pages: int) -> None:
        """Raise ValueError unless host_indices cover `num_pages` pages of page_size."""
        if host_indices.numel() != num_pages * self.page_size:
            raise ValueError(f"{host_indices.numel()} host indices for {num_pages} pages "
                             f"of {self.page_size} tokens")

    def _read(self, keys: List[str], runs_of: Callable[[], list]) -> int:
        """ACQUIRE the pages of `keys` (pipelined requests, `pipeline_parts`), check
        their records, copy the leading ones that passed into their runs; how many were
        copied (0 when the pins did not hold while copying: the bytes may be another
        page's).

        Each part's records are checked before any of its bytes is copied, and the copy
        stops at the first page that is not held or fails its check (the later parts'
        pins are released unread). `runs_of()` gives per page its destination runs; it
        is called while the daemon answers the first request. The last part is copied
        after the session's lock is let go (no reply is in flight then), so that another
        thread's batch need not wait for it.
        """
        chain, layout = self.chain, self.chain.layout
        tokens = keys_tokens(keys)
        flat = tokens.reshape(-1)
        slots = keys_slots(keys)

        def acquire(snapshot):
            parts = pipeline_parts(len(keys), chunks_per_request(
                layout, snapshot.block_bytes, len(snapshot.namespaces)), FIRST_GET_PAGES)
            hashes = self._submit_parts(
                snapshot, tokens, parts, lambda hashes, start, end: Acquire(
                    snapshot.namespaces, b"".join(hashes[start:end]),
                    wire_parent(hashes, start, ROOT_HASH)))
            runs = runs_of()  # while the daemon answers the first part
            records = chain.records(snapshot)
            verified: list[list[int]] = []
            stopped = False
            for n, (start, end) in enumerate(parts):
                spans = snapshot.collect(Acquire).spans()
                if stopped:
                    continue  # released with the others, unread
                num_ok = self._check_pages(records, spans, hashes, tokens, start, slots,
                                           snapshot.session_id)
                if n < len(parts) - 1:  # while the next parts' replies are in flight
                    copy_pages(records, start, spans[:num_ok], runs)
                verified += spans[:num_ok]
                stopped = num_ok < end - start
            run = PinnedChunks(flat, 0, verified, hashes[:len(verified)], records,
                               Pins.of(snapshot))
            last = parts[-1][0]
            return run, runs, last, verified[last:] if len(verified) > last else []

        def copy_pages(records, start: int, spans: list[list[int]], runs: list) -> None:
            arena = records.arena
            base, offset_of, block_bytes = arena.base_ptr, arena.block_offset, arena.block_bytes
            kv_offset, page_bytes = layout.kv_offset, self.page_bytes
            kv_end = kv_offset + page_bytes
            in_one_block = kv_end <= block_bytes  # the page lies in the span's first block
            copy = copy_runs  # looked up at each call (tests replace it)
            for i, span in enumerate(spans, start):
                copy(runs[i], [(base + offset_of(span[0]) + kv_offset, page_bytes)]
                     if in_one_block else
                     record_runs(base, offset_of, block_bytes, span, kv_offset, kv_end))

        acquired = self.link.call("ACQUIRE", acquire, None)
        if acquired is None:
            return 0
        run, runs, last, spans = acquired
        try:
            copy_pages(run.records, last, spans, runs)  # the last part: outside the lock
            return len(run.spans) if run.spans and run.holds_pins() else 0
        finally:
            run.release()

    def _check_pages(self, records, spans: list[list[int]], hashes: list[bytes],
                     tokens: np.ndarray, start: int, slots: int,
                     session_id: int | None) -> int:
        """How many leading records of `spans` (pages `start + i`) hold exactly their
        page (`Chain.check`'s answer).

        With verify="tokens" and one-block records, first compares only what identifies
        a page: the header (magic, token count, fingerprint, key hash) and the first
        `slots` key id slots (`pages.keys_slots`: past them every key of the batch is zero
        padding), for all of them at once (`RecordIO.verify_leading_slots`). Only when
        that stops short, or otherwise, `Chain.check` decides (it compares every slot,
        counts and warns about the failure, INVALIDATEs the record, checks checksums;
        it also reads the records of a session that maps device tiers).
        """
        end = start + len(spans)
        if (self.verify == "tokens" and isinstance(records, RecordIO)
                and all(len(span) == 1 for span in spans)):
            num_ok = records.verify_leading_slots([span[0] for span in spans],
                                                  hashes[start:end], tokens[start:end], slots)
            if num_ok == len(spans):
                return num_ok
        k = self.chain.layout.chunk_size
        return self.chain.check(records, spans, hashes[start:end], tokens.reshape(-1),
                                [(i * k, (i + 1) * k) for i in range(start, end)],
                                session_id)

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
            results = self._store(keys_tokens(keys),
                                  lambda: self._page_runs(host_indices, num_pages))
        except Exception as exc:
            return self._failed("set", exc, [False] * num_pages)
        stored = sum(results)
        self.num_stored_pages += stored
        self.num_skipped_pages += num_pages - stored
        return results

    def _store(self, tokens: np.ndarray, runs_of: Callable[[], list]) -> list[bool]:
        """Store pages (their key ids `tokens`, their source runs `runs_of()`): ALLOC in
        pipelined requests (`pipeline_parts`); each part is written as soon as its reply
        is in (the daemon allocates the next part meanwhile); one COMMIT of every part
        but the last goes out before the last part is written, and one of the last
        after. Every ALLOC is sent before the first COMMIT, so a batch never evicts its
        own first pages (they are WRITING) to make room for its last ones.

        Returns:
            Per page, True when it is now held (committed, or already there); all False
            when the daemon is unavailable or refused (a part whose COMMIT failed is
            False, the parts before it stay stored).

        Raises:
            Whatever writing a record raises, after the ABORT of what was allocated (or
            the end of the session, which aborts it, when replies were in flight).
        """
        chain, layout = self.chain, self.chain.layout
        num_pages = len(tokens)
        record_bytes = layout.record_bytes(layout.chunk_size)
        results = [False] * num_pages

        def store(snapshot) -> list[bool]:
            parts = pipeline_parts(num_pages, chunks_per_request(layout, snapshot.block_bytes),
                                   FIRST_STORE_PAGES, LAST_STORE_PAGES)
            hashes = self._submit_parts(snapshot, tokens, parts, lambda hashes, start, end: Alloc(
                snapshot.ns, b"".join(hashes[start:end]), [record_bytes] * (end - start),
                snapshot.home_tier))
            runs = runs_of()  # while the daemon answers the first part
            in_flight = len(parts)
            records = chain.records(snapshot)
            written = []  # (start, reply) of the parts written, COMMIT not sent yet
            committed = []  # the parts of each COMMIT sent
            for n, (start, end) in enumerate(parts):
                reply = snapshot.collect(Alloc)
                in_flight -= 1
                for i, status in enumerate(reply.status, start):
                    results[i] = status == EXISTS
                if reply.block_ids:
                    try:
                        if not records.maps(reply.block_ids):
                            raise ValueError(f"ALLOC answered blocks {reply.block_ids[:4]} "
                                             "that are not in the host arena this process "
                                             "maps")
                        self._write_pages(records, reply.spans(), start, hashes, tokens, runs)
                    except BaseException:
                        if not in_flight:  # else the session's end (DaemonLink.call) aborts
                            snapshot.request(Abort(reply.block_ids + [
                                ref for _, done in written for ref in done.block_ids]))
                        raise
                    written.append((start, reply))
                if written and n >= len(parts) - 2:  # before the last part, and after it
                    snapshot.submit(Commit([ref for _, done in written
                                            for ref in done.block_ids]))
                    in_flight += 1
                    committed.append(written)
                    written = []
            for group in committed:
                try:
                    snapshot.collect(Commit)
                except DaemonError as exc:
                    logger.warning("COMMIT refused, %d pages not stored: %s",
                                   sum(len(reply.status) for _, reply in group), exc)
                    continue
                for start, reply in group:
                    for i, span in enumerate(reply.spans(), start):
                        results[i] = results[i] or span is not None
            return results

        return self.link.call("ALLOC", store, None) or [False] * num_pages

    def _write_pages(self, records, spans: list, start: int, hashes: list[bytes],
                     tokens: np.ndarray, runs: list) -> None:
        """Write the records of the pages `start + i` whose `spans[i]` is not None
        (WRITING blocks of this session): all headers first (one scatter when every
        record is in one block), then each page's runs, then the zero pads; sealed with
        verify="checksum"."""
        arena, layout = records.arena, self.chain.layout
        filled = [(i, span) for i, span in enumerate(spans, start) if span is not None]
        if not filled:
            return
        record_bytes = layout.record_bytes(layout.chunk_size)
        if record_bytes > arena.block_bytes or any(len(span) != 1 for _, span in filled):
            for i, span in filled:
                self._write_page(arena, records.fingerprint, span, hashes[i], tokens[i],
                                 runs[i])
        else:
            pages = [i for i, _ in filled]
            blocks = [span[0] for _, span in filled]
            heads = header_rows(records.fingerprint, [hashes[i] for i in pages], tokens[pages])
            kv_offset, kv_end = layout.kv_offset, layout.kv_offset + self.page_bytes
            self._block_rows(arena, 0, heads.shape[1])[blocks] = heads
            base, offset_of = arena.base_ptr, arena.block_offset
            copy = copy_runs
            for i, block in zip(pages, blocks):
                copy([(base + offset_of(block) + kv_offset, self.page_bytes)], runs[i])
            if record_bytes > kv_end:
                self._block_rows(arena, kv_end, record_bytes - kv_end)[blocks] = 0
        if self.verify == "checksum":
            for _, span in filled:
                records.seal(span, layout.chunk_size)

    def _block_rows(self, arena, start: int, length: int) -> np.ndarray:
        """Writable uint8 `[num_blocks, length]`: bytes [start, start + length) of every
        block of `arena` (start + length <= block_bytes), one row per block."""
        key = (start, length)
        if self._rows_arena is not arena:
            self._rows_arena, self._rows = arena, {}
        rows = self._rows.get(key)
        if rows is None:
            first = arena.block_offset(0)
            rows = np.lib.stride_tricks.as_strided(
                arena.numpy_view(first + start, arena.capacity_bytes - first - start),
                shape=(arena.num_blocks, length), strides=(arena.block_bytes, 1))
            self._rows[key] = rows
        return rows

    def _write_page(self, arena, fingerprint: int, span: list[int], chunk_hash: bytes,
                    tokens: np.ndarray, runs: list[tuple[int, int]]) -> None:
        """Write one page's record (header, key ids, the page's runs, zero pad) into
        `span` (WRITING blocks of this session)."""
        layout = self.chain.layout
        kv_offset, record_end = layout.kv_offset, layout.record_bytes(layout.chunk_size)
        write_header(arena.numpy_view(arena.block_offset(span[0]), kv_offset),
                     fingerprint, chunk_hash, tokens)
        end = kv_offset + self.page_bytes
        place = functools.partial(record_runs, arena.base_ptr, arena.block_offset,
                                  arena.block_bytes, span)
        copy_runs(place(kv_offset, end), runs)
        zero_runs(place(end, record_end))

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
            num_ok = self._read(keys, lambda: [[(t.data_ptr(), self.page_bytes)]
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
            results = self._store(keys_tokens(keys),
                                  lambda: [[(v.data_ptr(), self.page_bytes)] for v in values])
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
        """This backend's counters (pages), and whether the daemon is connected."""
        return {
            "namespace": self.namespace,
            "connected": self.link is not None and self.link.hello_reply is not None,
            "exists_pages": self.num_exists_pages,
            "hit_pages": self.num_hit_pages,
            "miss_pages": self.num_miss_pages,
            "stored_pages": self.num_stored_pages,
            "skipped_pages": self.num_skipped_pages,
            "failures": self.hook_guard.num_failures,
            "verify_failures": self.chain.num_verify_failures if self.chain else 0,
        }

    def close(self) -> None:
        """End the daemon session (the pages stay in the daemon)."""
        self._rows_arena, self._rows = None, {}
        if self.link is not None:
            self.link.close()

    def _failed(self, what: str, exc: BaseException, default):
        """Count a failure that is not the daemon's absence (`HookGuard`: logged at most
        once a minute per call), answer `default` (a miss)."""
        self.hook_guard.caught(what, exc, "answered as a miss")
        return default
