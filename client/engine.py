"""CacheEngine: LMCacheEngine's store / retrieve / lookup contract over the daemon.

Why this file exists: it is what every worker process uses. It keeps the seed's contract
(LMCache's `LMCacheEngine`: chunking, prefix hashing, suffix masks, two KV formats, hit
counters, an instance builder) but the cache lives in the daemon's shared memory, so a
prefix stored by any process on the node is read in place by every other one.

One request = one round trip for its metadata (ALLOC + COMMIT for a store, ACQUIRE +
RELEASE for a retrieve) and one memory copy per chunk straight between the caller's
tensors and the arena blocks; KV bytes never cross the socket. A request of more chunks
than one frame can carry is split into several protocol requests
(`chunks_per_request`), so no legal request meets the frame limit.

    store:    hash chunks -> ALLOC (daemon: EXISTS / block / NOSPACE per chunk)
              -> write header + token ids + KV into each new block -> COMMIT
    retrieve: hash chunks -> ACQUIRE (pins the cached prefix) -> check each record's
              header and token ids (and, with verify="checksum", its payload
              checksum) -> copy KV out -> RELEASE
"""

import concurrent.futures
import functools
import os
import threading
from typing import Sequence

import numpy as np
import torch

from lmcached.client.cuda import synchronize_if_cuda
from lmcached.client.daemon_link import CacheUnavailable, DaemonLink, chunks_per_request
from lmcached.client.hashing import as_token_array, hash_request_tokens
from lmcached.client.kv_io import (
    ChunkCopier,
    KVSource,
    check_out_blob,
    check_out_layers,
    copy_tensor,
    new_kv_buffer,
)
from lmcached.client.layout import KVLayout
from lmcached.client.records import RecordIO
from lmcached.client.views import RetrievedViews
from lmcached.logger import init_logger
from lmcached.protocol import (
    ALLOCATED,
    NOSPACE,
    Acquire,
    Alloc,
    DaemonError,
    Lookup,
    Release,
)

logger = init_logger(__name__)

Tokens = torch.Tensor | np.ndarray | Sequence[int]

class CacheEngine:
    """A worker's handle on the node's shared KV cache (after LMCache's LMCacheEngine).

    Create with `CacheEngine.connect(layout, ...)`. All methods are safe to call while
    the daemon is down: they behave as misses / skipped stores (one warning per
    outage) and reconnect with backoff.

    Attributes:
        layout: the KVLayout (namespace) of this engine.
        hit_tokens / miss_tokens: tokens found / not found by `retrieve` and
            `retrieve_views` (after masks).
        num_stored_chunks: chunks this engine wrote.
        num_nospace_chunks: chunks not stored because nothing was evictable.
        num_verify_failures: chunks whose record did not hold the requested tokens
            (treated as misses).
        num_checksum_failures: chunks whose record held the requested tokens but no
            payload checksum, or a wrong one (verify="checksum" only; treated as misses).
        verify: "tokens" or "checksum" (see `connect`).
    """

    def __init__(self, layout: KVLayout, link: DaemonLink, copy_threads: int | None = None,
                 verify: str = "tokens") -> None:
        _check_verify(verify)
        self.verify = verify
        self.layout = layout
        self.link = link
        self.copier = ChunkCopier(copy_threads or min(2, os.cpu_count() or 1))
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.num_stored_chunks = 0
        self.num_nospace_chunks = 0
        self.num_verify_failures = 0
        self.num_checksum_failures = 0
        self._fingerprint = layout.fingerprint
        self._records: RecordIO | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []
        self._pending_lock = threading.Lock()
        self._warned_mismatch = False
        self._warned_checksum = False

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
    ) -> "CacheEngine":
        """Open a session with the daemon and map its arena once.

        Without strict, any failure (no daemon, a socket or segment this process may
        not open, another protocol version, a layout the daemon refuses, ...) gives an
        engine that starts disconnected: one warning, then misses and skipped stores
        while it retries with backoff (see client/daemon_link.py).

        Args:
            layout: this worker's KV layout (the namespace of its chunks).
            socket: the daemon's socket path; default: that of daemon `name`
                ($LMCACHED_SOCKET, $XDG_RUNTIME_DIR/lmcached/<name>.sock, ...).
            name: daemon name (default "default").
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
                cost is measured by benchmarks/bench_engine.py).

        Raises:
            ValueError: verify is not "tokens" or "checksum"; a timeout that is not
                positive (or a bad $LMCACHED_DATA_TIMEOUT_MS).
            With strict=True only: whatever `DaemonLink.connect` raises (OSError,
                lmcached.protocol.DaemonError, posix_ipc.Error, ...).
        """
        _check_verify(verify)
        link = DaemonLink(socket, name or "default", layout.to_wire(), timeout_s,
                          f"CacheEngine({layout.model_name}, rank {layout.worker_id})",
                          data_timeout_s)
        if cuda_register:
            from lmcached.client.cuda import register_arena, unregister_arena

            link.on_attach, link.on_detach = register_arena, unregister_arena
        link.try_connect(strict)
        return cls(layout, link, copy_threads, verify)

    # ------------------------------------------------------------------ helpers
    @property
    def hit_rate(self) -> float:
        """hit_tokens / (hit_tokens + miss_tokens), 0.0 before any retrieve."""
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0

    def _record_io(self) -> RecordIO:
        """Record reader/writer for the current arena (re-made after a restart)."""
        arena = self.link.arena
        if self._records is None or self._records.arena is not arena:
            self._records = RecordIO(arena, self.layout)
        return self._records

    def _skip_tokens(self, num_tokens: int, mask, chunk_aligned: bool) -> int:
        """Leading tokens a suffix mask leaves out (a multiple of chunk_size if
        `chunk_aligned`, as the seed's store asserts; any count for a retrieve)."""
        if mask is None:
            return 0
        mask = np.asarray(mask.cpu() if isinstance(mask, torch.Tensor) else mask, dtype=bool)
        if mask.shape != (num_tokens,):
            raise ValueError(f"mask has shape {mask.shape}, tokens have ({num_tokens},)")
        skip = num_tokens - int(mask.sum())
        if mask[:skip].any() or not mask[skip:].all():
            raise ValueError("mask must be a suffix mask: False for skipped tokens, then True")
        if chunk_aligned and skip % self.layout.chunk_size:
            raise ValueError(
                f"mask skips {skip} tokens, not a multiple of chunk_size {self.layout.chunk_size}"
                " (a store mask must skip whole chunks)"
            )
        return skip

    def _chunks(self, num_tokens: int, first_chunk: int) -> list[tuple[int, int]]:
        size = self.layout.chunk_size
        return [(s, min(s + size, num_tokens)) for s in range(first_chunk * size, num_tokens, size)]

    # ------------------------------------------------------------------- lookup
    def lookup(self, tokens: Tokens) -> int:
        """Number of leading tokens of `tokens` whose chunks are cached (no side effects).

        Returns:
            0 when the daemon is unavailable.
        """
        token_array = as_token_array(tokens)
        hashes = hash_request_tokens(self.layout.chunk_size, token_array)
        if not hashes:
            return 0
        link = self.link
        num_chunks = 0
        try:
            with link.lock:
                hello = link.ensure_connected()
                per_request = chunks_per_request(self.layout, hello.block_bytes)
                for pos in range(0, len(hashes), per_request):
                    batch = hashes[pos : pos + per_request]
                    found = link.request(Lookup(hello.ns, b"".join(batch)), hello.generation)
                    num_chunks += found.num_chunks
                    if found.num_chunks < len(batch):
                        break
        except CacheUnavailable:
            return 0
        except DaemonError as exc:
            logger.warning("LOOKUP refused: %s", exc)
            return 0
        return min(num_chunks * self.layout.chunk_size, len(token_array))

    # -------------------------------------------------------------------- store
    def store(self, tokens: Tokens, kv, mask=None, skip_existing: bool = True,
              blocking: bool = True) -> int:
        """Store the KV of `tokens`, chunk by chunk, writing only chunks not yet cached.

        Args:
            tokens: `[num_tokens]` token ids (int tensor, numpy array or list).
            kv: the KV of the tokens in any form `KVSource` accepts: a blob
                `[num_layers, 2, T, num_kv_heads, head_size]` (vllm) /
                `[num_layers, 2, num_kv_heads, T, head_size]` (huggingface), a tuple of
                per-layer (K, V), or a DynamicCache; dtype = layout.dtype; T is
                num_tokens, or the number of tokens the mask keeps.
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

        Returns:
            Chunks written now (0 when all were cached, the daemon is down, or
            blocking=False). Fewer than requested when the arena is full of pinned data.
            A request of more than `chunks_per_request` chunks is stored in several
            protocol requests, each a prefix of the rest.

        Raises:
            ValueError / TypeError: tokens, kv or mask do not match each other or the
                layout, or the mask does not skip whole chunks (nothing is stored).
        """
        token_array = as_token_array(tokens)
        num_tokens = len(token_array)
        skip = self._skip_tokens(num_tokens, mask, chunk_aligned=True)
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
        if blocking:
            return self._store_now(token_array, source, skip, kv_start)
        with self._pending_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="lmcached-store"
                )
            self._pending.append(
                self._executor.submit(self._store_now, token_array, source, skip, kv_start)
            )
        return 0

    def flush(self) -> int:
        """Wait for every background store (blocking=False). Returns chunks they wrote."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        return sum(future.result() for future in pending)

    def _store_now(self, tokens: np.ndarray, source: KVSource, skip: int, kv_start: int) -> int:
        layout = self.layout
        first_chunk = skip // layout.chunk_size
        chunks = self._chunks(len(tokens), first_chunk)
        hashes = hash_request_tokens(layout.chunk_size, tokens)[first_chunk:]
        return self._store_from(tokens, source, kv_start, hashes, chunks, 0)

    def _store_from(self, tokens: np.ndarray, source: KVSource, kv_start: int,
                    hashes: list[bytes], chunks: list[tuple[int, int]], pos: int) -> int:
        """ALLOC and fill the chunks from `pos` that one request may carry, store the
        chunks after them, then COMMIT.

        The chunks after this request's are stored (recursively) while its blocks are
        still WRITING, which nothing evicts: a store split into several requests never
        evicts its own beginning to make room for its end, and gets NOSPACE where one
        request would. The end of the chain is committed first, so it is evicted first.

        Returns:
            Chunks written and committed from `pos` on (0 when the daemon is unavailable
            or refused).
        """
        layout, link = self.layout, self.link
        try:
            with link.lock:
                hello = link.ensure_connected()
                end = min(len(hashes), pos + chunks_per_request(layout, hello.block_bytes))
                nbytes = [layout.record_bytes(e - s) for s, e in chunks[pos:end]]
                reply = link.request(Alloc(hello.ns, b"".join(hashes[pos:end]), nbytes),
                                     hello.generation)
                generation, records = hello.generation, self._record_io()
        except CacheUnavailable:
            return 0
        except DaemonError as exc:
            logger.warning("ALLOC refused, chunks not stored: %s", exc)
            return 0
        writes, seals = [], []
        cursor = 0
        for status, chunk_hash, (start, stop), span_len in zip(
            reply.status, hashes[pos:end], chunks[pos:end], _spans_for(reply)
        ):
            if status != ALLOCATED:
                continue
            span = reply.block_ids[cursor : cursor + span_len]
            cursor += span_len
            writes.append(functools.partial(records.write, span, chunk_hash, tokens[start:stop],
                                            source, start - kv_start, stop - kv_start))
            if self.verify == "checksum":
                seals.append(functools.partial(records.seal, span, stop - start))
        written, num_nospace, num_later = len(writes), reply.status.count(NOSPACE), 0

        def fill() -> None:
            nonlocal num_later
            self.copier.run(writes)
            synchronize_if_cuda(source.any_tensor)  # device-to-host copies done before COMMIT
            self.copier.run(seals)  # checksums of the final bytes, before COMMIT
            if end < len(hashes) and not num_nospace:
                num_later = self._store_from(tokens, source, kv_start, hashes, chunks, end)

        if not link.fill_and_commit(reply.block_ids, generation, fill):
            return num_later
        if num_nospace:
            num_nospace += len(hashes) - end  # never asked for: they would not fit either
            logger.debug(
                "stored %d of %d new chunks: the arena is full of pinned data",
                written, written + num_nospace,
            )
        self.num_stored_chunks += written
        self.num_nospace_chunks += num_nospace
        return written + num_later

    # ----------------------------------------------------------------- retrieve
    def _acquire(self, token_array: np.ndarray, first_chunk: int):
        """ACQUIRE the cached run of chunks from chunk `first_chunk`, and verify their records.

        A run longer than `chunks_per_request` is acquired by several requests, until
        one finds less than it asked for.

        Returns:
            (block ids pinned by each ACQUIRE, spans of the verified chunks, their chunk
            ranges, generation, RecordIO), or None when the daemon is unavailable or
            refused (nothing stays pinned).
        """
        layout = self.layout
        hashes = hash_request_tokens(layout.chunk_size, token_array)[first_chunk:]
        if not hashes:
            return None
        link = self.link
        pinned: list[list[int]] = []
        spans: list[list[int]] = []
        try:
            with link.lock:
                hello = link.ensure_connected()
                generation, records = hello.generation, self._record_io()
                per_request = chunks_per_request(layout, hello.block_bytes)
                for pos in range(0, len(hashes), per_request):
                    batch = hashes[pos : pos + per_request]
                    reply = link.request(Acquire(hello.ns, b"".join(batch)), generation)
                    pinned.append(reply.block_ids)
                    cursor = 0
                    for span_len in reply.num_blocks:
                        spans.append(reply.block_ids[cursor : cursor + span_len])
                        cursor += span_len
                    if len(reply.num_blocks) < len(batch):
                        break
        except CacheUnavailable:
            return None  # the session ended: its pins went with it
        except DaemonError as exc:
            logger.warning("ACQUIRE refused: %s", exc)
            self._release(pinned, generation)
            return None
        chunks = self._chunks(len(token_array), first_chunk)
        num_ok = records.verify_prefix(spans, hashes, token_array, chunks, self._fingerprint)
        if num_ok < len(spans):
            self._count_mismatch(spans[num_ok])
        if self.verify == "checksum" and num_ok:
            num_ok = self._verify_checksums(records, spans[:num_ok], chunks[:num_ok])
        return pinned, spans[:num_ok], chunks[:num_ok], generation, records

    def _count_mismatch(self, span: list[int]) -> None:
        self.num_verify_failures += 1
        if not self._warned_mismatch:
            self._warned_mismatch = True
            logger.warning(
                "block %s does not hold the requested tokens (hash collision or corrupted "
                "index): treated as a miss; further mismatches are only counted", span,
            )

    def _verify_checksums(self, records: RecordIO, spans: list[list[int]],
                          chunks: list[tuple[int, int]]) -> int:
        """How many leading records carry a matching payload checksum (copy threads).

        A failure is counted and warned about once; the records after it are not
        served (a retrieve returns a prefix).
        """
        ok = [False] * len(spans)

        def check(i: int, span: list[int], num_tokens: int) -> None:
            ok[i] = records.checksum_ok(span, num_tokens)

        self.copier.run([functools.partial(check, i, span, end - start)
                         for i, (span, (start, end)) in enumerate(zip(spans, chunks))])
        if all(ok):
            return len(spans)
        num_ok = ok.index(False)
        self.num_checksum_failures += 1
        if not self._warned_checksum:
            self._warned_checksum = True
            logger.warning(
                "block %s holds the requested tokens but no payload checksum or a wrong one "
                "(written by an engine without verify='checksum', or its KV bytes changed "
                "after COMMIT): treated as a miss; further failures are only counted",
                spans[num_ok],
            )
        return num_ok

    def _release(self, pinned: list[list[int]], generation: int) -> None:
        """RELEASE the blocks of each ACQUIRE (one RELEASE each: each fits in a frame)."""
        for block_ids in pinned:
            if not block_ids:
                continue
            try:
                self.link.request(Release(block_ids), generation)
            except CacheUnavailable:
                return  # the daemon is gone or restarted: its pins went with it
            except DaemonError as exc:
                logger.warning("RELEASE refused: %s", exc)

    def retrieve(self, tokens: Tokens, mask=None, return_tuple: bool = True, out=None):
        """Copy out the KV of the longest cached prefix of `tokens` (after the mask).

        Seed semantics (LMCache's `LMCacheEngine.retrieve`): the mask is a suffix mask
        of any length; the chunks from the one holding the first masked-in token are
        looked up, and the masked tokens of that first chunk are dropped from the result.

        Args:
            tokens: `[num_tokens]` token ids.
            mask: optional bool suffix mask `[num_tokens]`: False for the leading
                `skip` tokens not to retrieve, then True. `skip` need not be a
                multiple of chunk_size.
            return_tuple: True: a tuple of per-layer (K, V), each `[n, num_kv_heads,
                head_size]` (vllm) or `[num_kv_heads, n, head_size]` (huggingface);
                False: one blob `layout.chunk_shape(n)`.
            out: optional destination with room for every retrieved token: a blob
                (token dim >= n) or a tuple of per-layer (K, V) buffers; results are
                views of it (no allocation).

        Returns:
            (kv, ret_mask): kv holds the n tokens `tokens[skip : skip + n]`, or is the
            empty tuple `()` when nothing was found (whatever return_tuple is, as in the
            seed); ret_mask is a bool tensor `[num_tokens]`, True for those n tokens.

        Raises:
            ValueError: a mask that is not a suffix mask of `[num_tokens]`, or `out` too
                small / of the wrong shape or dtype.
        """
        token_array = as_token_array(tokens)
        num_tokens = len(token_array)
        skip = self._skip_tokens(num_tokens, mask, chunk_aligned=False)
        ret_mask = torch.zeros(num_tokens, dtype=torch.bool)
        acquired = (self._acquire(token_array, skip // self.layout.chunk_size)
                    if num_tokens > skip else None)
        if acquired is None:
            self.miss_tokens += num_tokens - skip
            return (), ret_mask
        pinned, spans, chunks, generation, records = acquired
        num_hit = chunks[-1][1] - skip if chunks else 0
        try:
            kv = self._copy_out(records, spans, chunks, skip, num_hit, return_tuple, out)
        finally:
            self._release(pinned, generation)
        self.hit_tokens += num_hit
        self.miss_tokens += num_tokens - skip - num_hit
        ret_mask[skip : skip + num_hit] = True
        if num_hit == 0:
            return (), ret_mask
        return kv, ret_mask

    def _copy_out(self, records: RecordIO, spans, chunks, skip: int, num_hit: int,
                  return_tuple: bool, out):
        """Copy tokens [skip, skip + num_hit) out of the records of `chunks` (the first
        chunk may start before `skip`: its leading tokens are dropped)."""
        layout = self.layout
        token_dim = layout.token_dim
        if isinstance(out, (tuple, list)):
            layer_token_dim = token_dim - 2
            check_out_layers(out, layout, num_hit)

            def copy_to_layers(span, start, end):
                first = max(start, skip)
                # chunk_shape(end - first): the record without the tokens before `skip`
                record = records.read_kv(span, end - start).narrow(token_dim, first - start,
                                                                   end - first)
                for layer, (k_out, v_out) in enumerate(out):
                    for dst, src in ((k_out, record[layer, 0]), (v_out, record[layer, 1])):
                        copy_tensor(dst.narrow(layer_token_dim, first - skip, end - first), src)

            self.copier.run([functools.partial(copy_to_layers, span, start, end)
                             for span, (start, end) in zip(spans, chunks)])
            synchronize_if_cuda(out[0][0])  # host-to-device copies done before RELEASE
            return tuple(
                (k.narrow(layer_token_dim, 0, num_hit), v.narrow(layer_token_dim, 0, num_hit))
                for k, v in out
            )
        if out is None:
            blob = new_kv_buffer(layout.chunk_shape(num_hit), layout.torch_dtype)
        else:
            check_out_blob(out, layout, num_hit)
            blob = out.narrow(token_dim, 0, num_hit)
        tasks = []
        for span, (start, end) in zip(spans, chunks):
            first = max(start, skip)
            dst = blob.narrow(token_dim, first - skip, end - first)
            tasks.append(functools.partial(_copy_record, dst, records, span, end - start,
                                           first - start))
        self.copier.run(tasks)
        synchronize_if_cuda(blob)  # host-to-device copies done before RELEASE
        if return_tuple:
            return tuple((blob[layer, 0], blob[layer, 1]) for layer in range(layout.num_layers))
        return blob

    def retrieve_views(self, tokens: Tokens, mask=None) -> RetrievedViews:
        """Pin the cached prefix and return zero-copy views of its arena blocks.

        Use as a context manager; the blocks stay pinned (never evicted or reused)
        until exit. `.chunks` raises after exit; tensors taken from it before then
        must not be used afterwards (their bytes may be reused). With
        verify="checksum" the payloads are checked once, here; the views then read the
        arena in place.

        The mask has `retrieve`'s semantics: a suffix mask of any length; the first
        view starts at the first masked-in token (a narrowed view of its chunk).

        Returns:
            RetrievedViews with `.chunks` (one view per chunk,
            `layout.chunk_shape(chunk_tokens)`, layout.dtype, cpu (arena); the first
            one without the masked tokens of its chunk), `.num_tokens`, `.start_token`
            (the mask's skip), `.block_ids`.

        Raises:
            ValueError: bad mask, or chunks of this layout span several blocks (the
                daemon's --block-size is smaller than a chunk): use `retrieve`.
        """
        layout = self.layout
        token_array = as_token_array(tokens)
        skip = self._skip_tokens(len(token_array), mask, chunk_aligned=False)
        hello = self.link.hello_reply
        if hello is not None and self.layout.record_bytes(self.layout.chunk_size) > hello.block_bytes:
            raise ValueError(
                f"a chunk record of {self.layout.record_bytes(self.layout.chunk_size)} bytes spans "
                f"several {hello.block_bytes}-byte blocks: zero-copy views need one block per "
                "chunk (start the daemon without --block-size, or use retrieve())"
            )
        acquired = (self._acquire(token_array, skip // layout.chunk_size)
                    if len(token_array) > skip else None)
        if acquired is None:
            self.miss_tokens += len(token_array) - skip
            return RetrievedViews([], [], skip, 0, None)
        pinned, spans, chunks, generation, records = acquired
        views = [records.kv_view(span[0], end - start) for span, (start, end) in zip(spans, chunks)]
        if views and chunks[0][0] < skip:
            dropped = skip - chunks[0][0]  # masked tokens of the first chunk
            views[0] = views[0].narrow(layout.token_dim, dropped,
                                       views[0].shape[layout.token_dim] - dropped)
        num_hit = chunks[-1][1] - skip if chunks else 0
        self.hit_tokens += num_hit
        self.miss_tokens += len(token_array) - skip - num_hit
        return RetrievedViews(
            views, [block_id for block_ids in pinned for block_id in block_ids], skip, num_hit,
            lambda: self._release(pinned, generation), layout.token_dim, self.copier,
        )

    # -------------------------------------------------------------------- close
    def close(self) -> None:
        """Finish background stores, end the session (pins are released), unmap."""
        try:
            self.flush()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self.copier.close()
            self._records = None
            self.link.close()

    def __enter__(self) -> "CacheEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_verify(verify: str) -> None:
    if verify not in ("tokens", "checksum"):
        raise ValueError(f'verify must be "tokens" or "checksum", got {verify!r}')


def _copy_record(dst: torch.Tensor, records: RecordIO, span: list[int], num_tokens: int,
                 first: int) -> None:
    """dst = tokens [first, first + dst's token count) of the record of a `num_tokens` chunk."""
    token_dim = records.layout.token_dim
    copy_tensor(dst, records.read_kv(span, num_tokens).narrow(token_dim, first, dst.shape[token_dim]))


def _spans_for(reply) -> list[int]:
    """Blocks per chunk of an AllocReply, aligned with its status list (0 if not ALLOCATED)."""
    num_blocks = iter(reply.num_blocks)
    return [next(num_blocks) if status == ALLOCATED else 0 for status in reply.status]
