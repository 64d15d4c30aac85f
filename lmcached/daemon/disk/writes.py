"""The disk tier's writes: writes ahead of eviction, write-through, and the erasure of
slots an admin EVICT or CLEAR removed.

Why this file exists: it is the write half of the disk tier (`tier.py` owns the file,
the index and the threads; `fetch.py` is the read half). `DiskWrites` is a part of
`DiskTier` with no state of its own: its methods run on the loop thread, except
`_write`, which runs on the writer threads and changes no block metadata.

How on-evict spills without slowing a store (a spill that cannot keep up is a counted
drop, never a wait): the loop never copies a chunk's bytes. Chunks next in line for eviction are
written AHEAD of it, by the writer threads, straight from their arena blocks, which stay
unpinned (their LRU place, hits and eviction are unchanged). When the pool evicts one
(`spill`, the `BlockPool.on_evict` hook) it is on disk already (`spills_present`), or
its write is in flight (it ends as `spills_ahead` if its record's pages were written
whole, else as a drop), or it was never reached: dropped, counted (`write_drops_late`).
The writer computes the record's checksum from its blocks and writes the record's pages
straight from them (O_DIRECT from the arena's mapping, no copy: slots.py), then checks
that the value is still the one indexed under its key (`_still_cached`) before it writes
the envelope page, the commit mark: the pool unindexes a value before it hands its
blocks out, on the loop thread, and a client writes a block only after the ALLOC reply
that follows, so a record that passes this check was written intact (and checksummed
from the same bytes), and one that raced an eviction is never committed: its slot keeps
a zeroed envelope and goes back to the free ones.

Rejected: copying an evicted chunk in the loop into a spill buffer (the first version:
~1 ms of the loop per 8 MiB chunk, and stores ran at 0.3x of no disk tier in
benchmarks/tiers/bench_disk.py); handing the evicted block to a writer and delaying its reuse
(ALLOC would have to take other blocks than LRU order gives, or wait for the disk, and
a burst faster than the disk would still have to drop).
"""

import time

import numpy as np

from lmcached.daemon.disk.index import DiskEntry, DiskKey
from lmcached.daemon.disk.slots import error_kind, round_up
from lmcached.daemon.spill.envelope import encode_envelope
from lmcached.wire.logger import init_logger
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import KVCacheBlock

logger = init_logger(__name__)

AHEAD_SHARE = 2  # once fewer than 1/AHEAD_SHARE of the arena is empty, the next
#                  1/AHEAD_SHARE of it in eviction order is written ahead
MAX_AHEAD_WRITES = 32  # writes ahead in flight (queued or being written)
AHEAD_REFILL_AT = MAX_AHEAD_WRITES // 2  # a pass walks the LRU order only once the writes
#                  in flight fell to this: one walk per batch of writes, not one per write
MAX_AHEAD_SCAN_BLOCKS = 1024  # queued blocks one write-ahead pass visits (bounded loop work)
ERROR_HOLD_S = 1.0  # after a write error, nothing is written ahead for this long


class WriteJob:
    """One chunk on its way to a slot, in one of three modes.

    - "ahead": written ahead of its eviction, unpinned; the writer writes the record from
      `blocks` and commits it only if the value is still indexed after that
      (`DiskWrites._still_cached`), else it cancels the write.
    - "pinned": write-through; `blocks` are pinned until the writer wrote them.
    - "erase": no chunk; the envelope page of `slot` is zeroed (`DiskTier.evict`, `clear`).

    Attributes:
        key: its disk key (namespace fingerprint, chunk hash); pool_key: its pool key.
        parent: the chunk hash before it in its chain (`ValueLedger.parents`; b"": not
            known), kept in its slot.
        slot: the slot reserved for it.
        mode: "ahead", "pinned" or "erase".
        epoch: the tier's `clear` count when it was queued (a chunk queued before a
            CLEAR is not indexed after it).
        record_bytes: the record's length.
        blocks: its arena blocks (the pool's span list of the value).
        cancelled: set by the writer: the value left the arena before its record was
            written (never committed).
        evicted: set by the loop (`spill`): the pool evicted the value under pressure
            while its write was in flight (a record written whole before is kept).
        error: the write's OSError or other exception, or None.
        busy_us: how long the writer worked on it, in microseconds.
    """

    __slots__ = ("key", "pool_key", "parent", "slot", "mode", "record_bytes", "blocks",
                 "cancelled", "evicted", "epoch", "error", "busy_us")

    def __init__(self, key: DiskKey | None, pool_key: bytes, slot: int, mode: str,
                 record_bytes: int, blocks: list[KVCacheBlock] | None,
                 parent: bytes = b"") -> None:
        self.key = key
        self.pool_key = pool_key
        self.parent = parent
        self.slot = slot
        self.mode = mode
        self.record_bytes = record_bytes
        self.blocks = blocks
        self.cancelled = self.evicted = False
        self.epoch = 0
        self.error: BaseException | None = None
        self.busy_us = 0


class DiskWrites:
    """The write methods of `DiskTier` (a part of it, no state of its own)."""

    def write_ahead(self) -> int:
        """Queue the chunks next in line for eviction (on-evict policy; loop thread):
        when fewer than 1/AHEAD_SHARE of the arena's blocks are empty, the values in the
        next 1/AHEAD_SHARE of it in eviction order that are not on disk yet, within
        MAX_AHEAD_SCAN_BLOCKS queued blocks and MAX_AHEAD_WRITES writes in flight. They
        stay unpinned (their place in the LRU order stays). It is called after every
        commit and every batch of finished writes, so it does nothing while more than
        AHEAD_REFILL_AT writes are in flight: each walk over the LRU order (up to
        MAX_AHEAD_SCAN_BLOCKS blocks of the loop's time) then queues a batch, and a
        burst of stores does not pay a walk per write.

        Returns:
            How many writes were started.
        """
        pool, index = self.pool, self.index
        if (self.policy != "on-evict" or index is None or pool is None
                or len(self._ahead) > AHEAD_REFILL_AT
                or time.monotonic() < self._ahead_held_until):
            return 0
        share = max(1, pool.num_blocks // AHEAD_SHARE)
        if pool.num_empty_blocks >= share:
            return 0  # no eviction soon
        started = window = 0
        for pool_key, blocks in pool.lru_values(MAX_AHEAD_WRITES + MAX_AHEAD_SCAN_BLOCKS,
                                                MAX_AHEAD_SCAN_BLOCKS):
            window += len(blocks)  # the next `share` blocks in eviction order, no more
            if window > share or len(self._ahead) >= MAX_AHEAD_WRITES:
                break
            if pool_key in self._ahead or not self._fits(blocks):
                continue  # being written, or larger than a slot (counted when evicted)
            key = self._disk_key(pool_key)
            if key is None or key in index.entries or key in self._writing:
                continue
            if self._queue_write(pool_key, blocks, "ahead"):
                started += 1
        return started

    def spill(self, pool_key: bytes, blocks: list[KVCacheBlock]) -> None:
        """`BlockPool.on_evict` hook (on-evict policy; loop thread), before the evicted
        value's blocks are handed out: O(1), never a copy, never a wait. A chunk on disk
        moves to the back of the disk LRU; one whose write ahead is in flight is marked
        (its record, if written whole, is kept); any other is dropped and counted
        (`write_drops_late`, or `write_drops_oversize` for a value larger than a slot).
        Never raises."""
        if self.policy != "on-evict" or self.index is None:
            return
        try:
            key = self._disk_key(pool_key)
            if key is None:
                return
            stats, index = self.counts, self.index
            if key in index.entries:
                index.touch(key)
                stats.spills_present += 1
                return
            job = self._ahead.get(pool_key)
            if job is not None:
                job.evicted = True  # counted when the write ends (`_finish_writes`)
            elif not self._fits(blocks):
                stats.write_drops_oversize += 1
            elif key not in self._writing:
                stats.write_drops_late += 1
        except Exception:  # noqa: BLE001 - raised inside BlockPool.allocate: never let it out
            logger.exception("disk spill of an evicted chunk failed")
            self.counts.write_failures += 1

    def write_through(self, pool: BlockPool, values: list[tuple[bytes, list[KVCacheBlock]]]) -> None:
        """Newly committed values (loop thread): under the write-through policy each is
        queued and pinned until its writer wrote it; then a pass of writes ahead
        (`write_ahead`: the commit pushed older chunks towards eviction)."""
        if self.policy == "write-through" and self.index is not None:
            for pool_key, blocks in values:
                self._queue_write(pool_key, blocks, "pinned")
        self.write_ahead()

    def _queue_write(self, pool_key: bytes, blocks: list[KVCacheBlock], mode: str) -> bool:
        """Queue one value's write in `mode` (`WriteJob`). Returns whether a write was
        queued (else it is on disk, being written, or dropped and counted)."""
        key = self._disk_key(pool_key)
        if key is None or key in self._writing:
            return False
        stats, index = self.counts, self.index
        if key in index.entries:  # the same chunk is on disk: only its place in the LRU
            index.touch(key)
            stats.spills_present += 1
            return False
        if not self._fits(blocks):
            stats.write_drops_oversize += 1
            return False
        num_bytes = sum(b.num_bytes for b in blocks)
        if mode == "pinned" and self._pinned_bytes + num_bytes > self._pinned_limit_bytes:
            stats.write_drops_queue_full += 1
            return False
        slot = index.reserve()
        if slot is None:
            stats.write_drops_busy += 1
            return False
        job = WriteJob(key, pool_key, slot, mode, num_bytes, blocks,
                       self.pool.ledger.parents.get(pool_key, b""))
        if mode == "pinned":
            self.pool.touch(blocks)
            self._pinned_bytes += num_bytes
        else:
            self._ahead[pool_key] = job
        job.epoch = self._epoch
        self._writing.add(key)
        self._writes.submit(job)
        return True

    def _fits(self, blocks: list[KVCacheBlock]) -> bool:
        """Whether a value of these blocks fits one slot (after its envelope page)."""
        return sum(b.num_bytes for b in blocks) <= self.slots.max_record_bytes

    def evict(self, pool_key: bytes) -> bool:
        """Forget one chunk (an admin's EVICT) and erase its slot's envelope in the
        background, so that a restart does not bring it back. True when it was on disk."""
        key = self._disk_key(pool_key) if self.index is not None else None
        entry = self.index.forget(key) if key is not None else None
        if entry is None:
            return False
        self._erase([entry])
        return True

    def clear(self) -> int:
        """Forget every chunk (an admin's CLEAR) and erase their slots' envelopes in the
        background; writes in flight are not indexed when they end (`_epoch`), and
        fetches in flight install nothing (the pool's `clear_generation`, which the
        caller's `BlockPool.clear` advances) and unpin their chains now, so that the
        pool's clear finds them unpinned. Returns how many chunks were forgotten.

        Why a restart cannot bring a cleared chunk back: a slot's envelope is erased
        before its slot number is given out again whenever it may hold a chunk that is
        not indexed: an indexed chunk forgotten (CLEAR, EVICT, INVALIDATE, a slot that
        failed a read), a chunk written again into another slot (`DiskIndex.insert`), a
        write queued before a CLEAR, a write ahead cancelled or failed in the slot of
        the chunk it evicted (`_write`, `_finish_writes`), and, at a graceful stop, every
        write still queued (`DiskTier.close`). Rejected: a clear generation in the
        superblock that the warm-restart scan compares with each slot's: one page
        write per CLEAR instead of one per slot, but it needs a field in every slot's
        envelope, which is the L2 value's envelope (lmcached/daemon/spill/envelope.py)."""
        if self.index is None:
            return 0
        self._epoch += 1
        if self.pool is not None:
            for job in self._fetch_jobs:
                if job.held:
                    self.pool.free(job.held)
                job.held = []
        entries = self.index.forget_all()
        self._erase(entries)
        return len(entries)

    def _erase(self, entries) -> None:
        """Zero the envelopes of `entries`' slots (forgotten by the index, not released)
        in the background; they come back to the empty slots once erased. Once the
        writers stop (a graceful stop), on this thread at once."""
        for entry in entries:
            if self._writes.submit(WriteJob(None, b"", entry.slot, "erase", 0, None)):
                continue
            try:
                self.slots.erase(entry.slot, self._thread_page())
            except OSError as exc:
                self._count_error("erase", exc)
            self.index.release(entry.slot)

    def _copy_out(self, blocks: list[KVCacheBlock]) -> tuple[list, list]:
        """Copy a value's bytes from its arena blocks into this thread's buffer, for the
        blocks O_DIRECT cannot write in place (`DiskTier._in_place`).

        Returns:
            (pieces to write: the record's whole pages; the record's exact bytes), both
            views of the buffer.
        """
        arena = self.arena
        buffer = self._thread_buffer()
        dst = np.frombuffer(buffer, dtype=np.uint8)
        pos = 0
        for block in blocks:
            n = block.num_bytes
            np.copyto(dst[pos:pos + n], arena.numpy_view(arena.block_offset(block.block_id), n))
            pos += n
        return [dst[:round_up(pos)]], [dst[:pos]]

    def _still_cached(self, job: WriteJob) -> bool:
        """Whether `job`'s value is still the one indexed under its key (writer thread:
        one dict read, atomic under the GIL). The pool unindexes a value before its
        blocks are handed out, and every commit indexes a new span list, so True after
        a write means no block of it was reused meanwhile."""
        return self.pool.cached.get(job.pool_key) is job.blocks

    def _write(self, jobs: list[WriteJob]) -> None:
        """Writer thread: write each job's record into its slot, envelope last
        (`_write_value`); a write ahead whose value left the arena before it ended is
        cancelled."""
        for job in jobs:
            started = time.perf_counter()
            try:
                page = self._thread_page()
                if job.mode == "erase":
                    self.slots.erase(job.slot, page)
                elif job.mode == "ahead" and not self._still_cached(job):
                    job.cancelled = True  # evicted before the writer reached it
                    self.slots.erase(job.slot, page)  # it may hold the chunk it evicted
                else:
                    self._write_value(job, page)
            except Exception as exc:  # noqa: BLE001 - counted and logged by the loop
                job.error = exc
            job.busy_us = int((time.perf_counter() - started) * 1e6)
            self._writes.post(job)

    def _write_value(self, job: WriteJob, page) -> None:
        """Write one value into its slot (writer thread): the envelope's checksum from
        its arena blocks, the record pages straight from those blocks (O_DIRECT: whole
        pages; through this thread's buffer where the blocks are not whole pages), then,
        only if no block was reused meanwhile (`_still_cached`, for a write ahead: its
        blocks are not pinned), the envelope page, the commit mark. A value evicted
        during the write is cancelled: its slot keeps a zeroed envelope, never the old
        key over another value's bytes (the checksum, verified on every read, would
        refuse those too)."""
        if self._in_place():
            pieces = self._block_views(job.blocks, self.slots.direct)
            record = [view[:block.num_bytes] for view, block in zip(pieces, job.blocks)]
        else:
            pieces, record = self._copy_out(job.blocks)
        envelope = encode_envelope(job.key[0], job.key[1], record)
        self.slots.write_record(job.slot, page, pieces)
        if job.mode == "ahead" and not self._still_cached(job):
            job.cancelled = True  # evicted during the write: its bytes may be another's
            self.slots.erase(job.slot, page)  # the envelope of the chunk it evicted
            return
        self.slots.commit(job.slot, page, envelope, job.parent)

    def _finish_writes(self, jobs: list[WriteJob]) -> None:
        """Index the written slots, give back the failed and cancelled ones, unpin
        write-through blocks, and write ahead again (loop thread)."""
        stats, index = self.counts, self.index
        for job in jobs:
            stats.write_busy_us += job.busy_us
            if job.mode == "erase":
                index.release(job.slot)
                if job.error is not None:
                    self._count_error("erase", job.error)
                continue
            self._writing.discard(job.key)
            if job.mode == "pinned":
                self._pinned_bytes -= job.record_bytes
                if self.pool is not None:
                    self.pool.free(job.blocks)
            else:
                del self._ahead[job.pool_key]
                if job.cancelled:  # the writer erased its slot
                    index.release(job.slot)
                    if job.evicted:  # under pressure, before the writer copied it
                        stats.write_drops_late += 1
                    if job.error is not None:
                        self._count_error("erase", job.error)
                    continue
                if job.error is None and not job.evicted and (
                        self.pool is None or not self._still_cached(job)):
                    # Removed by a request (EVICT, CLEAR) after the write: not indexed,
                    # and its envelope erased so that a restart does not bring it back.
                    self._erase([DiskEntry(job.slot, job.record_bytes)])
                    continue
            if job.error is not None:
                self._ahead_held_until = time.monotonic() + ERROR_HOLD_S
                stats.write_failures += 1
                self._count_error("write", job.error)
                # Its slot may keep the envelope of the chunk it evicted: erased.
                self._erase([DiskEntry(job.slot, job.record_bytes)])
                continue
            if job.epoch != self._epoch or not index.insert(job.key, job.slot,
                                                            job.record_bytes, job.parent):
                # Queued before a CLEAR, or the chunk is on disk in another slot
                # meanwhile: erased, not indexed.
                self._erase([DiskEntry(job.slot, job.record_bytes)])
                continue
            stats.writes += 1
            stats.write_bytes += job.record_bytes
            if job.evicted:
                stats.spills_ahead += 1
        if jobs and not self._writes.stopping:
            self.write_ahead()

    def _count_error(self, what: str, exc: BaseException) -> None:
        kind = error_kind(exc)
        self.counts.count_error(kind)
        self._log.warning("disk tier %s: a %s failed (%s: %s); counted in INFO disk_errors_%s, "
                          "the chunk is a miss", self.directory, what, kind, exc, kind)
