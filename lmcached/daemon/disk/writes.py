"""The disk tier's writes: spills of evicted chunks, writes ahead of eviction,
write-through, and the erasure of slots an admin EVICT or CLEAR removed.

Why this file exists: it is the write half of the disk tier (`tier.py` owns the file,
the index and the threads; `fetch.py` is the read half). `DiskWrites` is a part of
`DiskTier` with no state of its own: its methods run on the loop thread, except
`_write`, which runs on the writer threads and touches no block metadata.
"""

import threading
import time

import numpy as np

from lmcached.daemon.disk.index import DiskEntry, DiskKey
from lmcached.daemon.disk.slots import error_kind
from lmcached.daemon.l2.values import ENVELOPE_BYTES, encode_envelope
from lmcached.wire.logger import init_logger
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import KVCacheBlock

logger = init_logger(__name__)

AHEAD_SHARE = 8  # on-evict writes ahead the next 1/AHEAD_SHARE of the arena to be evicted
MAX_AHEAD_VALUES = 64  # values one write-ahead pass may start (bounded loop work)
ERROR_HOLD_S = 1.0  # after a write error, nothing is written ahead for this long


class WriteJob:
    """One chunk on its way to a slot, in one of three modes.

    - "copied": evicted; its record was copied into `buffer` on the loop.
    - "pinned": write-through; `blocks` are pinned until the writer copied them out.
    - "ahead": written ahead of its eviction, unpinned; the writer copies `blocks` out
      under `lock`, and an eviction meanwhile (`DiskTier.spill`) takes the lock too: it
      cancels a job not copied yet, or lets a copied one go on (`evicted`).
    - "erase": no chunk; the envelope page of `slot` is zeroed (`DiskTier.evict`, `clear`).

    Attributes:
        key: its disk key (namespace fingerprint, chunk hash); pool_key: its pool key.
        slot: the slot reserved for it.
        mode: "copied", "pinned", "ahead" or "erase".
        epoch: the tier's `clear` count when it was queued (a chunk queued before a
            CLEAR is not indexed after it).
        buffer: the page-aligned write buffer holding the record at ENVELOPE_BYTES
            ("copied"); None: the writer copies `blocks` into a buffer of its own.
        record_bytes: the record's length.
        blocks: its arena blocks (the pool's span list of the value); None ("copied").
        lock, copied, cancelled, evicted: the "ahead" handshake above.
        error: the write's OSError or other exception, or None.
        busy_us: how long the writer worked on it, in microseconds.
    """

    __slots__ = ("key", "pool_key", "slot", "mode", "buffer", "record_bytes", "blocks",
                 "lock", "copied", "cancelled", "evicted", "epoch", "error", "busy_us")

    def __init__(self, key: DiskKey, pool_key: bytes, slot: int, mode: str, buffer,
                 record_bytes: int, blocks: list[KVCacheBlock] | None) -> None:
        self.key = key
        self.pool_key = pool_key
        self.slot = slot
        self.mode = mode
        self.buffer = buffer
        self.record_bytes = record_bytes
        self.blocks = blocks
        self.lock = threading.Lock() if mode == "ahead" else None
        self.copied = self.cancelled = self.evicted = False
        self.epoch = 0
        self.error: BaseException | None = None
        self.busy_us = 0


class DiskWrites:
    """The write methods of `DiskTier` (a part of it, no state of its own)."""

    def write_ahead(self) -> int:
        """Queue the chunks next in line for eviction (on-evict policy; loop thread):
        when the arena has fewer empty blocks than 1/AHEAD_SHARE of it, the values of the
        next that many blocks in eviction order (at most MAX_AHEAD_VALUES) that are not on
        disk yet, unpinned (their place in the LRU order stays).

        Returns:
            How many writes were started.
        """
        pool, index = self.pool, self.index
        if (self.policy != "on-evict" or index is None or pool is None
                or time.monotonic() < self._ahead_held_until):
            return 0
        reserve = max(1, pool.num_blocks // AHEAD_SHARE)
        if pool.num_empty_blocks >= reserve:
            return 0  # no eviction soon
        started = window = 0
        for pool_key, blocks in pool.lru_values(MAX_AHEAD_VALUES):
            window += len(blocks)  # the next `reserve` blocks in eviction order, no more
            if window > reserve:
                break
            key = self._disk_key(pool_key)
            if key is None or key in index.entries or key in self._writing:
                continue
            if self._queue_write(pool_key, blocks, "ahead"):
                started += 1
        return started

    def spill(self, pool_key: bytes, blocks: list[KVCacheBlock]) -> None:
        """`BlockPool.on_evict` hook (on-evict policy; loop thread): copy an evicted
        chunk into a write buffer before its blocks are reused, unless it is on disk or
        its write ahead has copied it already. Never raises."""
        if self.policy != "on-evict" or self.index is None:
            return
        try:
            job = self._ahead.get(pool_key)
            if job is not None:
                with job.lock:  # waits for a copy in progress: the blocks stay intact
                    if job.copied:
                        job.evicted = True
                        self.stats["spills_ahead"] += 1
                        return
                    job.cancelled = True
                del self._ahead[pool_key]
                self._writing.discard(job.key)
            self._queue_write(pool_key, blocks, "copied")
        except Exception:  # noqa: BLE001 - raised inside BlockPool.allocate: never let it out
            logger.exception("disk spill of an evicted chunk failed")
            self.stats["write_failures"] += 1

    def write_through(self, pool: BlockPool, values: list[tuple[bytes, list[KVCacheBlock]]]) -> None:
        """Queue newly committed values (write-through policy; loop thread): each is
        pinned until its writer copied it out."""
        if self.policy != "write-through" or self.index is None:
            return
        for pool_key, blocks in values:
            self._queue_write(pool_key, blocks, "pinned")

    def _queue_write(self, pool_key: bytes, blocks: list[KVCacheBlock], mode: str) -> bool:
        """Queue one value's write in `mode` (`WriteJob`). Returns whether a write was
        queued (else it is on disk, being written, or dropped and counted)."""
        key = self._disk_key(pool_key)
        if key is None or key in self._writing:
            return False
        stats, index = self.stats, self.index
        if key in index.entries:  # the same chunk is on disk: only its place in the LRU
            index.touch(key)
            stats["spills_present"] += 1
            return False
        num_bytes = sum(b.num_bytes for b in blocks)
        if ENVELOPE_BYTES + num_bytes > self.slots.slot_bytes:
            stats["write_drops_oversize"] += 1
            return False
        if ((mode == "copied" and not self._buffers) or (
                mode == "pinned" and self._pinned_bytes + num_bytes > self._pinned_limit_bytes)):
            stats["write_drops_queue_full"] += 1
            return False
        slot = index.reserve()
        if slot is None:
            stats["write_drops_busy"] += 1
            return False
        if mode == "copied":
            job = WriteJob(key, pool_key, slot, mode, self._buffers.pop(), num_bytes, None)
            self._copy_out(blocks, job.buffer)
            stats["spill_copies"] += 1
        else:
            job = WriteJob(key, pool_key, slot, mode, None, num_bytes, blocks)
            if mode == "pinned":
                self.pool.touch(blocks)
                self._pinned_bytes += num_bytes
            else:
                self._ahead[pool_key] = job
        job.epoch = self._epoch
        self._writing.add(key)
        self._writes.submit(job)
        return True

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
        background; writes in flight are not indexed when they end. Returns how many
        chunks were forgotten."""
        if self.index is None:
            return 0
        self._epoch += 1
        entries = self.index.forget_all()
        self._erase(entries)
        return len(entries)

    def _erase(self, entries) -> None:
        for entry in entries:  # the slots come back to the empty ones once erased
            self._writes.submit(WriteJob(None, b"", entry.slot, "erase", None, 0, None))

    def _copy_out(self, blocks: list[KVCacheBlock], buffer) -> None:
        """Copy a value's bytes from its arena blocks into `buffer` at ENVELOPE_BYTES."""
        arena = self.arena
        dst = np.frombuffer(buffer, dtype=np.uint8)
        pos = ENVELOPE_BYTES
        for block in blocks:
            n = block.num_bytes
            np.copyto(dst[pos:pos + n], arena.numpy_view(arena.block_offset(block.block_id), n))
            pos += n

    def _write(self, jobs: list[WriteJob]) -> None:
        """Writer thread: write each job's record into its slot, envelope last."""
        for job in jobs:
            started = time.perf_counter()
            try:
                if job.mode == "erase":
                    self.slots.erase(job.slot, self._thread_buffer())
                    self._writes.post(job)
                    continue
                buffer = job.buffer
                if buffer is None:
                    buffer = self._thread_buffer()
                    if job.lock is None:
                        self._copy_out(job.blocks, buffer)
                    else:
                        with job.lock:
                            if not job.cancelled:  # else evicted before the copy
                                self._copy_out(job.blocks, buffer)
                                job.copied = True
                        if job.cancelled:
                            self._writes.post(job)
                            continue
                record = memoryview(buffer)[ENVELOPE_BYTES:ENVELOPE_BYTES + job.record_bytes]
                envelope = encode_envelope(job.key[0], job.key[1], [record])
                self.slots.write(job.slot, buffer, job.record_bytes, envelope)
            except Exception as exc:  # noqa: BLE001 - counted and logged by the loop
                job.error = exc
            job.busy_us = int((time.perf_counter() - started) * 1e6)
            self._writes.post(job)

    def _finish_writes(self, jobs: list[WriteJob]) -> None:
        """Index the written slots, give back the failed ones and the buffers, unpin
        write-through blocks (loop thread)."""
        stats = self.stats
        for job in jobs:
            stats["write_busy_us"] += job.busy_us
            if job.buffer is not None:
                self._buffers.append(job.buffer)
            if job.cancelled:  # evicted before its write ahead copied it: spilled anew
                self.index.release(job.slot)
                continue
            if job.mode == "erase":
                self.index.release(job.slot)
                if job.error is not None:
                    self._count_error("erase", job.error)
                continue
            self._writing.discard(job.key)
            if job.mode == "pinned":
                self._pinned_bytes -= job.record_bytes
                if self.pool is not None:
                    self.pool.free(job.blocks)
            elif job.mode == "ahead":
                del self._ahead[job.pool_key]
                # Copied intact only if not evicted before the copy: evicted after it
                # (`spill`), or still the same value in the pool.
                if job.error is None and not job.evicted and (
                        self.pool is None or self.pool.cached.get(job.pool_key) is not job.blocks):
                    self.index.release(job.slot)  # evicted by a request (EVICT, CLEAR)
                    continue
            if job.error is not None:
                self._ahead_held_until = time.monotonic() + ERROR_HOLD_S
                self.index.release(job.slot)
                stats["write_failures"] += 1
                self._count_error("write", job.error)
                continue
            if job.epoch != self._epoch:  # queued before a CLEAR: erased, not indexed
                self._erase([DiskEntry(job.slot, job.record_bytes)])
                continue
            self.index.insert(job.key, job.slot, job.record_bytes)
            stats["writes"] += 1
            stats["write_bytes"] += job.record_bytes
        if jobs and not self._writes.stopping:
            self.write_ahead()

    def _count_error(self, what: str, exc: BaseException) -> None:
        kind = error_kind(exc)
        key = f"errors_{kind}"
        self.stats[key] = self.stats.get(key, 0) + 1
        self._log.warning("disk tier %s: a %s failed (%s: %s); counted in INFO disk_%s, "
                          "the chunk is a miss", self.directory, what, kind, exc, key)
