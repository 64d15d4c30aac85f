"""The daemon's disk tier: chunks spilled to a local slot file, fetched back on a miss,
and found again after a restart.

Why this file exists: it is the glue between the block pool (loop thread) and the slot
file (`slots.py`, worker threads), a sibling of the L2 tier (lmcached/daemon/l2/tier.py)
with the same shape: job queues of the daemon's runner (`jobs.py`), completions applied
on the loop, a fetch that a LOOKUP / ACQUIRE waits for with a bound (`replies.Deferred`).
`DiskTier` holds the state; its write methods are in `writes.py`, its fetch methods in
`fetch.py`, the save on stop in `save.py`, the prewarm after a restart in `prewarm.py`,
and the LRU order kept across a restart in `recency.py`.

Flows (docs/operator.md, "The disk tier"):

- on-evict (default): once fewer than 1/AHEAD_SHARE of the arena's blocks are empty, the
  least recently used chunks (next in line for eviction, up to that share) are written
  ahead by the writer threads straight from their blocks, unpinned (`write_ahead`), so
  that their eviction costs nothing: the block pool's `on_evict` hook (`spill`) finds
  them on disk and only moves them to the back of the disk LRU. A chunk evicted before
  it was written ahead is dropped and counted, never copied in the loop (`writes.py`
  says why).
- write-through: every committed chunk is pinned and queued; the writer writes it from
  its blocks and unpins it through the loop.
- fetch on miss: a lookup that misses in the arena at chunk i, while the disk index holds
  chunk i (of every namespace asked), starts a `DiskFetchJob`: the loop pins the arena's
  part of the chain, allocates WRITING blocks for the run the disk holds, a reader thread
  reads each slot's envelope page and record straight into those blocks and verifies
  them there (`envelope.verify_parts`: envelope, checksum, token ids); the loop commits
  what verified and aborts the rest, forgetting their slots (counted,
  `disk_fetch_verify_*`). A fetch of the same chain in flight is joined.
- records move between the arena's blocks and the slot file with no copy (slots.py's
  layout; `_in_place`), through a thread's buffer only where O_DIRECT cannot (blocks
  that are not whole pages).
- warm restart: the slot file is opened before the daemon listens (`open_file`), and its
  index rebuilt from the slots' envelopes while the daemon answers in its `loading` state,
  before it says READY (`rebuild_index`); checksums are verified when a slot is read.

Faults (ENOSPC, EIO, EROFS, a truncated file) are counted by kind (`disk_errors_*`),
logged at most once per interval, and are misses or dropped writes for clients.

A capacity that holds no slot (a percentage of a nearly full filesystem, or a slot size
known only when the first layout sets the block size) turns the tier off rather than
stopping the daemon: `disk_enabled:0` and `disk_off_reason` in INFO, one ERROR line naming
how the capacity was derived and the free space and sizes that would fit. The arena serves
on (a full disk is often transient: logs), and a daemon that derives its block size from
the first client could not refuse at start anyway. A capacity in bytes larger than the free
space is still refused at start (lmcached/daemon/startup.py): that number is a mistake.
"""

import threading
import time
from collections.abc import Callable, Iterator

from lmcached.daemon.disk.counters import DiskStats
from lmcached.daemon.disk.directory import DirectoryLock, DiskDirectory, DiskDirectoryError
from lmcached.daemon.disk.fetch import MAX_FETCH_JOBS, DiskFetches
from lmcached.daemon.disk.index import DiskEntry, DiskIndex, DiskKey
from lmcached.daemon.disk.prewarm import DiskPrewarm, Prewarm
from lmcached.daemon.disk.recency import restore_recency, write_recency
from lmcached.daemon.disk.save import DiskSave
from lmcached.daemon.disk.scan import scan_slots
from lmcached.daemon.disk.slots import PAGE_BYTES, SlotFile, aligned_buffer, \
    read_superblock, round_up, slot_bytes_for
from lmcached.daemon.disk.writes import DiskWrites, WriteJob
from lmcached.daemon.keys import CHUNK_TAG
from lmcached.daemon.spill.envelope import namespace_fingerprint
from lmcached.daemon.ratelimit import RateLimitedLog
from lmcached.wire.logger import init_logger
from lmcached.wire.units import format_bytes
from lmcached.wire.protocol import Layout
from lmcached.shm.arena import Arena
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.jobs import JobRunner
from lmcached.daemon.spill.counters import info_fields
from lmcached.daemon.spill.tier import FetchJobs, SpillTier

logger = init_logger(__name__)

POLICIES = ("on-evict", "write-through")
NUM_THREADS = 2  # writer threads, and as many reader threads
PINNED_SHARE = 4  # write-through pins at most 1/PINNED_SHARE of the arena (as L2's)
CLOSE_DRAIN_S = 5.0  # graceful stop: queued writes get this long to reach the disk
_CHUNK_TAG = CHUNK_TAG[0]


class DiskTier(DiskWrites, DiskFetches, DiskSave, DiskPrewarm, SpillTier):
    """Spills chunks to a slot file and fetches misses back (module docstring); a
    `SpillTier`.

    Args:
        directory: the checked disk directory, held open; lock: its lock. The tier owns
            both until `close`.
        capacity_bytes: bytes the slot file may take.
        capacity_source: how the capacity was derived, for messages (e.g. "--disk-capacity
            10% of the 1.00M free in /var/cache/lmcached/default"); default: the bytes.
        capacity_percent: the percentage of the free space it is, or None (bytes given).
        policy: "on-evict" or "write-through".
        fetch_wait_s: how long a LOOKUP / ACQUIRE waits for a disk fetch, in seconds.
        arena: the daemon's arena (records are copied in and out of its blocks).
        jobs: the daemon's job runner: the tier adds "disk-writer" and "disk-reader"
            queues of NUM_THREADS threads each.
        layout_of: namespace id -> its Layout, or None for a freed id (the service's).

    Attributes:
        slots: the slot file, or None until the block size is known.
        index: chunk -> slot, or None until the block size is known (empty until
            `rebuild_index` when `needs_rebuild`).
        needs_rebuild: the slot file holds an earlier daemon's slots, not yet indexed.
        pool: the host arena's block pool, once the service set it (`set_pool`).
        counts: the tier's counters (`DiskStats`).
        off_reason: why the capacity holds no slot (the tier is off), else None.

    Raises:
        ValueError: unknown policy, capacity below one page, fetch_wait_s < 0.
    """

    name = "disk"

    def __init__(self, directory: DiskDirectory, lock: DirectoryLock, *, capacity_bytes: int,
                 policy: str, fetch_wait_s: float, arena: Arena, jobs: JobRunner,
                 layout_of: Callable[[int], Layout | None] = lambda ns: None,
                 capacity_source: str = "", capacity_percent: float | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"disk policy {policy!r}: use one of {', '.join(POLICIES)}")
        if fetch_wait_s < 0:
            raise ValueError(f"disk fetch wait {fetch_wait_s} s: must be >= 0")
        self.directory = directory.path  # for messages and INFO
        self.disk_directory = directory
        self.events = None  # the daemon's EventFeed, given to each index (`set_events`)
        self.capacity_bytes = capacity_bytes
        self.capacity_source = capacity_source or f"--disk-capacity {capacity_bytes}"
        self.capacity_percent = capacity_percent
        self.off_reason: str | None = None
        self.policy = policy
        self.fetch_wait_s = fetch_wait_s
        self.arena = arena
        self.layout_of = layout_of
        self.slots: SlotFile | None = None
        self.index: DiskIndex | None = None
        self.pool: BlockPool | None = None
        self.num_restored = 0
        self.scan_s = 0.0
        self.needs_rebuild = False
        self.counts = DiskStats()
        self._lock = lock
        self._fps: dict[Layout, bytes | None] = {}
        self._writing: set[DiskKey] = set()
        self._pinned_bytes = 0  # write-through values pinned until written
        self._ahead: dict[bytes, WriteJob] = {}  # pool key -> its write ahead in flight
        self._pinned_limit_bytes = arena.capacity_bytes // PINNED_SHARE
        self._ahead_held_until = 0.0  # a write failed: no writes ahead until then
        self._epoch = 0  # CLEARs so far
        self._fetch_jobs = FetchJobs(MAX_FETCH_JOBS, self.counts)
        self._local = threading.local()  # each worker thread's slot buffer
        self._log = RateLimitedLog(logger)
        self._runner = jobs
        self._writes = jobs.add_queue("disk-writer", self._write, self._finish_writes,
                                      num_threads=NUM_THREADS)
        self._reads = jobs.add_queue("disk-reader", self._read, self._finish_reads,
                                     num_threads=NUM_THREADS)
        self._prewarm = Prewarm()
        self._prewarm_reads = jobs.add_queue("disk-prewarm", self._prewarm_read,
                                             self._finish_prewarm)
        self.num_recency_restored = 0

    # ------------------------------------------------------------- geometry
    def _num_slots(self, slot_bytes: int) -> int:
        return (self.capacity_bytes - PAGE_BYTES) // slot_bytes

    def open_file(self, block_bytes: int = 0) -> bool:
        """At start, before the daemon listens: open the slot file with slots for blocks
        of `block_bytes` (the arena's, when known), else with the slot size of the file an
        earlier daemon left (if any). The index stays empty until `rebuild_index`.

        Returns:
            Whether the file kept the slots of an earlier daemon: `rebuild_index` must
            read their envelopes (warm restart); also `needs_rebuild`.

        With `block_bytes` (`--block-size`), a file of another slot size is formatted
        anew and its chunks dropped (logged): the operator chose the block size.

        Raises:
            DiskDirectoryError: the slot file is not a regular file of ours.
            OSError: the file cannot be opened, created or sized.
        """
        if block_bytes:
            return self._open(slot_bytes_for(block_bytes))
        found = read_superblock(self.disk_directory)
        return False if found is None else self._open(found[0])

    def set_block_bytes(self, block_bytes: int) -> None:
        """The arena's block size is known now (the first layout that attached set it,
        or `--block-size`): size the slots for its blocks, unless the tier already has a
        slot file. A file an earlier daemon left keeps its slot size and its chunks
        whatever the first layout is, never formatted anew here: records that fit its
        slots (those of the layouts that wrote it, whatever blocks they span now) are
        written and fetched as before; larger ones are not written to disk, and a
        warning names the file, its slot size and the `--block-size` to pass
        (`_warn_kept_slots`).

        Raises:
            DiskDirectoryError: the slot file is not a regular file of ours.
            OSError: the file cannot be created or sized.
        """
        if self.slots is None:
            found = read_superblock(self.disk_directory)
            if self._open(found[0] if found else slot_bytes_for(block_bytes)):
                self.rebuild_index()
        if self.slots is not None and self.slots.slot_bytes != slot_bytes_for(block_bytes):
            self._warn_kept_slots(block_bytes)

    def _warn_kept_slots(self, block_bytes: int) -> None:
        """Say that the slot file keeps slots sized for other blocks than the arena's."""
        slots = self.slots
        num_chunks = len(self.index.entries) if self.index is not None else 0
        if block_bytes <= slots.max_record_bytes:
            logger.info("disk tier %s keeps its slots of %d bytes (records up to %d bytes) "
                        "and its %d chunks; the arena's blocks are %d bytes", slots.path,
                        slots.slot_bytes, slots.max_record_bytes, num_chunks, block_bytes)
            return
        logger.warning(
            "disk tier %s keeps its slots of %d bytes (records up to %d bytes) and its %d "
            "chunks, written by an earlier daemon; the first layout that attached set "
            "blocks of %d bytes: records larger than %d bytes are not written to disk (INFO "
            "disk_write_drops_oversize). Start the daemon with --block-size %d to keep this "
            "file whichever client attaches first, or with --block-size %d to size the "
            "slots for these blocks (the file is then formatted anew and its chunks dropped)",
            slots.path, slots.slot_bytes, slots.max_record_bytes, num_chunks, block_bytes,
            slots.max_record_bytes, slots.max_record_bytes, round_up(block_bytes))

    def turn_off_unless_it_holds(self, slot_bytes: int) -> bool:
        """Turn the tier off (`off_reason`, one ERROR line) when its capacity holds no slot
        of `slot_bytes`; the message names the capacity's source and the sizes that fit.

        Returns:
            Whether the tier is off.
        """
        if self._num_slots(slot_bytes) >= 1:
            return False
        need = PAGE_BYTES + slot_bytes
        reason = (f"{self.capacity_source} is {self.capacity_bytes} bytes, less than one slot "
                  f"of {slot_bytes} bytes and the file's {PAGE_BYTES}-byte header ({need} bytes)")
        if self.capacity_percent:
            fix = (f"free at least {format_bytes(-(-need * 100 // self.capacity_percent))} "
                   f"there (many times that for a useful tier), or give --disk-capacity in "
                   f"bytes (at least {need})")
        else:
            fix = f"give --disk-capacity at least {need} bytes (many slots for a useful tier)"
        if reason != self.off_reason:
            logger.error("disk tier %s is off: %s; %s. The daemon serves from the arena alone",
                         self.directory, reason, fix)
        self.off_reason = reason
        return True

    def _open(self, slot_bytes: int) -> bool:
        num_slots = self._num_slots(slot_bytes)
        off = self.turn_off_unless_it_holds(slot_bytes)
        if self.slots is not None:
            self.slots.close()
            self.slots, self.index = None, None
        if off:
            return False
        self.off_reason = None
        self.slots, self.needs_rebuild = SlotFile.open(self.disk_directory, slot_bytes,
                                                       num_slots)
        self.index = DiskIndex(num_slots)
        self.index.events = self.events
        self.num_restored, self.scan_s = 0, 0.0
        if not self.needs_rebuild:
            self._log_opened()
        return self.needs_rebuild

    def rebuild_index(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Rebuild the index from the envelopes of the slots `open_file` kept (warm
        restart). Runs on any one thread while nothing else uses the tier (the daemon
        answers in its `loading` state meanwhile); the index is replaced at the end.

        Args:
            progress: `scan.scan_slots`'s: called as progress(done_slots, num_slots) from
                the scan's threads; what it raises stops the scan and is raised here.

        Returns:
            How many chunks were found.

        Raises:
            OSError: the slot file cannot be opened for the scan. A slot whose envelope
                cannot be read is not an error: it is skipped as empty, counted in
                `disk_errors_<kind>` and logged (`scan.scan_slots`).
        """
        started = time.monotonic()
        index = DiskIndex(self.slots.num_slots)
        num_restored = index.rebuild(scan_slots(self.slots, progress))
        self.num_recency_restored = restore_recency(self.disk_directory, index,
                                                    self.slots.slot_bytes)
        index.events = self.events
        self.index, self.num_restored = index, num_restored
        self.scan_s = time.monotonic() - started
        self.needs_rebuild = False
        for kind, count in self.slots.scan_errors.items():
            self.counts.count_error(kind, count)
            logger.error("disk tier %s: %d slot envelope(s) could not be read at start (%s): "
                         "those slots are taken as empty and their chunks are lost; check "
                         "the drive (dmesg, smartctl)", self.slots.path, count, kind)
        self._log_opened()
        return num_restored

    def _log_opened(self) -> None:
        logger.info("disk tier %s: %d slots of %d bytes (%s I/O), %d chunks found in %.2f s",
                    self.slots.path, self.slots.num_slots, self.slots.slot_bytes,
                    "O_DIRECT" if self.slots.direct else "buffered", self.num_restored,
                    self.scan_s)

    # ------------------------------------------------- the SpillTier protocol
    def set_pool(self, pool: BlockPool, block_bytes: int) -> None:
        """The host pool exists, its blocks `block_bytes` long: size the slot file for
        them (`set_block_bytes`). A file that cannot be sized leaves the tier unused
        (logged), never a client's error."""
        self.pool = pool
        try:
            self.set_block_bytes(block_bytes)
        except (OSError, DiskDirectoryError) as exc:
            logger.error("the disk tier cannot size its slot file for blocks of %d bytes "
                         "(%s): it stays unused", block_bytes, exc)

    def set_layouts(self, layout_of: Callable[[int], Layout | None]) -> None:
        """Namespaces' layouts are looked up through `layout_of` when a chunk meets the
        tier (`_ns_fp`)."""
        self.layout_of = layout_of

    def register_namespace(self, ns: int, layout: Layout) -> None:
        """Plan the prewarm of the namespace's hottest disk chunks (`prewarm_namespace`);
        layouts themselves are looked up lazily (`set_layouts`)."""
        self.prewarm_namespace(ns)

    def set_events(self, events) -> None:
        """Announce the chunks entering and leaving the disk index to `events` (the
        daemon's EventFeed), this index's and every rebuilt one's."""
        self.events = events
        if self.index is not None:
            self.index.events = events

    def housekeeping(self) -> None:
        """Writes ahead of eviction (`write_ahead`), the slot file's check
        (`check_file`) and the prewarm's next batch (`prewarm_pump`)."""
        self.write_ahead()
        self.check_file()
        self.prewarm_pump()

    def stats(self) -> DiskStats:
        """The tier's counters."""
        return self.counts

    # ------------------------------------------------- the event feed's snapshot
    def snapshot_keys(self) -> Iterator[DiskKey]:
        """The keys on disk, most recently used first (`SpillTier.snapshot_keys`)."""
        return reversed(self.index.entries) if self.index is not None else iter(())

    def chunk_parent(self, key: DiskKey) -> bytes | None:
        """The parent hash its slot keeps of the chunk `key` on disk, or None (not on
        disk): an index lookup (`SpillTier.chunk_parent`)."""
        entry = self.index.get(key) if self.index is not None else None
        return None if entry is None else entry.parent

    def token_ids(self, key: DiskKey) -> bytes | None:
        """The token ids of the chunk `key` on disk (int64 little-endian bytes), or None
        (not on disk, its slot holds another record, or the read failed): one read of
        its record's first pages on the calling thread (the event feed's snapshot, on
        the loop thread, a bounded number a page), unverified: whoever uses them hashes
        them (`SlotFile.read_token_ids`)."""
        entry = self.index.get(key) if self.index is not None else None
        if entry is None or self.slots is None:
            return None
        buffer = getattr(self._local, "tokens", None)  # not a record's bounce buffer
        if buffer is None or len(buffer) < self.slots.max_record_bytes:
            buffer = self._local.tokens = aligned_buffer(self.slots.max_record_bytes)
        try:
            return self.slots.read_token_ids(entry.slot, key[1], buffer) or None
        except OSError:
            return None

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
            if fp is not None:
                self._warn_oversize(layout)
        return fp

    def _warn_oversize(self, layout) -> None:
        """Say once per namespace, when its chunks first meet the disk tier, that its
        records are larger than a slot (they are never spilled) and how to fix it."""
        slots = self.slots
        if slots is None or layout.record_bytes <= slots.max_record_bytes:
            return
        logger.warning(
            "disk tier %s: chunks of %s are %d-byte records, larger than a slot's %d "
            "bytes of record pages: they are never written to disk (INFO "
            "disk_write_drops_oversize); start the daemon with --block-size %d or more",
            self.directory, layout.model_name, layout.record_bytes, slots.max_record_bytes,
            round_up(layout.record_bytes))

    def _disk_key(self, pool_key: bytes) -> DiskKey | None:
        if pool_key[0] != _CHUNK_TAG:
            return None
        fp = self._ns_fp(int.from_bytes(pool_key[1:5], "little"))
        return None if fp is None else (fp, pool_key[5:])

    def _thread_page(self):
        """This worker thread's page-aligned buffer of one page (a slot's envelope page)."""
        page = getattr(self._local, "page", None)
        if page is None:
            page = self._local.page = aligned_buffer(PAGE_BYTES)
        return page

    def _thread_buffer(self):
        """This worker thread's page-aligned buffer of one slot's record, for the records
        that cannot move in place (`_in_place`)."""
        num_bytes = self.slots.max_record_bytes
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < num_bytes:
            buffer = self._local.buffer = aligned_buffer(num_bytes)
        return buffer

    def _in_place(self) -> bool:
        """Whether records move straight between their arena blocks and the slot file,
        with no copy: always with buffered I/O; with O_DIRECT when the arena's blocks are
        whole pages, so that each starts page-aligned (the mapping is, and its header is
        one page) and a record's last page, written or read whole, ends inside its block
        (the arena's last block included). Other blocks (a `--block-size` that is a
        multiple of 64 bytes only) go through a thread's buffer (`_thread_buffer`)."""
        return not self.slots.direct or self.arena.block_bytes % PAGE_BYTES == 0

    def _block_views(self, blocks: list, whole_pages: bool) -> list:
        """uint8 numpy views of a value's bytes in its arena blocks, in order: each
        block's `num_bytes`, or that rounded up to whole pages (`whole_pages`, O_DIRECT;
        only where `_in_place`)."""
        arena = self.arena
        return [arena.numpy_view(arena.block_offset(block.block_id),
                                 round_up(block.num_bytes) if whole_pages else block.num_bytes)
                for block in blocks]

    def check_file(self) -> bool:
        """Housekeeping (loop thread): whether the slot file was deleted under the
        daemon; logged at most once per interval. The tier goes on through its open
        descriptor, and its chunks are lost at the next start."""
        if self.slots is None or not self.slots.is_deleted():
            return False
        self._log.warning("disk tier %s: the slot file was deleted while the daemon runs; "
                          "chunks are served until the daemon stops and lost then: restart "
                          "it to create the file anew", self.directory)
        return True

    # ------------------------------------------------------------------ info
    def info(self) -> dict[str, int | float | str]:
        """INFO section `disk` (docs/operator.md, "The disk tier")."""
        slots, index, stats = self.slots, self.index, self.counts
        out: dict[str, int | float | str] = {
            "disk_enabled": int(self.off_reason is None),
            "disk_off_reason": self.off_reason or "",
            "disk_path": self.directory,
            "disk_policy": self.policy,
            "disk_direct_io": int(bool(slots and slots.direct)),
            "disk_file_deleted": int(bool(slots and slots.is_deleted())),
            "disk_capacity_bytes": self.capacity_bytes,
            "disk_slot_bytes": slots.slot_bytes if slots else 0,
            "disk_slots": slots.num_slots if slots else 0,
            "disk_used_slots": len(index.entries) if index else 0,
            "disk_stored_bytes": index.num_stored_bytes if index else 0,
            "disk_restored_chunks": self.num_restored,
            "disk_scan_s": round(self.scan_s, 3),
            "disk_recency_restored_chunks": self.num_recency_restored,
            **self.prewarm_info(),
            "disk_queue_values": len(self._writing),
            "disk_fetches_in_flight": len(self._fetch_jobs),
            "disk_evictions": index.num_evictions if index else 0,
        }
        out.update(info_fields(stats, "disk_"))
        return out

    # --------------------------------------------------------------- teardown
    def _save_recency(self) -> None:
        """Write the index's LRU order to the recency file (`recency.py`), so that the
        next start evicts in the order this daemon had. A failure is logged, never
        raised: the chunks stay, only their order is lost."""
        if self.slots is None or self.index is None:
            return
        try:
            count = write_recency(self.disk_directory, self.index, self.slots.slot_bytes)
        except (OSError, DiskDirectoryError) as exc:
            logger.warning("disk tier %s: the recency file cannot be written (%s): the next "
                           "start evicts the disk chunks in slot order", self.directory, exc)
            return
        logger.info("disk tier %s: the LRU order of its %d chunks saved", self.directory,
                    count)

    def close(self) -> None:
        """Stop the threads (queued writes get CLOSE_DRAIN_S to reach the disk), close
        the file, drop the directory's lock and close the directory. Loop thread, before
        the arena is unmapped."""
        deadline = time.monotonic() + CLOSE_DRAIN_S
        self.stop_prewarm(deadline)
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
        # Every slot a dropped job held may keep an envelope the index forgot (an erase
        # not done, the chunk a write evicted): erased here, or a restart serves it.
        self._erase([DiskEntry(job.slot, job.record_bytes) for job in dropped])
        if dropped:
            logger.warning("stopping: %d chunk writes to the disk tier were still queued: "
                           "dropped", len(dropped))
        for batch in left:
            for item in batch.items:
                item.failure = "skipped"
        if left and self.pool is not None:
            self._finish_reads(left)
        self._save_recency()
        if self.slots is not None:
            self.slots.close()
        self._lock.release()
        self.disk_directory.close()
