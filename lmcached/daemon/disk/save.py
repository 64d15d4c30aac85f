"""The disk tier's save on stop: the arena's chunks that are not on disk yet, written at a
graceful stop, most recently used first, within a budget.

Why this file exists: with the default on-evict policy only the chunks the arena evicted
reach the disk, so a restart would lose the arena's chunks, the most recently used ones
(docs/operator.md, "What a restart keeps"). After Redis, which saves on SHUTDOWN and on
SIGTERM (`shutdown-on-sigterm`), and PostgreSQL's pg_prewarm (the hot set recorded at
shutdown, `recency.py`). `DiskSave` is a part of `DiskTier` with no state of its own.

When: `Server._teardown` calls `save_on_stop` after the listener is closed and every
client connection ended (their pins released, their WRITING blocks aborted), and before
the tier closes: no client can change the arena's metadata meanwhile, and the bytes of
a READY block are written by no one. It runs on the loop thread and writes one chunk at
a time (`_write_value`, the writer threads' own path: envelope last); the writer threads
finish their queue meanwhile, into other slots.

Order and budget: most recently used first (pinned values, then the free queue from its
back), so that a budget that runs out leaves the coldest unwritten; the deadline is
checked before each chunk (one chunk's write is the overshoot). The disk's own LRU is
never turned against the arena's: a write that would evict a chunk the arena holds (the
disk is full of hotter chunks) ends the save. At the end the arena's chunks are moved to
the back of the disk LRU in the arena's order, so that the disk index (and the recency
file written at close) has the order the daemon had: chunks the arena held are more
recent than those it had evicted.
"""

import os
import time
from collections.abc import Callable

from lmcached.daemon.disk.index import DiskEntry
from lmcached.daemon.disk.writes import WriteJob
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

PROGRESS_INTERVAL_S = 1.0  # the log and systemd's STATUS= are updated at most this often
# Test seam: seconds each chunk's write takes at least (a slow disk); read by tests only.
SLOW_WRITE_ENV = "LMCACHED_TEST_DISK_SAVE_SLOW_S"


class DiskSave:
    """The save-on-stop method of `DiskTier` (a part of it, no state of its own)."""

    def save_on_stop(self, budget_s: float,
                     status: Callable[[str], None] = lambda text: None) -> dict[str, int]:
        """Write the arena's chunks that are not on disk yet, most recently used first,
        for at most `budget_s` seconds (module docstring). Loop thread, graceful stop,
        after every client connection ended; never raises (a failed write is counted
        and the save goes on).

        Args:
            budget_s: seconds the save may take; 0 = off (nothing written).
            status: called with a progress line (systemd's STATUS=) at most every
                PROGRESS_INTERVAL_S.

        Returns:
            Counts: "candidates" (chunks not on disk at the start), "written",
            "written_bytes", "unwritten" (the budget ran out, the disk was full of hotter
            chunks, or a write failed), "failed", "elapsed_ms".
        """
        result = dict.fromkeys(("candidates", "written", "written_bytes", "unwritten",
                                "failed", "elapsed_ms"), 0)
        try:
            self._save(budget_s, status, result)
        except Exception:  # noqa: BLE001 - the stop goes on: the arena must be unlinked
            logger.exception("stopping: the save of the arena to the disk tier failed")
        return result

    def _save(self, budget_s: float, status: Callable[[str], None],
              result: dict[str, int]) -> None:
        index, pool = self.index, self.pool
        if budget_s <= 0 or index is None or pool is None or self.slots is None:
            return
        started = time.monotonic()
        deadline = started + budget_s
        slow_s = float(os.environ.get(SLOW_WRITE_ENV, "0") or 0)
        order = self._arena_order()  # least recently used first
        arena_keys = {key for key, _, _ in order}
        todo = [(key, pool_key, blocks) for key, pool_key, blocks in reversed(order)
                if key not in index.entries and key not in self._writing
                and self._fits(blocks)]
        result["candidates"] = len(todo)
        if not todo:
            self._keep_arena_order(order)
            return
        logger.info("stopping: saving %d chunks of the arena to the disk tier %s, most "
                    "recently used first, for at most %g s (--disk-save-on-stop)",
                    len(todo), self.directory, budget_s)
        status(f"STATUS=saving {len(todo)} chunks to disk")
        next_report = started + PROGRESS_INTERVAL_S
        page = self._thread_page()
        why = ""
        for n, (key, pool_key, blocks) in enumerate(todo):
            now = time.monotonic()
            if now >= deadline:
                why = f"the {budget_s:g} s budget ran out"
                break
            if now >= next_report:
                next_report = now + PROGRESS_INTERVAL_S
                text = (f"saving to disk: {n} of {len(todo)} chunks, "
                        f"{deadline - now:.1f} s left")
                logger.info("stopping: %s", text)
                status(f"STATUS={text}")
            if not index.free_slots and index.entries and \
                    next(iter(index.entries)) in arena_keys:
                why = "the disk tier is full of chunks hotter than the rest"
                break
            slot = index.reserve()
            if slot is None:
                why = "every slot the index could evict is being read"
                break
            job = WriteJob(key, pool_key, slot, "save", sum(b.num_bytes for b in blocks),
                           blocks, pool.ledger.parents.get(pool_key, b""))
            try:
                self._write_value(job, page)
                if slow_s:
                    time.sleep(slow_s)
            except Exception as exc:  # noqa: BLE001 - counted; the next chunk may fit
                result["failed"] += 1
                self.counts.write_failures += 1
                self._count_error("write", exc)
                self._erase([DiskEntry(slot, job.record_bytes)])
                continue
            if not index.insert(key, slot, job.record_bytes, job.parent):
                self._erase([DiskEntry(slot, job.record_bytes)])
                continue
            result["written"] += 1
            result["written_bytes"] += job.record_bytes
            self.counts.writes += 1
            self.counts.write_bytes += job.record_bytes
        result["unwritten"] = len(todo) - result["written"]
        self._keep_arena_order(order)
        elapsed = time.monotonic() - started
        result["elapsed_ms"] = int(elapsed * 1000)
        if result["unwritten"]:
            logger.warning("stopping: saved %d of %d chunks of the arena (%d bytes) to the "
                           "disk tier in %.2f s; %d not written (%s%s): they are lost at "
                           "this stop", result["written"], len(todo),
                           result["written_bytes"], elapsed, result["unwritten"],
                           why or "writes failed",
                           "; raise --disk-save-on-stop and the unit's TimeoutStopSec"
                           if "budget" in why else "")
        else:
            logger.info("stopping: saved %d chunks of the arena (%d bytes) to the disk tier "
                        "in %.2f s", result["written"], result["written_bytes"], elapsed)
        status(f"STATUS=saved {result['written']} of {len(todo)} chunks to disk")

    def _arena_order(self) -> list[tuple]:
        """The arena's chunks that may go to disk, least recently used first, as
        (disk key, pool key, blocks): the free queue's order, then the pinned values
        (in use until the stop: the most recent)."""
        pool = self.pool
        unpinned = pool.lru_values(len(pool.cached))
        seen = {pool_key for pool_key, _ in unpinned}
        pinned = [(pool_key, blocks) for pool_key, blocks in pool.cached.items()
                  if pool_key not in seen]
        order = []
        for pool_key, blocks in unpinned + pinned:
            key = self._disk_key(pool_key)
            if key is not None:
                order.append((key, pool_key, blocks))
        return order

    def _keep_arena_order(self, order: list[tuple]) -> None:
        """Move the arena's chunks that are on disk to the back of the disk LRU, in the
        arena's order (`order`, least recently used first)."""
        index = self.index
        for key, _, _ in order:
            if key in index.entries:
                index.touch(key)
