"""The daemon's L2 tier: chunks written to Redis by worker threads, misses fetched back.

Why this file exists: the daemon's loop is one thread (`server.py`) and must never wait
for the network, yet chunks have to reach Redis and come back from it. This module owns
the threads that talk to Redis (`redis_store.RedisL2`), the bounded queue of writes, and
the completions that the threads hand back to the loop. Everything that touches the
block pool or the arena's blocks runs on the loop thread, when the daemon's job runner
(`lmcached/daemon/jobs.py`) hands back what the threads finished (`_apply_all`); the
threads only read bytes the loop pinned for them, and talk to Redis.

Flows (docs/l2.md):

- write-through: a committed chunk is pinned and queued (`write_through`); a writer
  thread reads its bytes in place, SETs them; the loop unpins it (`_apply_all`).
- on-evict: the block pool's `on_evict` hook copies an evicted chunk's bytes into the
  queue (`spill`) before its blocks are handed to the next writer.
- fetch on miss: a LOOKUP / ACQUIRE that misses in the arena starts a `FetchJob`
  (`start_fetch`); a fetch thread finds how much of the rest of the chain L2 holds
  (STRLEN), GETs it in batches, verifies each value (`fetch.fetch_chain`), and the
  loop installs each batch into newly allocated blocks (`fetch.install`). The request waits
  (it is parked by the server) until the job ends or `fetch_wait_s` passes.

The queue is bounded in bytes (`queue_bytes`): a write that does not fit is dropped and
counted, so a slow or dead L2 never slows a store. While the L2 is down, writes are
dropped and fetches answer "miss" at once; `redis_store.RedisL2` backs off and reconnects.

CLEAR (`clear`; docs/l2.md, "CLEAR and the L2"): the L2 is shared by every node, so a
CLEAR cannot delete its chunks one by one (a SCAN of a cluster, racing other nodes'
writes). Chunks are keyed under the L2's clear generation instead (`values.l2_key`,
`values.GENERATION_KEY`), which CLEAR increments: keys of older generations are never
read again by any daemon (each fetch reads the generation first; each write batch learns
it in its pipeline), and their TTL removes them. Until the INCR succeeded, this daemon
fetches nothing from L2; a fetch started before the CLEAR installs nothing after it (the
pool's `clear_generation`), and a write queued before it is keyed under the old one.
"""

import collections
import dataclasses
import time

from lmcached.daemon.l2.counters import L2Stats, error_fields
from lmcached.daemon.l2.fetch import FetchJob, fetch_chain, install
from lmcached.daemon.l2.redis_store import L2Unavailable, RedisL2
from lmcached.daemon.l2.values import l2_key
from lmcached.daemon.spill.envelope import (ENVELOPE_BYTES, encode_value,
                                            namespace_fingerprint)
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import UNCHAINED_FORMATS, Layout
from lmcached.shm.arena import Arena
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import KVCacheBlock
from lmcached.daemon.jobs import JobRunner
from lmcached.daemon.spill.counters import info_fields
from lmcached.daemon.spill.tier import FetchJobs, FetchRequest, SpillTier

logger = init_logger(__name__)

POLICIES = ("write-through", "on-evict")
WRITE_BATCH_VALUES = 32  # SETs pipelined in one round trip at most
WRITE_BATCH_BYTES = 64 << 20
FETCH_JOBS_PER_THREAD = 4  # fetches queued or running per fetch thread; beyond, a miss is
# answered at once (each holds its chain's arena prefix pinned)
PINNED_SHARE = 4  # write-through pins at most 1/PINNED_SHARE of the arena
DOWN_HOLD_S = 0.1  # after an outage, fetches answer "miss" at once for this long at least
CLOSE_DRAIN_S = 5.0  # graceful stop: writes still queued get this long to reach L2
MAX_VALUE_BYTES = 512 << 20  # Redis' proto-max-bulk-len default ("512mb": MiB)
_CHUNK_KEY = b"c"[0]
_BUMP = "bump"  # a fetch queue job: the INCR of a CLEAR (`L2Tier.clear`)


@dataclasses.dataclass(slots=True)
class WriteJob:
    """One chunk on its way to L2.

    Attributes:
        pool_key: its block-pool key (`keys.chunk_keys`).
        key: its L2 key (`values.l2_key`).
        ns_fp, chunk_hash: what its envelope says (16 bytes each).
        pieces: its record's bytes: views of its pinned arena blocks (write-through), or
            one copy (on-evict).
        num_bytes: record length in bytes.
        blocks: the blocks pinned for it, which the loop frees once written; None for a copy.
    """

    pool_key: bytes
    key: bytes
    ns_fp: bytes
    chunk_hash: bytes
    pieces: list
    num_bytes: int
    blocks: list[KVCacheBlock] | None


def _take_write_batch(writes: collections.deque) -> list[WriteJob]:
    """A writer's next batch: queued writes in order, up to WRITE_BATCH_VALUES values
    and WRITE_BATCH_BYTES (at least one)."""
    batch, num_bytes = [], 0
    while writes and len(batch) < WRITE_BATCH_VALUES and (
            not batch or num_bytes + writes[0].num_bytes <= WRITE_BATCH_BYTES):
        job = writes.popleft()
        batch.append(job)
        num_bytes += job.num_bytes
    return batch


class L2Tier(SpillTier):
    """Writes chunks to an L2 store and fetches misses back (docs/l2.md); a `SpillTier`.

    Args:
        store: the L2 store (`RedisL2`), shared by every thread.
        url: the L2's address as configured (for INFO).
        ttl_s: the values' time to live in L2, in seconds (0 = none); for INFO (the
            store sets it).
        arena: the daemon's arena (chunk bytes are read and written in place).
        policy: "write-through" (every committed chunk) or "on-evict" (chunks evicted by
            pressure).
        queue_bytes: bytes of writes that may wait; a write that does not fit is dropped.
        fetch_wait_s: how long a LOOKUP / ACQUIRE waits for a fetch; 0 = never (the fetch
            still runs and a later lookup sees its chunks).
        num_threads: writer threads, and as many fetch threads.
        jobs: the daemon's background job runner: the tier adds its writer and fetch
            queues ("l2-writer", "l2-fetch", `num_threads` threads each); the loop
            applies their completions through `JobRunner.process_completions`.

    Attributes:
        pool: the host arena's block pool, once the service set it (`set_pool`; the
            completions unpin and install there; before it, they touch no pool).

    Raises:
        ValueError: unknown policy, queue_bytes < 1, num_threads < 1, fetch_wait_s < 0.
    """

    name = "l2"

    def __init__(self, store: RedisL2, arena: Arena, *, url: str, policy: str, ttl_s: float,
                 queue_bytes: int, fetch_wait_s: float, num_threads: int,
                 jobs: JobRunner) -> None:
        if policy not in POLICIES:
            raise ValueError(f"L2 policy {policy!r}: use one of {', '.join(POLICIES)}")
        if queue_bytes < 1 or num_threads < 1 or fetch_wait_s < 0:
            raise ValueError("L2 queue_bytes and num_threads must be >= 1, fetch_wait_s >= 0")
        self.store = store
        self.url = url
        self.ttl_s = ttl_s
        self.arena = arena
        self.policy = policy
        self.queue_bytes = queue_bytes
        # Write-through holds pins, not copies: never more than a share of the arena.
        self.pinned_limit_bytes = min(queue_bytes, arena.capacity_bytes // PINNED_SHARE)
        self.max_fetch_jobs = FETCH_JOBS_PER_THREAD * num_threads
        self.fetch_wait_s = fetch_wait_s
        self._ns: dict[int, tuple[bytes, Layout] | None] = {}  # ns id -> (fp, layout); None: not L2
        self.pool: BlockPool | None = None
        self._down_until = 0.0
        self._config_error_logged = False
        self.queued_bytes = 0  # bytes of writes queued or being written (loop's view)
        self.num_writes_in_flight = 0
        self.counts = L2Stats()
        self._jobs = FetchJobs(self.max_fetch_jobs, self.counts)
        self.generation = 0  # the L2's clear generation as this daemon knows it (never lower)
        self._clear_pending = False  # a CLEAR whose INCR has not succeeded yet
        self._bump_in_flight = False
        self._runner = jobs
        self._writes = jobs.add_queue("l2-writer", self._write, self._apply_all,
                                      num_threads=num_threads, take=_take_write_batch)
        self._fetches = jobs.add_queue("l2-fetch", self._fetch, self._apply_all,
                                       num_threads=num_threads, max_jobs=self.max_fetch_jobs)

    # ------------------------------------------------------------ namespaces
    def register_namespace(self, ns: int, layout: Layout) -> None:
        """Note a namespace: chunk namespaces (fmt other than "kv") go to L2, unless a
        value would exceed Redis' largest bulk string (512 MB, `proto-max-bulk-len`)."""
        if ns in self._ns:
            return
        if layout.fmt == "kv":
            self._ns[ns] = None
        elif layout.record_bytes + ENVELOPE_BYTES > MAX_VALUE_BYTES:
            logger.warning("namespace %d (%s): a chunk record of %d bytes is larger than a "
                           "Redis value may be (512 MB): its chunks stay out of L2; use a "
                           "smaller chunk size", ns, layout.model_name, layout.record_bytes)
            self._ns[ns] = None
        else:
            self._ns[ns] = (namespace_fingerprint(layout), layout)

    def unregister_namespace(self, ns: int) -> None:
        """Forget a namespace the daemon freed (its id may be given to another layout):
        a fetch still in flight for it installs nothing more (`_apply`)."""
        self._ns.pop(ns, None)

    def _fetching_for_current_namespaces(self, job: FetchJob) -> bool:
        """Whether every namespace of `job` still names the layout it was started for
        (none was freed, and its id given to another layout, meanwhile)."""
        for ns, fp in zip(job.namespaces, job.fps):
            entry = self._ns.get(ns)
            if entry is None or entry[0] != fp:
                return False
        return True

    def _chunk_of(self, pool_key: bytes):
        """(fp, chunk hash) of a chunk key in an L2 namespace, else None."""
        if pool_key[0] != _CHUNK_KEY:
            return None
        entry = self._ns.get(int.from_bytes(pool_key[1:5], "little"))
        return None if entry is None else (entry[0], pool_key[5:])

    # ---------------------------------------------------------------- writes
    def _record_pieces(self, blocks: list[KVCacheBlock]) -> list:
        """Views of a value's bytes in its arena blocks, in order."""
        arena = self.arena
        return [memoryview(arena.numpy_view(arena.block_offset(b.block_id), b.num_bytes))
                for b in blocks]

    def _enqueue(self, job: WriteJob) -> bool:
        if self.queued_bytes + job.num_bytes > self.queue_bytes:
            self.counts.write_drops_queue_full += 1
            return False
        if time.monotonic() < self._down_until:
            self.counts.write_drops_down += 1
            return False
        self.queued_bytes += job.num_bytes
        self.num_writes_in_flight += 1
        return self._writes.submit(job)

    def write_through(self, pool: BlockPool, values: list[tuple[bytes, list[KVCacheBlock]]]) -> None:
        """Queue newly committed values (write-through policy; loop thread).

        Each chunk of an L2 namespace is pinned (`BlockPool.touch`) until its writer has
        sent it; a value that does not fit in the queue is dropped and counted.

        Args:
            pool: the block pool the values were just committed in.
            values: (pool key, READY blocks) per committed value.
        """
        if self.policy != "write-through":
            return
        for pool_key, blocks in values:
            job = self._write_job(pool_key, blocks, self.pinned_limit_bytes)
            if job is None:
                continue
            job.pieces, job.blocks = self._record_pieces(blocks), blocks
            if self._enqueue(job):
                pool.touch(blocks)

    def _write_job(self, pool_key: bytes, blocks: list[KVCacheBlock],
                   limit_bytes: int) -> WriteJob | None:
        """A WriteJob without its bytes for a value bound for L2, or None (counted) when
        it is not a chunk of an L2 namespace, is longer than its namespace's record (ALLOC
        does not bound it, and every node would fetch it), or would take the queue over
        `limit_bytes`."""
        chunk = self._chunk_of(pool_key)
        if chunk is None:
            return None
        num_bytes = sum(b.num_bytes for b in blocks)
        layout = self._ns[int.from_bytes(pool_key[1:5], "little")][1]
        if num_bytes > layout.record_bytes:
            self.counts.write_drops_oversize += 1
            return None
        if self.queued_bytes + num_bytes > limit_bytes:
            self.counts.write_drops_queue_full += 1
            return None
        key = l2_key(*chunk, generation=self.generation)
        return WriteJob(pool_key, key, chunk[0], chunk[1], [], num_bytes, None)

    def spill(self, pool_key: bytes, blocks: list[KVCacheBlock]) -> None:
        """`BlockPool.on_evict` hook (on-evict policy; loop thread): copy an evicted
        chunk's bytes into the write queue before its blocks are reused."""
        if self.policy != "on-evict":
            return
        try:
            self._spill(pool_key, blocks)
        except Exception:  # noqa: BLE001 - raised inside BlockPool.allocate: never let it out
            logger.exception("L2 spill of an evicted chunk failed")
            self.counts.write_failures += 1

    def _spill(self, pool_key: bytes, blocks: list[KVCacheBlock]) -> None:
        # Spilled even when it came from L2: Redis may have evicted it since (allkeys-lru),
        # and the write refreshes its place in Redis' LRU.
        job = self._write_job(pool_key, blocks, self.queue_bytes)
        if job is not None:
            job.pieces = [b"".join(self._record_pieces(blocks))]  # a copy: the blocks go now
            self._enqueue(job)

    def _write(self, batch: list[WriteJob]) -> None:
        """Writer thread: pipelines a batch of SETs, then posts them back to the loop."""
        outcome = "written"
        stored = generation = 0
        try:
            items = [(job.key, encode_value(job.ns_fp, job.chunk_hash, job.pieces))
                     for job in batch]
            stored, generation = self.store.set_many_reading_generation(items)
        except L2Unavailable:
            outcome = "down"
        except Exception as exc:  # noqa: BLE001 - a writer never dies: count, log, go on
            self._log_failure("write", exc)
            outcome = "error"
        self._writes.post(("written", batch, outcome, stored, generation))

    def _log_failure(self, what: str, exc: Exception) -> None:
        """Log a failure that is not an outage: a configuration error (ValueError, e.g.
        several addresses of a standalone server) once, anything else with its trace."""
        if isinstance(exc, ValueError):
            if not self._config_error_logged:
                self._config_error_logged = True
                logger.error("L2 %s failed and will fail until the daemon is restarted with "
                             "another --l2: %s", what, exc)
            return
        logger.exception("L2 %s failed", what)

    # --------------------------------------------------------------- fetches
    def start_fetch(self, request: FetchRequest) -> FetchJob | None:
        """Start (or join) a fetch of `request.hashes[first:]` in every listed namespace
        (`SpillTier.start_fetch`).

        Loop thread. Returns None, and starts nothing, when a namespace is not an L2
        one, a write or fetch failed on an outage within the last DOWN_HOLD_S, or
        `max_fetch_jobs` are in flight. (While the store backs off longer, a job starts
        and ends at once: the store refuses without touching the network.)
        """
        entries = [self._ns.get(ns) for ns in request.namespaces]
        if any(entry is None for entry in entries):
            return None
        if self._clear_pending:  # the L2 still serves what CLEAR removed: not from here
            self._bump()
            self.counts.fetches_skipped += 1
            return None
        key = request.job_key()
        job, may_start = self._jobs.join(key, busy=time.monotonic() < self._down_until)
        if not may_start:
            return job
        pool = request.pool
        chained = not any(e[1].fmt in UNCHAINED_FORMATS for e in entries)
        parent = request.parent_of(request.first) if request.first and chained else request.root
        job = FetchJob(key, list(request.namespaces), [e[0] for e in entries],
                       request.prefixes, request.chunk_hashes(), parent,
                       max(e[1].record_bytes for e in entries))
        job.clear_generation, job.generation = pool.clear_generation, self.generation
        job.chained = chained
        job.held = request.prefix_blocks()
        pool.touch(job.held)
        self._jobs.add(key, job)
        self._fetches.submit(job)  # never full: at most max_fetch_jobs are in flight
        return job

    def clear(self) -> int:
        """An admin's CLEAR (loop thread): advance the L2's clear generation in the
        background (`_bump`; no fetch from L2 until it succeeded), stop the fetches in
        flight and unpin their chains now, so that the pool's clear (which the caller
        runs next) finds them unpinned; they install nothing after it (the pool's
        `clear_generation`, `_apply`).

        Returns:
            0: L2's chunks are not counted (INFO l2_generation, l2_clear_pending).
        """
        self._clear_pending = True
        self.counts.clears += 1
        for job in self._jobs:
            job.stop = True
            if job.held and self.pool is not None:
                self.pool.free(job.held)
            job.held = []
        self._bump()
        return 0

    def _bump(self) -> None:
        """Queue the INCR of the L2's clear generation for a fetch thread, unless one is
        in flight or the L2 failed within DOWN_HOLD_S (then a later fetch or write
        completion tries again)."""
        if (not self._clear_pending or self._bump_in_flight
                or time.monotonic() < self._down_until):
            return
        self._bump_in_flight = self._fetches.submit(_BUMP)

    def _learn_generation(self, generation: int) -> None:
        """A generation read from L2: from now on keys are written under it (a CLEAR
        on another node made older keys unreachable)."""
        if generation > self.generation:
            self.generation = generation

    def _fetch(self, jobs: list) -> None:
        """Fetch thread: runs a queued FetchJob, or the INCR of a CLEAR (`_BUMP`)."""
        post = self._fetches.post
        for job in jobs:
            if job is _BUMP:
                try:
                    post(("bumped", self.store.bump_generation()))
                except L2Unavailable:
                    post(("bump_failed", "down"))
                except Exception as exc:  # noqa: BLE001 - a fetch thread never dies
                    logger.error("L2 CLEAR could not advance the L2's clear generation: %s; "
                                 "this daemon fetches nothing from L2 until it can", exc)
                    post(("bump_failed", "error"))
                continue
            try:
                fetch_chain(self.store, job, post, lambda: self._fetches.stopping)
            except L2Unavailable:
                post(("down", job))
            except Exception as exc:  # noqa: BLE001 - a fetch thread never dies
                self._log_failure("fetch", exc)
                post(("fetch_error", job))
            post(("fetched", job))

    # ------------------------------------------------------------ loop side
    def _apply_all(self, messages: list[tuple]) -> None:
        """Apply what the threads finished (loop thread, the job queues' `finish`):
        unpin written chunks, install fetched ones, count."""
        pool = self.pool
        for message in messages:
            try:
                self._apply(pool, message)
            except Exception:  # noqa: BLE001 - a bug here must not stop the loop
                logger.exception("applying an L2 completion %s failed", message[0])
            finally:
                if message[0] == "batch":
                    message[1].credits.release()

    def _apply(self, pool: BlockPool | None, message: tuple) -> None:
        """Apply one completion."""
        stats = self.counts
        kind = message[0]
        if kind == "written":
            _, batch, outcome, stored, generation = message
            self._learn_generation(generation)
            for job in batch:
                self.queued_bytes -= job.num_bytes
            self.num_writes_in_flight -= len(batch)
            if outcome == "written":
                stats.writes += stored
                stats.write_bytes += sum(j.num_bytes for j in batch) if stored == len(batch) else 0
                stats.write_failures += len(batch) - stored
            elif outcome == "down":
                stats.write_drops_down += len(batch)
                self._down_until = time.monotonic() + DOWN_HOLD_S
            else:
                stats.write_failures += len(batch)
            pinned = [b for job in batch if job.blocks for b in job.blocks]
            if pinned and pool is not None:
                pool.free(pinned)
            self._bump()  # a CLEAR whose INCR failed tries again
        elif kind == "batch":
            _, job, start, records, failure = message
            if failure:
                stats.count_rejected(failure)
            if pool is not None and not job.done and not job.stop:
                if job.clear_generation != pool.clear_generation:
                    job.stop = True  # started before a CLEAR: installs nothing after it
                elif self._fetching_for_current_namespaces(job):
                    install(pool, self.arena, job, start, records, stats)
                else:  # a namespace was freed meanwhile: its id may name another layout
                    job.stop = True
        elif kind == "oversize":
            stats.fetch_oversize += 1
        elif kind == "misses":
            stats.fetch_miss_chunks += message[1]
        elif kind == "generation":
            self._learn_generation(message[1])
        elif kind == "bumped":
            self._learn_generation(message[1])
            self._bump_in_flight = self._clear_pending = False
            logger.info("L2 %s: CLEAR advanced its clear generation to %d: chunks written "
                        "before are unreachable for every daemon on it", self.url,
                        message[1])
        elif kind == "bump_failed":
            self._bump_in_flight = False
            stats.clear_failures += 1
            if message[1] == "down":
                self._down_until = time.monotonic() + DOWN_HOLD_S
        elif kind == "down":
            self._down_until = time.monotonic() + DOWN_HOLD_S
            stats.fetch_down += 1
        elif kind == "fetch_error":
            stats.fetch_errors += 1
        elif kind == "fetched":
            job = message[1]
            job.done = True
            self._jobs.finish(job.key)
            if job.held and pool is not None:
                pool.free(job.held)  # tail first: the chain's end is evicted first
            job.held = []

    # ------------------------------------------------------------------ info
    def stats(self) -> L2Stats:
        """The tier's counters."""
        return self.counts

    def info(self) -> dict[str, int | float | str]:
        """INFO section `l2` (docs/l2.md, "Counters")."""
        out = {
            "l2_enabled": 1,
            "l2_url": self.url,
            "l2_ttl_s": self.ttl_s,
            "l2_mode": self.store.mode,
            "l2_state": self.store.state,
            "l2_policy": self.policy,
            "l2_queue_values": self.num_writes_in_flight,
            "l2_queue_bytes": self.queued_bytes,
            "l2_queue_limit_bytes": self.queue_bytes,
            "l2_fetches_in_flight": len(self._jobs),
            "l2_reconnects": self.store.num_reconnects,
            "l2_generation": self.generation,
            "l2_clear_pending": int(self._clear_pending),
            **info_fields(self.counts, "l2_"),  # every counter, 0 until it happens
        }
        out.update(error_fields(self.store.errors))
        return out

    # --------------------------------------------------------------- teardown
    def close(self) -> None:
        """Stop the threads: queued writes get CLOSE_DRAIN_S to reach L2 (then are
        dropped); fetches stop. Loop thread, before the arena is unmapped."""
        deadline = time.monotonic() + CLOSE_DRAIN_S
        self._writes.stop(drain=True)
        self._fetches.stop()
        dropped = len(self._writes.join(deadline))
        self._fetches.join(deadline)
        if dropped:
            logger.warning("stopping: %d chunk writes to L2 were still queued: dropped", dropped)
        alive = []
        for queue in (self._writes, self._fetches):
            queue.finish_done()
            self._runner.remove_queue(queue)
            alive += queue.busy_threads()
        if alive:
            logger.warning("L2 threads still busy at stop: %s", ", ".join(alive))
        self.store.close()
