"""The daemon's disk tier: chunks spilled to a local slot file, fetched back on a miss,
and found again after a restart.

Why this file exists: it is the glue between the block pool (loop thread) and the slot
file (`slots.py`, worker threads), a sibling of the L2 tier (lmcached/daemon/l2/tier.py)
with the same shape: job queues of the daemon's runner (`jobs.py`), completions applied
on the loop, a fetch that a LOOKUP / ACQUIRE waits for with a bound (`replies.Deferred`).

Flows (docs/operator.md, "The disk tier"):

- on-evict (default): once the arena has fewer empty blocks than 1/AHEAD_SHARE of it, the
  least recently used chunks (next in line for eviction, up to that share) are pinned and
  written ahead (`write_ahead`), so that their eviction costs nothing: the block pool's
  `on_evict` hook (`spill`) finds them on disk and only moves them to the back of the disk
  LRU. A chunk evicted before it was written ahead is copied into a free write buffer
  and written by a writer thread; no free buffer: dropped and counted.
- write-through: every committed chunk is pinned and queued; the writer copies it out
  of the arena and unpins it through the loop.
- fetch on miss: a lookup that misses in the arena at chunk i, while the disk index holds
  chunk i (of every namespace asked), starts a `DiskFetchJob`: the loop pins the arena's
  part of the chain, allocates WRITING blocks for the run the disk holds, a reader thread
  reads each slot, verifies it (`values.verify_value`: envelope, checksum, token ids)
  and copies the record into its blocks; the loop commits what verified and forgets the
  slots that did not (counted, `disk_fetch_verify_*`). A fetch of the same chain in flight
  is joined.
- warm restart: the index is rebuilt from the slots' envelopes before the daemon says
  READY (`load`); checksums are verified when a slot is read.

Faults (ENOSPC, EIO, EROFS, a truncated file) are counted by kind (`disk_errors_*`),
logged at most once per interval, and are misses or dropped writes for clients.
"""

import errno
import threading
import time
from collections.abc import Callable

import numpy as np

from lmcached.daemon.connection import RateLimitedLog
from lmcached.daemon.disk.directory import DirectoryLock
from lmcached.daemon.disk.index import DiskEntry, DiskIndex, DiskKey
from lmcached.daemon.disk.slots import SlotFile, aligned_buffer, read_superblock, slot_bytes_for
from lmcached.daemon.keys import CHUNK_TAG
from lmcached.daemon.l2.values import (
    ENVELOPE_BYTES,
    L2VerifyError,
    encode_envelope,
    namespace_fingerprint,
    verify_value,
)
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import Layout
from lmcached.wire.record_format import ROOT_HASH
from lmcached.shm.arena import Arena
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import KVCacheBlock
from lmcached.daemon.jobs import JobRunner

logger = init_logger(__name__)

POLICIES = ("on-evict", "write-through")
NUM_THREADS = 2  # writer threads, and as many reader threads
WRITE_QUEUE_BYTES = 64 << 20  # on-evict copies waiting (page-aligned buffers), at least
MIN_WRITE_BUFFERS = 4  # this many
PINNED_SHARE = 4  # write-through pins at most 1/PINNED_SHARE of the arena (as L2's)
AHEAD_SHARE = 8  # on-evict writes ahead the next 1/AHEAD_SHARE of the arena to be evicted
MAX_AHEAD_VALUES = 64  # values one write-ahead pass may start (bounded loop work)
ERROR_HOLD_S = 1.0  # after a write error, nothing is written ahead for this long
MAX_FETCH_JOBS = 8  # fetches in flight; beyond, a miss is answered at once
MAX_FETCH_BYTES = 1 << 30  # records one fetch reads at most (a longer run: the next lookup)
READ_BATCH_BYTES = 16 << 20  # a fetch is cut into batches of about this much, read in parallel
CLOSE_DRAIN_S = 5.0  # graceful stop: queued writes get this long to reach the disk
_CHUNK_TAG = CHUNK_TAG[0]
_ERROR_KINDS = {errno.ENOSPC: "nospace", errno.EFBIG: "nospace", errno.EDQUOT: "nospace",
                errno.EIO: "io", errno.EROFS: "readonly"}
ERROR_KINDS = ("nospace", "io", "readonly", "other")
COUNTERS = (
    "writes", "write_bytes", "write_busy_us", "write_drops_queue_full", "write_drops_oversize",
    "write_drops_busy", "write_failures", "spills_present", "spills_ahead", "spill_copies",
    "fetches", "fetches_joined",
    "fetches_skipped", "fetch_hit_chunks", "fetch_bytes", "read_busy_us", "fetch_nospace",
    "fetch_failures", "fetch_waits_timed_out",
)


def error_kind(exc: BaseException) -> str:
    """The INFO kind of an I/O error: nospace (ENOSPC, EFBIG, EDQUOT), io (EIO, a short
    read or write), readonly (EROFS) or other."""
    return _ERROR_KINDS.get(getattr(exc, "errno", None), "other")


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


class ReadItem:
    """One chunk of one namespace read back from a slot into WRITING arena blocks.

    Attributes:
        key: its disk key; pool_key: its block-pool key.
        slot, record_bytes: where it is and how long (from the index).
        parent: the hash of the chunk before it (token ids are verified from it).
        blocks: WRITING arena blocks for the record.
        failure: None when read and verified; else a counter suffix ("verify_checksum",
            "errors_io", ...) or "skipped" (an earlier chunk of the chain failed).
    """

    __slots__ = ("key", "pool_key", "slot", "record_bytes", "parent", "blocks", "failure")

    def __init__(self, key: DiskKey, pool_key: bytes, slot: int, record_bytes: int,
                 parent: bytes) -> None:
        self.key = key
        self.pool_key = pool_key
        self.slot = slot
        self.record_bytes = record_bytes
        self.parent = parent
        self.blocks: list[KVCacheBlock] = []
        self.failure: str | None = None


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
    """

    __slots__ = ("key", "namespaces", "fps", "items", "held", "num_batches", "done")

    def __init__(self, key: tuple, namespaces: list[int], fps: list[bytes]) -> None:
        self.key = key
        self.namespaces = namespaces
        self.fps = fps
        self.items: list[ReadItem] = []
        self.held: list[KVCacheBlock] = []
        self.num_batches = 0
        self.done = False


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


class DiskTier:
    """Spills chunks to a slot file and fetches misses back (module docstring).

    Args:
        directory: the checked disk directory; lock: its lock, held until `close`.
        capacity_bytes: bytes the slot file may take.
        policy: "on-evict" or "write-through".
        fetch_wait_s: how long a LOOKUP / ACQUIRE waits for a disk fetch, in seconds.
        arena: the daemon's arena (records are copied in and out of its blocks).
        jobs: the daemon's job runner: the tier adds "disk-writer" and "disk-reader"
            queues of NUM_THREADS threads each.
        layout_of: namespace id -> its Layout, or None for a freed id (the service's).

    Attributes:
        slots: the slot file, or None until the block size is known.
        index: chunk -> slot, or None until the block size is known.
        pool: the host arena's block pool, set by the service once it exists.
        stats: counters of COUNTERS, `errors_<kind>` and `fetch_verify_<reason>`.

    Raises:
        ValueError: unknown policy, capacity below one page, fetch_wait_s < 0.
    """

    def __init__(self, directory: str, lock: DirectoryLock, *, capacity_bytes: int,
                 policy: str, fetch_wait_s: float, arena: Arena, jobs: JobRunner,
                 layout_of: Callable[[int], Layout | None] = lambda ns: None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"disk policy {policy!r}: use one of {', '.join(POLICIES)}")
        if fetch_wait_s < 0:
            raise ValueError(f"disk fetch wait {fetch_wait_s} s: must be >= 0")
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.fetch_wait_s = fetch_wait_s
        self.arena = arena
        self.layout_of = layout_of
        self.slots: SlotFile | None = None
        self.index: DiskIndex | None = None
        self.pool: BlockPool | None = None
        self.num_restored = 0
        self.scan_s = 0.0
        self.stats = dict.fromkeys(COUNTERS, 0)
        self._lock = lock
        self._fps: dict[Layout, bytes | None] = {}
        self._buffers: list = []
        self._writing: set[DiskKey] = set()
        self._pinned_bytes = 0  # write-through values pinned until written
        self._ahead: dict[bytes, WriteJob] = {}  # pool key -> its write ahead in flight
        self._pinned_limit_bytes = arena.capacity_bytes // PINNED_SHARE
        self._ahead_held_until = 0.0  # a write failed: no writes ahead until then
        self._epoch = 0  # CLEARs so far
        self._fetch_jobs: dict[tuple, DiskFetchJob] = {}
        self._local = threading.local()  # each worker thread's slot buffer
        self._log = RateLimitedLog()
        self._runner = jobs
        self._writes = jobs.add_queue("disk-writer", self._write, self._finish_writes,
                                      num_threads=NUM_THREADS)
        self._reads = jobs.add_queue("disk-reader", self._read, self._finish_reads,
                                     num_threads=NUM_THREADS)

    # ------------------------------------------------------------- geometry
    def _num_slots(self, slot_bytes: int) -> int:
        return (self.capacity_bytes - 4096) // slot_bytes

    def load(self, progress: Callable[[int, int], None] | None = None) -> int:
        """At start: open the slot file left by an earlier daemon (if any) with its slot
        size and rebuild the index from its envelopes (warm restart).

        Returns:
            How many chunks were found.

        Raises:
            OSError: the file cannot be opened or sized.
        """
        found = read_superblock(self.directory)
        if found is None:
            return 0
        return self._open(found[0], progress)

    def set_block_bytes(self, block_bytes: int,
                        progress: Callable[[int, int], None] | None = None) -> None:
        """Size the slots for the arena's blocks (once the block size is known); a slot
        file of another slot size is formatted anew, its chunks dropped (logged).

        Raises:
            OSError: the file cannot be created or sized.
        """
        slot_bytes = slot_bytes_for(block_bytes)
        if self.slots is None or self.slots.slot_bytes != slot_bytes:
            self._open(slot_bytes, progress)

    def _open(self, slot_bytes: int, progress) -> int:
        num_slots = self._num_slots(slot_bytes)
        if num_slots < 1:
            logger.warning("disk tier %s: --disk-capacity %d bytes holds no slot of %d bytes: "
                           "the disk tier is off", self.directory, self.capacity_bytes, slot_bytes)
            return 0
        if self.slots is not None:
            self.slots.close()
        self.slots, kept = SlotFile.open(self.directory, slot_bytes, num_slots)
        self.index = DiskIndex(num_slots)
        num_buffers = max(MIN_WRITE_BUFFERS, WRITE_QUEUE_BYTES // slot_bytes)
        self._buffers = [aligned_buffer(slot_bytes) for _ in range(num_buffers)]
        for buffer in self._buffers:  # touched now, not by the first spills' copies
            np.frombuffer(buffer, dtype=np.uint8).fill(0)
        if kept:
            started = time.monotonic()
            self.num_restored = self.index.rebuild(self.slots.scan(progress))
            self.scan_s = time.monotonic() - started
        logger.info("disk tier %s: %d slots of %d bytes (%s I/O), %d chunks found in %.2f s",
                    self.slots.path, num_slots, slot_bytes,
                    "O_DIRECT" if self.slots.direct else "buffered", self.num_restored,
                    self.scan_s)
        return self.num_restored

    # ------------------------------------------------------------ namespaces
    def _ns_fp(self, ns: int) -> bytes | None:
        """The fingerprint of namespace `ns` when its chunks may go to disk (not a
        key-value namespace), else None."""
        layout = self.layout_of(ns)
        if layout is None:
            return None
        fp = self._fps.get(layout, b"")
        if fp == b"":
            fp = None if layout.fmt == "kv" else namespace_fingerprint(layout)
            self._fps[layout] = fp
        return fp

    def _disk_key(self, pool_key: bytes) -> DiskKey | None:
        if pool_key[0] != _CHUNK_TAG:
            return None
        fp = self._ns_fp(int.from_bytes(pool_key[1:5], "little"))
        return None if fp is None else (fp, pool_key[5:])

    # ---------------------------------------------------------------- writes
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

    # --------------------------------------------------------------- fetches
    def start_fetch(self, pool: BlockPool, namespaces: list[int], prefixes: list[bytes],
                    hashes: bytes, first: int,
                    prefix_blocks: Callable[[], list[KVCacheBlock]]) -> DiskFetchJob | None:
        """Start (or join) a fetch of the run of `hashes[first:]` the disk holds in every
        listed namespace (loop thread). None, and nothing started, when the disk holds
        no such chunk, a namespace is not on disk, MAX_FETCH_JOBS are in flight, or the
        arena has no room for the first chunk.

        Args: as `L2Tier.start_fetch` (lmcached/daemon/l2/tier.py).
        """
        index = self.index
        if index is None:
            return None
        fps = [self._ns_fp(ns) for ns in namespaces]
        if None in fps:
            return None
        chunk_hashes = [hashes[i:i + 16] for i in range(first * 16, len(hashes), 16)]
        if not all(index.get((fp, chunk_hashes[0])) for fp in fps):
            return None
        key = (tuple(namespaces), chunk_hashes[0], chunk_hashes[-1])
        job = self._fetch_jobs.get(key)
        if job is not None:
            self.stats["fetches_joined"] += 1
            return job
        if len(self._fetch_jobs) >= MAX_FETCH_JOBS:
            self.stats["fetches_skipped"] += 1
            return None
        job = DiskFetchJob(key, list(namespaces), fps)
        total = num_run = 0
        for chunk_hash in chunk_hashes:
            entries = [index.get((fp, chunk_hash)) for fp in fps]
            if None in entries or (job.items and total > MAX_FETCH_BYTES):
                break
            i = first + num_run
            parent = hashes[(i - 1) * 16:i * 16] if i else ROOT_HASH
            for fp, prefix, entry in zip(fps, prefixes, entries):
                job.items.append(ReadItem((fp, chunk_hash), prefix + chunk_hash, entry.slot,
                                          entry.record_bytes, parent))
                index.start_read(entry.slot)  # before any allocation can evict a slot
                total += entry.record_bytes
            num_run += 1
        # The chain's arena parts before and after the run are pinned until the job ends:
        # installing the run never evicts the rest of the chain it completes.
        held = prefix_blocks()
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
        self._fetch_jobs[key] = job
        self.stats["fetches"] += 1
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
                self.stats["fetch_nospace"] += 1
                for rest in job.items[n:]:
                    self.index.end_read(rest.slot)
                break
            for i, block in enumerate(blocks):
                block.num_bytes = min(block_bytes, item.record_bytes - i * block_bytes)
            item.blocks = blocks
            kept.append(item)
        job.items = kept

    def _thread_buffer(self):
        """This worker thread's page-aligned buffer of one slot."""
        slot_bytes = self.slots.slot_bytes
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < slot_bytes:
            buffer = self._local.buffer = aligned_buffer(slot_bytes)
        return buffer

    def _read(self, batches: list[ReadBatch]) -> None:
        """Reader thread: read, verify and copy each chunk of a batch into its blocks;
        after a chunk that fails, the rest of the batch is skipped."""
        arena = self.arena
        for batch in batches:
            started = time.perf_counter()
            buffer = self._thread_buffer()
            failed = False
            for item in batch.items:
                if failed or self._reads.stopping:
                    item.failure = "skipped"
                    continue
                try:
                    value = self.slots.read(item.slot, item.record_bytes, buffer)
                    record = verify_value(value, item.key[0], item.key[1], item.parent)
                    src = np.frombuffer(record, dtype=np.uint8)
                    pos = 0
                    for block in item.blocks:
                        n = block.num_bytes
                        np.copyto(arena.numpy_view(arena.block_offset(block.block_id), n),
                                  src[pos:pos + n])
                        pos += n
                except L2VerifyError as exc:
                    item.failure = f"verify_{exc.reason}"
                except Exception as exc:  # noqa: BLE001 - an I/O error is a miss (the loop logs)
                    item.failure = f"errors_{error_kind(exc)}: {exc}"
                failed = item.failure is not None
            batch.busy_us = int((time.perf_counter() - started) * 1e6)
            self._reads.post(batch)

    def _finish_reads(self, batches: list[ReadBatch]) -> None:
        """Commit what was read and verified, drop the slots that failed; after a fetch's
        last batch, unpin its chain (loop thread)."""
        pool, index, stats = self.pool, self.index, self.stats
        for batch in batches:
            job = batch.job
            stats["read_busy_us"] += batch.busy_us
            current = all(self._ns_fp(ns) == fp for ns, fp in zip(job.namespaces, job.fps))
            for item in batch.items:
                index.end_read(item.slot)
                if item.failure is None and current and pool.commit(item.blocks, item.pool_key):
                    job.held.extend(item.blocks)
                    if item.key in index.entries:
                        index.touch(item.key)
                    stats["fetch_hit_chunks"] += 1
                    stats["fetch_bytes"] += item.record_bytes
                    continue
                pool.abort(item.blocks)
                if item.failure in (None, "skipped"):
                    continue
                stats["fetch_failures"] += 1
                if item.failure.startswith("errors_"):
                    kind, _, detail = item.failure.partition(": ")
                    stats[kind] = stats.get(kind, 0) + 1
                    self._log.warning("disk tier %s: a read failed (%s); counted in INFO "
                                      "disk_%s, the chunk is a miss", self.directory, detail,
                                      kind)
                else:
                    name = f"fetch_{item.failure}"
                    stats[name] = stats.get(name, 0) + 1
                entry = index.get(item.key)
                if entry is not None and entry.slot == item.slot:
                    index.drop(item.key)  # a slot that failed once is never read again
            job.num_batches -= 1
            if job.num_batches:
                continue
            if job.held:
                pool.free(job.held)
            job.held = []
            job.done = True
            self._fetch_jobs.pop(job.key, None)

    # ------------------------------------------------------------------ info
    def info(self) -> dict[str, int | float | str]:
        """INFO section `disk` (docs/operator.md, "The disk tier")."""
        slots, index, stats = self.slots, self.index, self.stats
        out: dict[str, int | float | str] = {
            "disk_enabled": 1,
            "disk_path": self.directory,
            "disk_policy": self.policy,
            "disk_direct_io": int(bool(slots and slots.direct)),
            "disk_capacity_bytes": self.capacity_bytes,
            "disk_slot_bytes": slots.slot_bytes if slots else 0,
            "disk_slots": slots.num_slots if slots else 0,
            "disk_used_slots": len(index.entries) if index else 0,
            "disk_stored_bytes": index.num_stored_bytes if index else 0,
            "disk_restored_chunks": self.num_restored,
            "disk_scan_s": round(self.scan_s, 3),
            "disk_queue_values": len(self._writing),
            "disk_fetches_in_flight": len(self._fetch_jobs),
            "disk_evictions": index.num_evictions if index else 0,
        }
        for name in COUNTERS:
            out[f"disk_{name}"] = stats[name]
        for kind in ERROR_KINDS:
            out[f"disk_errors_{kind}"] = stats.get(f"errors_{kind}", 0)
        for name in sorted(stats):
            if name.startswith("fetch_verify_"):
                out[f"disk_{name}"] = stats[name]
        return out

    # --------------------------------------------------------------- teardown
    def close(self) -> None:
        """Stop the threads (queued writes get CLOSE_DRAIN_S to reach the disk), close
        the file and drop the directory's lock. Loop thread, before the arena is
        unmapped."""
        deadline = time.monotonic() + CLOSE_DRAIN_S
        self._writes.stop(drain=True)
        self._reads.stop()
        dropped = self._writes.join(deadline)
        left = self._reads.join(deadline)
        for queue in (self._writes, self._reads):
            queue.finish_done()
            self._runner.remove_queue(queue)
        for job in dropped:
            if job.mode == "pinned" and self.pool is not None:
                self._pinned_bytes -= job.record_bytes
                self.pool.free(job.blocks)
        if dropped:
            logger.warning("stopping: %d chunk writes to the disk tier were still queued: "
                           "dropped", len(dropped))
        for batch in left:
            for item in batch.items:
                item.failure = "skipped"
        if left and self.pool is not None:
            self._finish_reads(left)
        if self.slots is not None:
            self.slots.close()
        self._lock.release()
