"""An L2 fetch: finding, reading and verifying the rest of a chain in Redis (fetch
threads), and installing it into the arena (the loop).

Why this file exists: it is the read half of the L2 tier (`tier.py` owns the threads,
the queues and the completions). `fetch_chain` runs on a fetch thread and touches no
block metadata; `install` runs on the loop thread and is the only code that puts bytes
from L2 into arena blocks. docs/l2.md, "How a fetch looks to a client".
"""

import threading
import time
from collections.abc import Callable

import numpy as np

from lmcached.daemon.l2.counters import L2Stats
from lmcached.daemon.l2.redis_store import RedisL2
from lmcached.daemon.l2.values import l2_key
from lmcached.daemon.spill.envelope import ENVELOPE_BYTES, VerifyError, verify_value
from lmcached.shm.arena import Arena
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import KVCacheBlock

# A fetch GETs its first batch small, so that a lookup's bounded wait already sees the
# start of the chain, then doubles each batch up to the largest.
FIRST_FETCH_BATCH_BYTES = 4 << 20
FETCH_BATCH_BYTES = 64 << 20  # values fetched before the loop installs them, at most
FETCH_BATCHES_AHEAD = 2  # batches a fetch thread may hold that the loop has not installed
LENGTHS_WINDOW = 256  # keys per STRLEN pipeline while finding the run L2 holds


class FetchJob:
    """A fetch of the rest of one chain from L2, in chain order.

    Attributes:
        namespaces: the namespace ids of the request (one per TP rank listed).
        fps: their namespace fingerprints.
        prefixes: their block-pool key prefixes.
        hashes: the chunk hashes from the first chunk missing in the arena, `[n]` x 16 B.
        parent: the hash of the chunk before `hashes[0]` (ROOT_HASH at the start).
        record_bytes: the largest record of its namespaces; a value longer than it plus
            the envelope is never fetched (a hostile or foreign value).
        done: set by the loop once every batch is installed (or the fetch failed).
        stop: set by the loop when the arena has no room: the fetch thread GETs no more.
        num_installed: chunks (per namespace) installed so far.
        held: the blocks of the chain's arena part and of the chunks installed so far,
            pinned until the job ends (its installs never evict its own chain).
        clear_generation: the pool's `clear_generation` when the job started: once a
            CLEAR changed it, the job installs nothing (`L2Tier._apply`).
        generation: the L2's clear generation as the daemon knew it at the start; the
            fetch reads keys under this or the newer one it reads from L2.
    """

    __slots__ = ("key", "namespaces", "fps", "prefixes", "hashes", "parent", "record_bytes",
                 "done", "stop", "num_installed", "credits", "started_at", "held",
                 "clear_generation", "generation", "chained")

    def __init__(self, key, namespaces, fps, prefixes, hashes, parent, record_bytes) -> None:
        self.key = key
        self.namespaces = namespaces
        self.fps = fps
        self.prefixes = prefixes
        self.hashes = hashes
        self.parent = parent
        self.record_bytes = record_bytes
        self.done = False
        self.stop = False
        self.num_installed = 0
        self.credits = threading.Semaphore(FETCH_BATCHES_AHEAD)
        self.started_at = time.monotonic()
        self.held: list[KVCacheBlock] = []  # the arena's part of the chain, pinned
        self.clear_generation = 0
        self.generation = 0
        self.chained = True  # False: each chunk is verified from `parent` (UNCHAINED_FORMATS)


def fetch_chain(store: RedisL2, job: FetchJob, post: Callable[[tuple], None],
                stopping: Callable[[], bool]) -> None:
    """A fetch thread's work for one job: the L2's clear generation (GET; keys of an
    older one are never read, and a newer one is posted to the loop), the run of the
    chain that L2 holds in every
    namespace (STRLEN in windows, to the first gap or oversized value), GET in batches
    (from FIRST_FETCH_BATCH_BYTES, doubling up to FETCH_BATCH_BYTES), each value verified
    (`values.verify_value`); each batch is posted to the loop, at most
    FETCH_BATCHES_AHEAD ahead of its installs.

    Args:
        store: the L2 store.
        job: the fetch.
        post: hands a completion to the loop (thread-safe).
        stopping: True once the tier is closing.

    Raises:
        L2Unavailable: L2 is down, slow or backing off (the caller posts it).
    """
    fps, hashes = job.fps, job.hashes
    max_value = job.record_bytes + ENVELOPE_BYTES
    generation = store.generation()
    if generation > job.generation:
        post(("generation", generation))
    generation = max(generation, job.generation)  # an evicted generation key reads as 0
    sizes = []  # bytes of each chunk of the run, over its namespaces
    gap = False
    while not gap and len(sizes) < len(hashes):  # STRLEN in windows, to the first gap
        window = hashes[len(sizes) : len(sizes) + LENGTHS_WINDOW]
        lengths = store.value_lengths([l2_key(fp, h, generation=generation)
                                       for h in window for fp in fps])
        for i in range(len(window)):
            per_ns = lengths[i * len(fps) : (i + 1) * len(fps)]
            if not all(0 < n <= max_value for n in per_ns):
                if any(n > max_value for n in per_ns):
                    post(("oversize",))
                gap = True
                break
            sizes.append(sum(per_ns))
    num_chunks = len(sizes)
    post(("misses", len(hashes) - num_chunks))
    budget = FIRST_FETCH_BATCH_BYTES
    start = 0
    while start < num_chunks and not job.stop:
        stop, batch_bytes = start + 1, sizes[start]
        while stop < num_chunks and batch_bytes + sizes[stop] <= budget:
            batch_bytes += sizes[stop]
            stop += 1
        keys = [l2_key(fp, hashes[i], generation=generation)
                for i in range(start, stop) for fp in fps]
        values = store.get_many(keys)
        batch, failure = [], None
        for offset, i in enumerate(range(start, stop)):
            parent = hashes[i - 1] if i and job.chained else job.parent
            records = []
            for j, fp in enumerate(fps):
                value = values[offset * len(fps) + j]
                if value is None:  # expired or evicted between STRLEN and GET
                    failure = "gone"
                    break
                if len(value) > max_value:  # replaced meanwhile by a larger value
                    failure = "verify_envelope"
                    break
                try:
                    records.append(verify_value(value, fp, hashes[i], parent))
                except VerifyError as exc:
                    failure = f"verify_{exc.reason}"
                    break
            if failure:
                break
            batch.append(records)
        while not job.credits.acquire(timeout=0.5):
            if stopping():
                return
        post(("batch", job, start, batch, failure))
        if failure:
            return
        start, budget = stop, min(2 * budget, FETCH_BATCH_BYTES)


def install(pool: BlockPool, arena: Arena, job: FetchJob, start: int,
             records: list[list[memoryview]], stats: L2Stats) -> None:
    """Copy verified records into newly allocated blocks and index them (READY, most
    recently used); each chunk's blocks join `job.held` (pinned until the job ends). On
    the loop thread. When the arena has no evictable room it counts `fetch_nospace`,
    sets `job.stop` and installs nothing more.

    Args:
        pool: the block pool.
        arena: the arena the blocks are in.
        job: the fetch the records belong to.
        start: index in `job.hashes` of the first record's chunk.
        records: per chunk, its verified record in each of `job.namespaces`.
        stats: the tier's counters.
    """
    block_bytes = arena.block_bytes
    for offset, per_ns in enumerate(records):
        chunk_hash = job.hashes[start + offset]
        for prefix, record in zip(job.prefixes, per_ns):
            pool_key = prefix + chunk_hash
            if pool_key in pool.cached:
                continue  # stored meanwhile by a client
            num_bytes = len(record)
            blocks = pool.allocate(-(-num_bytes // block_bytes))
            if blocks is None:
                stats.fetch_nospace += 1
                job.stop = True  # the fetch thread GETs no more for this job
                return
            src = np.frombuffer(record, dtype=np.uint8)
            for i, block in enumerate(blocks):
                block.num_bytes = min(block_bytes, num_bytes - i * block_bytes)
                dst = arena.numpy_view(arena.block_offset(block.block_id), block.num_bytes)
                np.copyto(dst, src[i * block_bytes : i * block_bytes + block.num_bytes])
            pool.commit(blocks, pool_key, parent=job.hashes[start + offset - 1]
                        if start + offset and job.chained else job.parent)
            job.held.extend(blocks)  # the writer's reference, kept until the job ends
            stats.fetch_hit_chunks += 1
            stats.fetch_bytes += num_bytes
        job.num_installed = start + offset + 1
