"""A batch of SGLang pages in and out of the daemon: pipelined ACQUIRE / ALLOC + COMMIT,
the record checks and the copies between the host pool's page runs and the arena.

Why this file exists: it is the page I/O of `LmcachedStorage` (storage.py), which is
SGLang's interface; nothing here imports SGLang. A batch's requests are pipelined on the
session (`pipeline_parts`): the ACQUIRE (ALLOC) of the first few pages goes out alone
and the rest's together, the host pool's page runs are read while the daemon answers,
and a part is copied while the daemon pins (allocates) the next; a store sends one
COMMIT of all parts but the last before it writes the last, and one COMMIT of the last
after. The RELEASE is not waited for. One memcpy per page run between the host pool and
the arena; each part's records are checked before any of its bytes is copied.
"""

import functools
from typing import Any, Callable, List

import numpy as np

from lmcached.client.chain import Chain, chunks_per_request
from lmcached.client.chain.frames import wire_parent
from lmcached.client.chain.pins import PinnedChunks, Pins
from lmcached.client.daemon_link import DaemonLink
from lmcached.client.records import RecordIO
from lmcached.client.sglang.pages import (
    copy_runs,
    keys_slots,
    keys_tokens,
    page_hash,
    record_runs,
    zero_runs,
)
from lmcached.wire.connection import DaemonError
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import EXISTS, Abort, Acquire, Alloc, Commit
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


class PageIO:
    """Batches of pages of one namespace between a process's memory and the daemon.

    Args:
        link: the session (`DaemonLink`) the requests go through.
        chain: the namespace's chunk-chain core (`Chain`: its layout, records, checks).
        page_bytes: bytes of one page (the sum of its runs).
        verify: "tokens" (a record must hold its key) or "checksum" (and its payload
            checksum).
    """

    def __init__(self, link: DaemonLink, chain: Chain, page_bytes: int, verify: str):
        self.link, self.chain, self.page_bytes, self.verify = link, chain, page_bytes, verify
        self._rows_arena = None  # the arena `_rows` views
        self._rows: dict[tuple[int, int], np.ndarray] = {}

    def lookup(self, keys: List[str]) -> int:
        """How many leading pages of `keys` the daemon holds (one LOOKUP; no pins).

        Raises:
            CacheUnavailable, DaemonError: as `Chain.lookup`.
        """
        return self.chain.lookup([page_hash(t) for t in keys_tokens(keys)])

    def forget_arena(self) -> None:
        """Drop the views of the arena (at the session's end)."""
        self._rows_arena, self._rows = None, {}

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

    def read(self, keys: List[str], runs_of: Callable[[], list]) -> int:
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

    def store(self, tokens: np.ndarray, runs_of: Callable[[], list]) -> list[bool]:
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
