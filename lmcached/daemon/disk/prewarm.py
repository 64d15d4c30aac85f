"""The disk tier's prewarm: after a restart, the hottest disk chunks read back into the
arena in the background, so that the first requests hit in memory.

Why this file exists: a restarted daemon finds its chunks on disk (the warm-restart
scan), but a request that would have hit the arena before the stop now waits for a disk
fetch. After PostgreSQL's pg_prewarm autoprewarm, which loads the blocks recorded at
shutdown back into shared buffers in the background at start. `DiskPrewarm` is a part
of `DiskTier`; its state is `Prewarm` (the tier's `_prewarm`).

Trigger: a disk chunk maps to an arena key only once a layout with its namespace
fingerprint attached (HELLO) and the block size is known, so a namespace is prewarmed
when it registers (`prewarm_namespace`), once per fingerprint in the daemon's life.
Its chunks on disk are taken from the back of the disk LRU (the order the recency file
restored: `recency.py`), hottest first, as many as the arena's EMPTY blocks hold. The
disk index may hold millions of chunks, most of them other namespaces': the plan walks
a copy of its order (taken once) PREWARM_PLAN_BATCH entries at a time (`prewarm_plan`),
the first batch at the registration, the next ones by the housekeeping's pump, and the
reads start once the walk is over (so that they keep the disk's order).

Bounds, so that it never delays READY, a request or a store:

- it starts after READY (a HELLO is answered only then) and never evicts: each chunk is
  read into empty blocks (`BlockPool.allocate_empty`); when stores took some meanwhile,
  the coldest planned chunks are dropped (counted in `disk_prewarm_skipped`);
- low priority: one small batch (PREWARM_BATCH_CHUNKS chunks) at a time on its own
  reader thread, started only while no fetch of a request is in flight (`prewarm_pump`:
  by the housekeeping, so that a client's first requests after its HELLO, and the
  fetches they start, come first; then after each batch);
- a chunk the arena holds already (a client stored it meanwhile) is skipped.

Each chunk is verified as a request's fetch is (envelope, checksum, its record's header
and chunk hash) except the chain check, which needs the request's parent hash: the
readers verify token ids against their request before use, as for any arena chunk.
Batches are read coldest first (of the planned set: the hottest that fit), so that the
arena's LRU order after the prewarm is the disk's, the hottest the most recent; what
stores take from the room is taken from the coldest planned chunks.
"""

import collections
import time

from lmcached.daemon.disk.fetch import ReadItem
from lmcached.daemon.disk.index import DiskKey
from lmcached.daemon.disk.slots import error_kind
from lmcached.daemon.keys import chunk_prefix
from lmcached.daemon.spill.envelope import VerifyError
from lmcached.wire.record_format import ROOT_HASH
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

PREWARM_BATCH_CHUNKS = 8  # chunks one prewarm read takes (one batch in flight at a time)
PREWARM_PLAN_BATCH = 4096  # disk index entries one planning step examines (loop thread)
STATES = ("idle", "running", "done", "off")


class Prewarm:
    """The prewarm's state (loop thread).

    Attributes:
        state: "idle" (nothing to prewarm yet), "running", "done" (every planned chunk
            read, skipped or dropped), "off" (no disk tier index).
        pending: (namespace id, disk key, blocks it needs) still to read, hottest first.
        pending_blocks: the blocks `pending` needs together.
        trimmed: planned chunks were dropped because stores took the empty blocks.
        planned_fps: fingerprints whose namespace was prewarmed (once each).
        walks: plans in progress, as [namespace id, fingerprint, the disk index's keys
            most recently used first (a copy), next position, chunks planned].
        visited: disk index entries the plans examined (`prewarm_plan`).
        in_flight: the batch being read, or None.
        generation: the pool's `clear_generation` when it started (after a CLEAR, it
            installs nothing).
        chunks, bytes, skipped, failures: chunks read into the arena, their bytes,
            chunks skipped (in the arena already, gone from disk), chunks that failed.
        started, elapsed_s: when the first plan started (time.monotonic()), and how
            long until the last batch ended.
    """

    def __init__(self) -> None:
        self.state = "idle"
        self.pending: collections.deque[tuple[int, DiskKey, int]] = collections.deque()
        self.pending_blocks = 0
        self.trimmed = False
        self.planned_fps: set[bytes] = set()
        self.walks: collections.deque[list] = collections.deque()
        self.visited = 0
        self.in_flight: list[ReadItem] | None = None
        self.generation = 0
        self.chunks = self.bytes = self.skipped = self.failures = 0
        self.started = 0.0
        self.elapsed_s = 0.0


class DiskPrewarm:
    """The prewarm methods of `DiskTier` (its state is `self._prewarm`)."""

    def prewarm_namespace(self, ns: int) -> int:
        """Start the plan of the prewarm of namespace `ns`'s chunks on disk (loop
        thread, when it registers), once per namespace fingerprint: its first
        PREWARM_PLAN_BATCH entries now (`prewarm_plan`), the rest from the pump.
        Returns how many chunks this first step planned."""
        state, index, pool = self._prewarm, self.index, self.pool
        if index is None or pool is None or self.slots is None:
            return 0
        fp = self._ns_fp(ns)
        if fp is None or fp in state.planned_fps:
            return 0
        state.planned_fps.add(fp)
        if not index.entries:
            return 0
        state.walks.append([ns, fp, list(reversed(index.entries)), 0, 0])
        return self.prewarm_plan()

    def prewarm_plan(self) -> int:
        """One planning step (loop thread): examine at most PREWARM_PLAN_BATCH disk
        index entries of the walks in progress, the hottest first; plan each chunk of
        the walk's namespace the arena does not hold, while the arena's empty blocks
        (less those planned) hold it. A walk ends at its last entry or when the room
        is full. Returns how many chunks were planned."""
        state, index, pool = self._prewarm, self.index, self.pool
        if index is None or pool is None:
            state.walks.clear()
            return 0
        block_bytes = self.arena.block_bytes
        entries, cached = index.entries, pool.cached
        budget = PREWARM_PLAN_BATCH
        planned = 0
        while state.walks and budget > 0:
            walk = state.walks[0]
            ns, fp, keys, pos, _ = walk
            prefix = chunk_prefix(ns)
            room = pool.num_empty_blocks - state.pending_blocks
            end = min(len(keys), pos + budget)
            full = False
            while pos < end:
                if room <= 0:
                    full = True
                    break
                key = keys[pos]
                pos += 1
                entry = entries.get(key)
                if key[0] != fp or entry is None or prefix + key[1] in cached:
                    continue
                need = -(-entry.record_bytes // block_bytes)
                if need > room:
                    full = True
                    break
                room -= need
                state.pending.append((ns, key, need))
                state.pending_blocks += need
                walk[4] += 1
                planned += 1
                if state.state != "running":
                    state.state, state.started = "running", time.monotonic()
            budget -= pos - walk[3]
            state.visited += pos - walk[3]
            walk[3] = pos
            if full or pos >= len(keys):
                state.walks.popleft()
                if walk[4]:
                    logger.info("disk tier %s: prewarming %d chunks of %s into the arena",
                                self.directory, walk[4], self.layout_of(ns).model_name)
        return planned

    def prewarm_pump(self) -> bool:
        """Start the next prewarm batch when none is in flight and no request's fetch is
        (loop thread): first the coldest planned chunks beyond what the arena's empty
        blocks hold now are dropped (stores took the room: never evict for a prewarm),
        then the batch is the coldest of the rest, so that the hottest chunk enters the
        arena's LRU last (the most recent), as it was before the stop. Returns whether
        a batch was started."""
        state, index, pool = self._prewarm, self.index, self.pool
        if (state.in_flight is not None or index is None or pool is None
                or self._prewarm_reads.stopping):
            return False
        if state.walks:
            self.prewarm_plan()
            if state.walks:
                return False  # the reads keep the disk's order: they wait for the plan
        pending = state.pending
        while state.pending_blocks > pool.num_empty_blocks:
            state.pending_blocks -= pending.pop()[2]
            state.skipped += 1
            state.trimmed = True
        if not pending:
            self._prewarm_ended()
            return False
        if self._fetch_jobs or len(self._reads):
            return False
        block_bytes = self.arena.block_bytes
        batch: list[ReadItem] = []
        while pending and len(batch) < PREWARM_BATCH_CHUNKS:
            ns, key, need = pending.pop()  # the coldest first
            state.pending_blocks -= need
            entry = index.get(key)
            pool_key = chunk_prefix(ns) + key[1]
            if entry is None or self._ns_fp(ns) != key[0] or pool_key in pool.cached:
                state.skipped += 1
                continue
            blocks = pool.allocate_empty(-(-entry.record_bytes // block_bytes))
            for i, block in enumerate(blocks):
                block.num_bytes = min(block_bytes, entry.record_bytes - i * block_bytes)
            item = ReadItem(key, pool_key, entry.slot, entry.record_bytes, ROOT_HASH)
            item.blocks = blocks
            index.start_read(entry.slot)
            batch.append(item)
        if not batch:
            self._prewarm_ended()
            return False
        state.in_flight, state.generation = batch, pool.clear_generation
        if not self._prewarm_reads.submit(batch):
            self._finish_prewarm([batch])
            return False
        return True

    def _prewarm_read(self, batches: list[list[ReadItem]]) -> None:
        """Prewarm reader thread: read and verify each chunk in its blocks
        (`_read_item`; the chain check is the readers', module docstring)."""
        for batch in batches:
            page = self._thread_page()
            for item in batch:
                if self._prewarm_reads.stopping:
                    item.failure = "skipped"
                    continue
                try:
                    self._read_item(item, page)
                except VerifyError as exc:
                    if not exc.slot_sound:  # slot_sound: only the chain check failed
                        item.failure = f"verify_{exc.reason}"
                except Exception as exc:  # noqa: BLE001 - an I/O error: the loop counts it
                    item.failure = f"errors_{error_kind(exc)}"
            self._prewarm_reads.post(batch)

    def _finish_prewarm(self, batches: list[list[ReadItem]]) -> None:
        """Commit the chunks read and verified, the batch's coldest first (loop thread);
        abort the others (a slot that failed its own checks is forgotten and erased, as
        a request's fetch does); then the next batch."""
        state, index, pool = self._prewarm, self.index, self.pool
        for batch in batches:
            for item in batch:  # the coldest first: the hottest is the most recent
                index.end_read(item.slot)
                current = (state.generation == pool.clear_generation
                           and self._ns_fp(int.from_bytes(item.pool_key[1:5], "little"))
                           == item.key[0])
                entry = index.get(item.key)
                parent = entry.parent if entry is not None and entry.slot == item.slot else b""
                if item.failure is None and current and pool.commit(item.blocks, item.pool_key,
                                                                    parent=parent):
                    pool.free(item.blocks)  # unpinned, at the back of the LRU
                    state.chunks += 1
                    state.bytes += item.record_bytes
                    continue
                pool.abort(item.blocks)
                if item.failure in (None, "skipped") or not current:
                    state.skipped += 1
                    continue
                state.failures += 1
                # disk_errors_<kind>, or disk_fetch_verify_<reason> as a fetch counts it
                if item.failure.startswith("errors_"):
                    self.counts.count_error(item.failure[len("errors_"):])
                else:
                    self.counts.count_rejected(item.failure[len("verify_"):])
                if entry is not None and entry.slot == item.slot:
                    index.forget(item.key)  # a slot that failed once is never read again
                    self._erase([entry])
            if batch is state.in_flight:
                state.in_flight = None
        if not self._prewarm_reads.stopping:
            self.prewarm_pump()

    def _prewarm_ended(self) -> None:
        """Every planned chunk was read, skipped or dropped: `done` (logged once)."""
        state = self._prewarm
        if (state.in_flight is not None or state.pending or state.walks
                or state.state != "running"):
            return
        state.state = "done"
        state.elapsed_s = time.monotonic() - state.started
        self._log_prewarm()

    def _log_prewarm(self) -> None:
        state = self._prewarm
        logger.info("disk tier %s: prewarm done: %d chunks (%d bytes) read into the arena "
                    "in %.2f s, %d skipped (in the arena already, gone from disk%s), %d "
                    "failed", self.directory, state.chunks, state.bytes, state.elapsed_s,
                    state.skipped, ", or no room left: stores took the empty blocks"
                    if state.trimmed else "", state.failures)

    def prewarm_info(self) -> dict[str, int | float | str]:
        """INFO section `disk`'s prewarm fields (docs/operator.md, "What a restart
        keeps")."""
        state = self._prewarm
        return {
            "disk_prewarm_state": state.state if self.index is not None else "off",
            "disk_prewarm_chunks": state.chunks,
            "disk_prewarm_bytes": state.bytes,
            "disk_prewarm_pending": len(state.pending) + len(state.in_flight or ()),
            "disk_prewarm_skipped": state.skipped,
            "disk_prewarm_failures": state.failures,
            "disk_prewarm_s": round(state.elapsed_s, 3),
        }

    def stop_prewarm(self, deadline: float) -> None:
        """Stop the prewarm reader (graceful stop, loop thread): batches in flight are
        aborted, nothing more is read."""
        state = self._prewarm
        state.pending.clear()
        state.walks.clear()
        state.pending_blocks = 0
        self._prewarm_reads.stop()
        left = self._prewarm_reads.join(deadline)
        self._prewarm_reads.finish_done()
        self._runner.remove_queue(self._prewarm_reads)
        for batch in left:
            for item in batch:
                item.failure = "skipped"
        if left and self.pool is not None:
            self._finish_prewarm(left)
