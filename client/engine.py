"""CacheEngine: LMCacheEngine's store / retrieve / lookup contract over the daemon.

Why this file exists: it is what every worker process uses. It keeps the seed's contract
(LMCache's `LMCacheEngine`: chunking, prefix hashing, suffix masks, two KV formats, hit
counters, an instance builder) but the cache lives in the daemon's shared memory, so a
prefix stored by any process on the node is read in place by every other one.

Daemon round trips: a store is two (ALLOC, then COMMIT once the bytes are written); a
retrieve is one (ACQUIRE; its RELEASE is sent without waiting for a reply), and a
`lookup(tokens, pin=True)` followed by the retrieve of the same tokens is one in all
(the retrieve reuses the lookup's hashes and pins). Each chunk is one memory copy
straight between the caller's tensors and the arena blocks; KV bytes never cross the
socket. A request of more chunks than one frame can carry is split into several
protocol requests (`chunks_per_request`), so no legal request meets the frame limit.

    store:    hash chunks -> ALLOC (daemon: EXISTS / block / NOSPACE per chunk)
              -> write header + token ids + KV into each new block -> COMMIT
    retrieve: hash chunks -> ACQUIRE (pins the cached prefix under a lease) -> check
              each record's header and token ids (and, with verify="checksum", its
              payload checksum) -> copy KV out -> RELEASE the lease (no reply)

The chunk-chain requests and record checks are in client/chain/ (`Chain`, shared with
the vLLM worker); pinned lookups and the copies out, in client/retrieve.py; the read
methods (acquire, retrieve, retrieve_views), in client/engine_retrieve.py.
"""

import concurrent.futures
import functools
import os
import threading
from typing import Callable

import numpy as np

from lmcached.client.chain import Chain, chain_parents, check_verify, chunk_ranges
from lmcached.client.cuda import synchronize_if_cuda
from lmcached.client.daemon_link import DaemonLink
from lmcached.client.engine_retrieve import EngineRetrieve
from lmcached.client.hashing import Tokens, as_token_array, hash_request_tokens, root_hash
from lmcached.client.kv_io import ChunkCopier, KVSource, after_caller_stream, suffix_mask_skip
from lmcached.client.layout import KVLayout
from lmcached.client.retrieve import PinnedLookups
from lmcached.wire.logger import init_logger
from lmcached.wire.record_format import ROOT_HASH

logger = init_logger(__name__)


class CacheEngine(EngineRetrieve):
    """A worker's handle on the node's shared KV cache (after LMCache's LMCacheEngine).

    Create with `CacheEngine.connect(layout, ...)`. All methods are safe to call while
    the daemon is down: they behave as misses / skipped stores (one warning per
    outage) and reconnect with backoff.

    Attributes:
        layout: the KVLayout (namespace) of this engine.
        hit_tokens / miss_tokens: tokens found / not found by `retrieve` and
            `retrieve_views`; tokens a mask leaves out count as neither.
        num_stored_chunks: chunks this engine wrote.
        num_nospace_chunks: chunks not stored because nothing was evictable.
        num_verify_failures: chunks whose record did not hold the requested tokens
            (treated as misses).
        num_checksum_failures: chunks whose record held the requested tokens but no
            payload checksum, or a wrong one (verify="checksum" only; treated as misses).
        num_stale_pins: pinned runs given up because their pins no longer held when
            they were read (their daemon session ended: a timeout, --idle-timeout, a
            restart); read again from the daemon, or a miss.
        verify: "tokens" or "checksum" (see `connect`).
    """

    def __init__(self, layout: KVLayout, link: DaemonLink, copy_threads: int | None = None,
                 verify: str = "tokens") -> None:
        self.copier = ChunkCopier(copy_threads or min(2, os.cpu_count() or 1))
        self.chain = Chain(link, layout, verify, self.copier)
        self.verify = verify
        self.layout = layout
        self.link = link
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.num_stale_pins = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []
        self._pending_lock = threading.Lock()
        self._warned_stale = False
        self._pinned_lookups = PinnedLookups()
        self._connect_options: dict | None = None  # set by connect(), for sibling()
        self._siblings: dict[KVLayout, CacheEngine] = {}

    @classmethod
    def connect(
        cls,
        layout: KVLayout,
        socket: str | None = None,
        name: str | None = None,
        timeout_s: float = 10.0,
        strict: bool = False,
        copy_threads: int | None = None,
        cuda_register: bool = False,
        data_timeout_s: float | None = None,
        verify: str = "tokens",
        tier_device: str | None = None,
    ) -> "CacheEngine":
        """Open a session with the daemon and map its arena once.

        Without strict, any failure (no daemon, a socket or segment this process may
        not open, another protocol version, a layout the daemon refuses, ...) gives an
        engine that starts disconnected: one warning, then misses and skipped stores
        while it retries with backoff (see client/daemon_link.py).

        Args:
            layout: this worker's KV layout (the namespace of its chunks).
            socket: the daemon's socket path; default: where daemon `name` listens, found
                as the CLI finds it ($LMCACHED_SOCKET, else the first of
                /run/lmcached/<name>.sock, $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/lmcached,
                /tmp/lmcached-<uid> where a daemon answers:
                lmcached.wire.socket_path.daemon_socket_paths), looked up at each connect.
            name: daemon name (default: $LMCACHED_NAME, else "default").
            timeout_s: timeout of this first connect and HELLO, seconds.
            strict: raise when the session cannot be opened now, instead of starting
                disconnected (misses) and reconnecting later.
            copy_threads: threads that copy a request's chunks (default: 2, or 1 on a
                one-core machine).
            cuda_register: page-lock the arena for CUDA (cudaHostRegister) so that
                copies between GPU tensors and the arena run by DMA (see client/cuda.py).
            data_timeout_s: timeout of each serving-path request (LOOKUP, ACQUIRE,
                ALLOC, COMMIT, RELEASE) and of reconnects, seconds (None:
                $LMCACHED_DATA_TIMEOUT_MS, else 0.2).
            verify: what a reader checks before it serves a record. "tokens" (default):
                layout, chunk hash and token ids. "checksum": also the record's payload
                checksum (xxh3-64 of token ids and KV), and this engine writes one into
                every record it stores; a record without one, or with a wrong one, is a
                miss counted in `num_checksum_failures` (README, "Trust model"; the
                cost is measured by benchmarks/engine/bench_engine.py).
            tier_device: the UUID of a device whose tier the daemon has (`lmcached serve
                --gpu-capacity`; "fake-0" with `--gpu-backend fake`): its memory is
                mapped once, new chunks are stored there while it has empty blocks (else
                in the host arena), and reads come from it first (docs/architecture.md,
                "Tiers"). A tier that cannot be mapped here is warned about once and
                the engine uses the host arena. None: the host arena only.

        Raises:
            ValueError: verify is not "tokens" or "checksum"; a timeout that is not
                positive (or a bad $LMCACHED_DATA_TIMEOUT_MS).
            With strict=True only: whatever `DaemonLink.connect` raises (OSError, e.g.
                lmcached.wire.socket_path.NoDaemonError listing every place looked at;
                lmcached.wire.connection.DaemonError, posix_ipc.Error, ...).
        """
        check_verify(verify)
        if tier_device and verify == "checksum":
            raise ValueError("verify='checksum' reads every record on the CPU: it cannot be "
                             "combined with tier_device (use verify='tokens')")
        link = DaemonLink(socket, name, [layout.to_wire()], timeout_s,
                          f"CacheEngine({layout.model_name}, rank {layout.worker_id})",
                          data_timeout_s, [tier_device] if tier_device else ())
        if cuda_register:
            from lmcached.client.cuda import register_arena, unregister_arena

            link.on_attach, link.on_detach = register_arena, unregister_arena
        link.try_connect(strict)
        engine = cls(layout, link, copy_threads, verify)
        engine._connect_options = dict(
            socket=socket, name=name, timeout_s=timeout_s, copy_threads=copy_threads,
            cuda_register=cuda_register, data_timeout_s=data_timeout_s, verify=verify,
            tier_device=tier_device)
        return engine

    def sibling(self, layout: KVLayout) -> "CacheEngine":
        """An engine of another namespace on the same daemon, with this engine's options
        (a session of its own, opened on the first call per layout, closed by `close`);
        e.g. `blend_prefill` keeps documents in the segment namespace (client/blend/
        segments.py) when given an engine of `layout_for_model`.

        Args:
            layout: the sibling's KVLayout; this engine's own layout returns self.

        Raises:
            ValueError: this engine was not made by `CacheEngine.connect`.
        """
        if layout == self.layout:
            return self
        if self._connect_options is None:
            raise ValueError("sibling() needs an engine made by CacheEngine.connect (it "
                             "reuses its socket and options)")
        sibling = self._siblings.get(layout)
        if sibling is None:
            sibling = CacheEngine.connect(layout, **self._connect_options)
            self._siblings[layout] = sibling
        return sibling

    # ------------------------------------------------------------------ helpers
    @property
    def hit_rate(self) -> float:
        """hit_tokens / (hit_tokens + miss_tokens), 0.0 before any retrieve."""
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0

    @property
    def num_stored_chunks(self) -> int:
        """Chunks this engine wrote (see the class attributes)."""
        return self.chain.num_stored_chunks

    @property
    def num_nospace_chunks(self) -> int:
        """Chunks not stored because nothing was evictable."""
        return self.chain.num_nospace_chunks

    @property
    def num_verify_failures(self) -> int:
        """Chunks whose record did not hold the requested tokens."""
        return self.chain.num_verify_failures

    @property
    def num_checksum_failures(self) -> int:
        """Reads whose records held the tokens but no or a wrong payload checksum."""
        return self.chain.num_checksum_failures

    # ------------------------------------------------------------------- lookup
    def lookup(self, tokens: Tokens, pin: bool = False, cache_salt: str | None = None) -> int:
        """Number of leading tokens of `tokens` whose chunks are cached.

        Args:
            tokens: `[num_tokens]` token ids.
            pin: False: a LOOKUP (no pins, no LRU change). True (after LMCache's
                `lookup(..., pin=True)`): ACQUIRE and verify the cached prefix and keep
                it pinned for the next `retrieve` / `retrieve_views` of the same tokens,
                which then reuses its hashes and pins (no further wait on the daemon);
                `lookup_unpin` gives up pins that will not be retrieved (the oldest are
                unpinned beyond MAX_PINNED_LOOKUPS). With pin=True the count covers only
                records that passed verification.
            cache_salt: the request's cache salt (a tenant; vLLM's `cache_salt`), or
                None. It enters the chain's root hash (client/hashing.py): only stores
                under the same salt are found, and chunks stored with a salt are found
                by no unsalted request. The same keyword on `store`, `retrieve`,
                `retrieve_views`, `acquire` and `lookup_unpin`.

        Returns:
            0 when the daemon is unavailable.

        Raises:
            ValueError / TypeError: an empty or non-str cache_salt.
        """
        token_array = as_token_array(tokens)
        if pin:
            run = self._acquire(token_array, 0, cache_salt)
            if run is None:
                return 0
            self._pinned_lookups.add(run)
            return run.chunks[-1][1] if run.chunks else 0
        hashes = hash_request_tokens(self.layout.chunk_size, token_array, cache_salt)
        if not hashes:
            return 0

        num_chunks = self.chain.lookup(hashes, root_hash(cache_salt), cache_salt)
        return min(num_chunks * self.layout.chunk_size, len(token_array))

    def lookup_unpin(self, tokens: Tokens | None = None, cache_salt: str | None = None) -> int:
        """Unpin what `lookup(tokens, pin=True)` pinned and no retrieve used.

        Args:
            tokens: the looked-up tokens; None: every pinned lookup of this engine.
            cache_salt: the salt they were looked up under (see `lookup`).

        Returns:
            Pinned lookups released.
        """
        return self._pinned_lookups.drop(None if tokens is None else as_token_array(tokens),
                                         cache_salt)

    # -------------------------------------------------------------------- store
    def store(self, tokens: Tokens, kv, mask=None, skip_existing: bool = True,
              blocking: bool = True, cache_salt: str | None = None) -> int:
        """Store the KV of `tokens`, chunk by chunk, writing only chunks not yet cached.

        Args:
            tokens: `[num_tokens]` token ids (int tensor, numpy array or list).
            kv: the KV of the tokens in any form `KVSource` accepts: a blob
                `[num_layers, 2, T, num_kv_heads, head_size]` (vllm) /
                `[num_layers, 2, num_kv_heads, T, head_size]` (huggingface), a tuple of
                per-layer (K, V), or a DynamicCache; dtype = layout.dtype; T is
                num_tokens, or the number of tokens the mask keeps. KV on a CUDA
                device is read after the work queued on the caller's current stream
                when `store` is called (`kv_io.after_caller_stream`).
            mask: optional bool suffix mask `[num_tokens]`; the False prefix is not
                stored (its KV need not be passed). As in the seed's store, it must
                skip whole chunks (a multiple of chunk_size).
            skip_existing: kept for the seed's signature, and ignored (a deliberate
                deviation): chunks are content-addressed by their prefix hash and
                never overwritten, so a cached chunk is always skipped and
                skip_existing=False changes nothing (the seed would rewrite it with
                equal bytes).
            blocking: False copies and commits on a background thread and returns 0 at
                once; `flush()` waits and returns the chunks written. The caller must
                not modify `kv` until then.
            cache_salt: the request's cache salt, or None (see `lookup`).

        Returns:
            Chunks written now (0 when all were cached, the daemon is down, or
            blocking=False). Fewer than requested when the arena is full of pinned data.
            A request of more than `chunks_per_request` chunks is stored in several
            protocol requests, each a prefix of the rest.

        Raises:
            ValueError / TypeError: tokens, kv or mask do not match each other or the
                layout, or the mask does not skip whole chunks, or an empty or non-str
                cache_salt (nothing is stored).
        """
        root_hash(cache_salt)  # a bad salt raises here, not on the store thread
        token_array = as_token_array(tokens)
        num_tokens = len(token_array)
        skip = suffix_mask_skip(mask, num_tokens, self.layout.chunk_size)
        source = KVSource(kv, self.layout)
        if source.num_tokens == num_tokens:
            kv_start = 0
        elif source.num_tokens == num_tokens - skip:
            kv_start = skip
        else:
            raise ValueError(
                f"KV covers {source.num_tokens} tokens; expected {num_tokens} (all tokens) or "
                f"{num_tokens - skip} (the tokens the mask keeps)"
            )
        if num_tokens == skip:
            return 0
        # The copy threads wait for the kernels queued so far on this thread's stream.
        order = after_caller_stream(source.any_tensor)
        if blocking:
            return self._store_now(token_array, source, skip, kv_start, cache_salt, order)
        with self._pending_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="lmcached-store"
                )
            self._pending.append(
                self._executor.submit(self._store_now, token_array, source, skip, kv_start,
                                      cache_salt, order)
            )
        return 0

    def flush(self) -> int:
        """Wait for every background store (blocking=False). Returns chunks they wrote."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        return sum(future.result() for future in pending)

    def _store_now(self, tokens: np.ndarray, source: KVSource, skip: int, kv_start: int,
                   salt: str | None = None, order: Callable[[], None] = lambda: None) -> int:
        """Store the chunks from the one holding token `skip` (`Chain.store`); the KV of
        token t is `source`'s token t - kv_start; chunks hashed under cache salt `salt`.
        Each chunk's copy first calls `order()` on the thread that copies it
        (`after_caller_stream` of the caller that submitted the store)."""
        layout = self.layout
        first_chunk = skip // layout.chunk_size
        chunks = chunk_ranges(len(tokens), layout.chunk_size, first_chunk)
        all_hashes = hash_request_tokens(layout.chunk_size, tokens, salt)
        hashes = all_hashes[first_chunk:]
        parent = all_hashes[first_chunk - 1] if first_chunk else ROOT_HASH  # salted or not

        def write(records, span: list[int], i: int) -> None:
            start, stop = chunks[i]
            order()
            records.write(span, hashes[i], tokens[start:stop], source, start - kv_start,
                          stop - kv_start)

        return self.chain.store(hashes, [stop - start for start, stop in chunks], write,
                                functools.partial(synchronize_if_cuda, source.any_tensor),
                                chain_parents(hashes, parent))

    # -------------------------------------------------------------------- close
    def close(self) -> None:
        """Finish background stores, end the session (pins are released), unmap; the
        same for every `sibling`."""
        siblings, self._siblings = list(self._siblings.values()), {}
        for sibling in siblings:
            sibling.close()
        try:
            self.flush()
            self._pinned_lookups.drop()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self.copier.close()
            self.chain.forget()
            self.link.close()

    def __enter__(self) -> "CacheEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
