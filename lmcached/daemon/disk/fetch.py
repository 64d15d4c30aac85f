"""The disk tier's fetches: the run of a chain the disk holds, read back into arena blocks.

Why this file exists: it is the read half of the disk tier (`tier.py` owns the file,
the index and the threads; `writes.py` is the write half). `DiskFetches` is a part of
`DiskTier` with no state of its own: `start_fetch` and `_finish_reads` run on the loop
thread, `_read` on the reader threads, where it touches no block metadata, only the
bytes of the WRITING blocks the loop allocated for it.
"""

import time

import numpy as np

from lmcached.daemon.disk.index import DiskKey
from lmcached.daemon.disk.slots import error_kind, round_up
from lmcached.daemon.spill.envelope import VerifyError, verify_parts
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import KVCacheBlock
from lmcached.wire.protocol import UNCHAINED_FORMATS
from lmcached.daemon.spill.tier import FetchRequest

MAX_FETCH_JOBS = 8  # fetches in flight; beyond, a miss is answered at once
MAX_FETCH_BYTES = 1 << 30  # records one fetch reads at most (a longer run: the next lookup)
READ_BATCH_BYTES = 16 << 20  # a fetch is cut into batches of about this much, read in parallel


class ReadItem:
    """One chunk of one namespace read back from a slot into WRITING arena blocks.

    Attributes:
        key: its disk key; pool_key: its block-pool key.
        slot, record_bytes: where it is and how long (from the index).
        parent: the hash of the chunk before it (token ids are verified from it).
        blocks: WRITING arena blocks for the record.
        failure: None when read and verified; else a counter suffix ("verify_checksum",
            "errors_io", ...) or "skipped" (an earlier chunk of the chain failed).
        slot_sound: the slot passed its own checks (envelope, checksum, its record's
            header) and failed only the request's chain (its token ids do not hash from
            the request's parent to the chunk hash): the request's miss, the slot stays.
    """

    __slots__ = ("key", "pool_key", "slot", "record_bytes", "parent", "blocks", "failure",
                 "slot_sound")

    def __init__(self, key: DiskKey, pool_key: bytes, slot: int, record_bytes: int,
                 parent: bytes) -> None:
        self.key = key
        self.pool_key = pool_key
        self.slot = slot
        self.record_bytes = record_bytes
        self.parent = parent
        self.blocks: list[KVCacheBlock] = []
        self.failure: str | None = None
        self.slot_sound = False


class DiskFetchJob:
    """A fetch of the run of a chain the disk holds, in chain order.

    Attributes:
        key: (namespaces, first hash, last hash): a lookup of the same chain joins it.
        namespaces, fps: the request's namespace ids and their fingerprints.
        items: the chunks to read, chain order, namespaces interleaved.
        held: the arena blocks pinned until the job ends (the chain's arena part, then
            the chunks installed).
        num_batches: its ReadBatches not applied by the loop yet.
        done: set by the loop once the job's chunks are installed or dropped.
        generation: the pool's `clear_generation` when the job started: once a CLEAR
            changed it, the job installs nothing (`DiskFetches._finish_reads`).
    """

    __slots__ = ("key", "namespaces", "fps", "items", "held", "num_batches", "done",
                 "generation")

    def __init__(self, key: tuple, namespaces: list[int], fps: list[bytes]) -> None:
        self.key = key
        self.namespaces = namespaces
        self.fps = fps
        self.items: list[ReadItem] = []
        self.held: list[KVCacheBlock] = []
        self.num_batches = 0
        self.done = False
        self.generation = 0


class ReadBatch:
    """Consecutive items of a fetch (about READ_BATCH_BYTES) that one reader thread reads
    in order; the batches of a fetch are read in parallel.

    Attributes:
        job: the fetch; items: its items in this batch.
        busy_us: the reader's time on it, microseconds.
    """

    __slots__ = ("job", "items", "busy_us")

    def __init__(self, job: DiskFetchJob, items: list[ReadItem]) -> None:
        self.job = job
        self.items = items
        self.busy_us = 0


class DiskFetches:
    """The fetch methods of `DiskTier` (a part of it, no state of its own)."""

    def start_fetch(self, request: FetchRequest) -> DiskFetchJob | None:
        """Start (or join) a fetch of the run of `request.hashes[first:]` the disk holds
        in every listed namespace (loop thread; `SpillTier.start_fetch`). None, and
        nothing started, when the disk holds no such chunk, a namespace is not on disk,
        MAX_FETCH_JOBS are in flight, or the arena has no room for the first chunk.
        """
        index = self.index
        if index is None:
            return None
        namespaces, prefixes, pool = request.namespaces, request.prefixes, request.pool
        fps = [self._ns_fp(ns) for ns in namespaces]
        if None in fps:
            return None
        chunk_hashes = request.chunk_hashes()
        if not all(index.get((fp, chunk_hashes[0])) for fp in fps):
            return None
        key = request.job_key()
        job, may_start = self._fetch_jobs.join(key)
        if not may_start:
            return job
        job = DiskFetchJob(key, list(namespaces), fps)
        job.generation = pool.clear_generation
        chained = not any(self.layout_of(ns).fmt in UNCHAINED_FORMATS for ns in namespaces)
        total = num_run = 0
        for chunk_hash in chunk_hashes:
            entries = [index.get((fp, chunk_hash)) for fp in fps]
            if None in entries or (job.items and total > MAX_FETCH_BYTES):
                break
            i = request.first + num_run
            parent = request.parent_of(i) if i and chained else request.root
            for fp, prefix, entry in zip(fps, prefixes, entries):
                job.items.append(ReadItem((fp, chunk_hash), prefix + chunk_hash, entry.slot,
                                          entry.record_bytes, parent))
                index.start_read(entry.slot)  # before any allocation can evict a slot
                total += entry.record_bytes
            num_run += 1
        # The chain's arena parts before and after the run are pinned until the job ends:
        # installing the run never evicts the rest of the chain it completes.
        held = request.prefix_blocks()
        cached = pool.cached
        for chunk_hash in chunk_hashes[num_run:]:
            spans = [cached.get(prefix + chunk_hash) for prefix in prefixes]
            if None in spans:
                break
            for span in spans:
                held.extend(span)
        job.held = held
        pool.touch(held)
        self._allocate(pool, job)
        if not job.items:
            pool.free(job.held)
            return None
        self._fetch_jobs.add(key, job)
        batches, batch, num_bytes = [], [], 0
        for item in job.items:
            if batch and num_bytes + item.record_bytes > READ_BATCH_BYTES:
                batches.append(batch)
                batch, num_bytes = [], 0
            batch.append(item)
            num_bytes += item.record_bytes
        batches.append(batch)
        job.num_batches = len(batches)
        for batch in batches:  # at most MAX_FETCH_JOBS jobs of MAX_FETCH_BYTES are queued
            self._reads.submit(ReadBatch(job, batch))
        return job

    def _allocate(self, pool: BlockPool, job: DiskFetchJob) -> None:
        """WRITING blocks for each item; the items from the first that finds no room on
        are dropped (counted), as are chunks the arena holds already."""
        block_bytes = self.arena.block_bytes
        kept = []
        for n, item in enumerate(job.items):
            if item.pool_key in pool.cached:
                self.index.end_read(item.slot)
                continue
            blocks = pool.allocate(-(-item.record_bytes // block_bytes))
            if blocks is None:
                self.counts.fetch_nospace += 1
                for rest in job.items[n:]:
                    self.index.end_read(rest.slot)
                break
            for i, block in enumerate(blocks):
                block.num_bytes = min(block_bytes, item.record_bytes - i * block_bytes)
            item.blocks = blocks
            kept.append(item)
        job.items = kept

    def _read(self, batches: list[ReadBatch]) -> None:
        """Reader thread: read and verify each chunk of a batch in its blocks
        (`_read_item`); after a chunk that fails, the rest of the batch is skipped."""
        for batch in batches:
            started = time.perf_counter()
            page = self._thread_page()
            failed = False
            for item in batch.items:
                if failed or self._reads.stopping:
                    item.failure = "skipped"
                    continue
                try:
                    self._read_item(item, page)
                except VerifyError as exc:
                    item.failure = f"verify_{exc.reason}"
                    item.slot_sound = exc.slot_sound
                except Exception as exc:  # noqa: BLE001 - an I/O error is a miss (the loop logs)
                    item.failure = f"errors_{error_kind(exc)}: {exc}"
                failed = item.failure is not None
            batch.busy_us = int((time.perf_counter() - started) * 1e6)
            self._reads.post(batch)

    def _read_item(self, item: ReadItem, page) -> None:
        """Read one slot (reader thread): its envelope page into `page` and its record
        straight into the item's WRITING blocks (O_DIRECT: whole pages; through this
        thread's buffer where the blocks are not whole pages, `DiskTier._in_place`),
        one `preadv`, then verify it there (`envelope.verify_parts`: envelope, checksum,
        token ids). The blocks are visible to no one until the loop commits them; a
        chunk that fails is aborted by the loop (`_finish_reads`).

        Raises:
            VerifyError: the slot must not be served.
            OSError: the read failed or came back short.
        """
        ns_fp, chunk_hash = item.key
        if self._in_place():
            pieces = self._block_views(item.blocks, self.slots.direct)
            envelope = self.slots.read(item.slot, page, pieces, item.record_bytes)
            record = [view[:block.num_bytes] for view, block in zip(pieces, item.blocks)]
            verify_parts(envelope, record, ns_fp, chunk_hash, item.parent)
            return
        src = np.frombuffer(self._thread_buffer(), dtype=np.uint8)
        envelope = self.slots.read(item.slot, page, [src[:round_up(item.record_bytes)]],
                                   item.record_bytes)
        verify_parts(envelope, [src[:item.record_bytes]], ns_fp, chunk_hash, item.parent)
        arena = self.arena
        pos = 0
        for block in item.blocks:
            n = block.num_bytes
            np.copyto(arena.numpy_view(arena.block_offset(block.block_id), n), src[pos:pos + n])
            pos += n

    def _finish_reads(self, batches: list[ReadBatch]) -> None:
        """Commit what was read and verified, drop the slots that failed their own checks;
        after a fetch's last batch, unpin its chain (loop thread). A job started before
        a CLEAR (the pool's `clear_generation` changed since) commits nothing and drops
        nothing: its reads may have raced the erasure of its slots."""
        pool, index, stats = self.pool, self.index, self.counts
        for batch in batches:
            job = batch.job
            stats.read_busy_us += batch.busy_us
            cleared = job.generation != pool.clear_generation
            current = not cleared and all(
                self._ns_fp(ns) == fp for ns, fp in zip(job.namespaces, job.fps))
            for item in batch.items:
                index.end_read(item.slot)
                if item.failure is None and current and pool.commit(item.blocks, item.pool_key,
                                                                    parent=item.parent):
                    job.held.extend(item.blocks)
                    if item.key in index.entries:
                        index.touch(item.key)
                    stats.fetch_hit_chunks += 1
                    stats.fetch_bytes += item.record_bytes
                    continue
                pool.abort(item.blocks)
                if item.failure in (None, "skipped") or cleared:
                    continue
                stats.fetch_failures += 1
                if item.failure.startswith("errors_"):
                    kind, _, detail = item.failure.partition(": ")
                    stats.count_error(kind[len("errors_"):])
                    self._log.warning("disk tier %s: a read failed (%s); counted in INFO "
                                      "disk_%s, the chunk is a miss", self.directory, detail,
                                      kind)
                else:
                    stats.count_rejected(item.failure[len("verify_"):])
                if item.slot_sound:
                    continue  # the request's parent is wrong, not the slot
                entry = index.get(item.key)
                if entry is not None and entry.slot == item.slot:
                    index.forget(item.key)  # a slot that failed once is never read again
                    self._erase([entry])
            job.num_batches -= 1
            if job.num_batches:
                continue
            if job.held:
                pool.free(job.held)
            job.held = []
            job.done = True
            self._fetch_jobs.finish(job.key)
        if batches and not self._reads.stopping:
            self.write_ahead()  # the chunks installed pushed others towards eviction
