"""Demotion: least recently used chunks of a device tier move to the host arena in the
background, so that the device tier always has empty blocks for new chunks.

Why this file exists: a device tier (GPU memory) is small and fast; a chunk stored
there that is not read again should leave room for the next one without being lost.
Placement never evicts on a device synchronously (`TierSet`); instead this planner,
run on the daemon's loop thread, keeps a reserve of empty device blocks by copying the
LRU values to the host arena, where they stay readable, and then freeing them on the
device. This is the device-to-host spill of vLLM's CPU offloading and of LMCache's
tiered storage (GPU hot tier, CPU below), done by the daemon that owns both tiers.

Rules (each one has a test, tests/daemon/test_demotion_model.py and tests/daemon/test_tiers.py):
- Only the loop thread changes block metadata. The copy runs on a worker thread, never
  in the loop (a copy of a 2 GiB tier takes tens of milliseconds even at PCIe speed).
- A value is chosen only while nobody pins it (`BlockPool.lru_values`), and the planner
  pins it for the copy: readers may still pin and read it, nobody can reuse its blocks.
- A value evicted or cleared while its copy runs is not committed on the host (an EVICT
  is never undone by a demotion); a key that is already READY on the host is freed on
  the device without a copy.
- The host blocks are allocated WRITING (invisible to readers) and committed only after
  the copy completed, so a reader never sees a half-copied value.
- A copy error aborts the host blocks, marks the device tier failed (no new placements)
  and leaves its values readable where they are.
- The host arena's blocks are page-locked for the driver (`register_host`, CUDA tiers)
  while the demoter lives, so copies are DMA at pinned speed; where that fails (the
  daemon's RLIMIT_MEMLOCK), copies are staged through pageable memory, several times
  slower, and fewer bytes are kept in flight (one warning).
"""

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from lmcached.shm.arena import HEADER_BYTES
from lmcached.wire.logger import init_logger
from lmcached.daemon.free_queue import BlockHash, KVCacheBlock
from lmcached.daemon.jobs import JobRunner
from lmcached.daemon.memory_tiers import Tier, TierSet
from lmcached.daemon.spill.counters import LabelledFamily, counter

logger = init_logger(__name__)

MAX_VALUES_PER_PASS = 64  # values one planning pass may start (bounded loop work)
MAX_INFLIGHT_DEMOTION_BYTES = 256 << 20  # ~5 ms of device-to-host copy at 50 GB/s (pinned)
# Copies into pageable memory are staged through the driver's own pinned buffer and run
# at a fraction of pinned speed: a quarter is assumed (not measured: no GPU here yet).
MAX_INFLIGHT_PAGEABLE_DEMOTION_BYTES = MAX_INFLIGHT_DEMOTION_BYTES // 4
SKIPS = LabelledFamily("lmcached_demotion_skips", "LRU device chunks freed without a "
                       "demotion, by reason.", "reason")


@dataclasses.dataclass(slots=True)
class DemotionStats:
    """The demotion counters, INFO `stats` fields of the same names (loop thread only);
    a field with a metric is also that Prometheus counter, a field with a family one
    sample of that labelled family (`spill.counters`)."""

    demotions: int = counter("lmcached_demotions", "Chunks moved from a device tier to the "
                             "host arena.")
    demoted_bytes: int = counter("lmcached_demoted_bytes", "Bytes of the chunks demoted.")
    demotion_busy_us: int = counter("lmcached_demotion_busy_seconds", "Time the demotion "
                                    "thread spent copying.", divisor=1e6)
    demotions_deduplicated: int = counter(family=SKIPS, label="deduplicated")
    demotions_dropped: int = counter(family=SKIPS, label="dropped")
    demotions_aborted: int = counter(family=SKIPS, label="aborted")
    errors_demotion: int = counter("lmcached_demotion_errors", "Demotion copies that failed "
                                   "(the tier is then marked failed).")


DEMOTION_STATS = tuple(field.name for field in dataclasses.fields(DemotionStats))


def reserve_blocks(num_blocks: int) -> int:
    """Empty blocks the planner keeps in a device tier of `num_blocks` blocks: an
    eighth of it, at least 1 (and never the whole tier)."""
    return max(1, min(num_blocks - 1, num_blocks // 8)) if num_blocks > 1 else 0


class DemotionJob:
    """One value being copied from a device tier to the host arena.

    Attributes:
        tier: the device tier it leaves.
        key: the value's key.
        device_blocks: its blocks in the device tier (pinned by the planner).
        host_blocks: WRITING blocks of the host arena, one per device block.
        error: the copy's exception, or None.
        busy_us: how long the worker copied, in microseconds.
    """

    __slots__ = ("tier", "key", "device_blocks", "host_blocks", "num_bytes", "error", "busy_us")

    def __init__(self, tier: Tier, key: BlockHash, device_blocks: list[KVCacheBlock],
                 host_blocks: list[KVCacheBlock]) -> None:
        self.tier = tier
        self.key = key
        self.device_blocks = device_blocks
        self.host_blocks = host_blocks
        self.num_bytes = sum(b.num_bytes for b in device_blocks)
        self.error: BaseException | None = None
        self.busy_us = 0


class Demoter:
    """Plans demotions on the loop thread and copies on one worker thread (a job queue
    of the daemon's `JobRunner`, named "demotion").

    Args:
        tiers: the daemon's tiers (pools made).
        jobs: the daemon's background job runner; the loop finishes the copies through
            `JobRunner.process_completions`.
        on_host_commit: called on the loop thread as `on_host_commit([(key, blocks)])`
            for values committed on the host (the L2 tier's write-through), or None.

    Attributes:
        stats: the demotion counters (`DemotionStats`; `demotion_busy_us`: the worker's
            copy time).
        demoting_blocks: device blocks being copied, per tier id.
        max_inflight_bytes: bytes of copies queued or running at most:
            MAX_INFLIGHT_DEMOTION_BYTES, or MAX_INFLIGHT_PAGEABLE_DEMOTION_BYTES while the
            host arena is not page-locked for a tier whose memory offers it (before the
            worker's first copy, or after the registration failed). Set once by the
            worker; read by the loop.
    """

    def __init__(self, tiers: TierSet, jobs: JobRunner,
                 on_host_commit: Callable | None = None) -> None:
        self.tiers = tiers
        self.on_host_commit = on_host_commit
        self.stats = DemotionStats()
        self.demoting_blocks = [0] * len(tiers.tiers)
        self._inflight_bytes = 0
        self._to_register = self._host_registration()
        # Pageable until the worker has page-locked the host arena (`_register_host`).
        self.max_inflight_bytes = (MAX_INFLIGHT_DEMOTION_BYTES if self._to_register is None
                                   else MAX_INFLIGHT_PAGEABLE_DEMOTION_BYTES)
        self._registered: tuple | None = None  # (memory, host blocks) once page-locked
        self._jobs = jobs
        self._queue = jobs.add_queue("demotion", self._copy, self._finish)

    def _host_registration(self) -> tuple | None:
        """(memory, host blocks) when the host arena's blocks are to be page-locked: by
        the first device tier whose memory offers `register_host` (CUDA: one
        registration serves every device). None without one: the fake tier's memory is
        host memory, copied at memory speed anyway."""
        memory = next((tier.memory for tier in self.tiers.device_tiers
                       if hasattr(tier.memory, "register_host")), None)
        if memory is None:
            return None
        arena = self.tiers.host.memory
        return memory, arena.numpy_view(HEADER_BYTES, arena.capacity_bytes - HEADER_BYTES)

    # ------------------------------------------------------------ loop thread
    def plan(self, overflow: dict[int, int] | None = None) -> int:
        """Start demotions until every device tier has its reserve of empty blocks
        (counting those being emptied), within MAX_VALUES_PER_PASS values and
        `max_inflight_bytes`. Loop thread only.

        Args:
            overflow: per tier id, the size in chunks of an ALLOC that found the tier
                full (some of its chunks went to the host arena): that many blocks (at
                most half the tier) are emptied for the next store of that size, so
                that the tier keeps the newest chunks rather than the oldest.

        Returns:
            How many values were started, freed or dropped.
        """
        host = self.tiers.host.pool
        started = 0
        for tier in self.tiers.device_tiers:
            pool = tier.pool
            if pool is None or tier.failed:
                continue
            wanted = reserve_blocks(pool.num_blocks)
            if overflow:
                wanted = max(wanted, min(overflow.get(tier.tier_id, 0), pool.num_blocks // 2))
            missing = wanted - pool.num_empty_blocks - self.demoting_blocks[tier.tier_id]
            if missing <= 0:
                continue
            for key, span in pool.lru_values(min(missing, MAX_VALUES_PER_PASS - started)):
                if self._inflight_bytes >= self.max_inflight_bytes:
                    return started
                started += 1
                if key in host.cached:  # a host copy exists: free the device copy
                    pool.evict(key)
                    self.stats.demotions_deduplicated += 1
                    continue
                host_blocks = host.allocate(len(span))
                if host_blocks is None:  # the host arena is pinned full: drop the value
                    pool.evict(key)
                    self.stats.demotions_dropped += 1
                    continue
                for host_block, device_block in zip(host_blocks, span):
                    host_block.num_bytes = device_block.num_bytes
                pool.touch(span)
                job = DemotionJob(tier, key, span, host_blocks)
                self.demoting_blocks[tier.tier_id] += len(span)
                self._inflight_bytes += job.num_bytes
                self._queue.submit(job)
        return started

    def _finish(self, jobs: list[DemotionJob]) -> None:
        """Commit the copies the worker completed, free their device blocks, and plan
        again. Loop thread (`JobRunner.process_completions`)."""
        host = self.tiers.host.pool
        committed = []
        for job in jobs:
            self.stats.demotion_busy_us += job.busy_us
            pool = job.tier.pool
            pool.free(job.device_blocks)
            self.demoting_blocks[job.tier.tier_id] -= len(job.device_blocks)
            self._inflight_bytes -= job.num_bytes
            if job.error is not None:
                host.abort(job.host_blocks)
                self.stats.errors_demotion += 1
                if not job.tier.failed:
                    job.tier.failed = True
                    logger.error("device tier %d (%s) failed a demotion copy (%s): no new "
                                 "chunks go there; its chunks stay readable",
                                 job.tier.tier_id, job.tier.device, job.error)
                continue
            if pool.cached.get(job.key) is not job.device_blocks:
                host.abort(job.host_blocks)  # evicted or cleared meanwhile: stay gone
                self.stats.demotions_aborted += 1
                continue
            parent = pool.ledger.parents.get(job.key, b"")
            if not host.commit(job.host_blocks, job.key, parent=parent):
                host.abort(job.host_blocks)  # a host copy was committed meanwhile
                self.stats.demotions_deduplicated += 1
            else:
                committed.append((job.key, job.host_blocks))
                self.stats.demotions += 1
                self.stats.demoted_bytes += job.num_bytes
            pool.evict(job.key)
        if committed:
            if self.on_host_commit is not None:
                self.on_host_commit(committed)
            host.free([b for _, blocks in committed for b in blocks])
        if jobs and not self._queue.stopping:
            self.plan()

    def close(self) -> None:
        """Stop the worker (after its current copy), finish what it completed and undo
        the jobs not started: host blocks aborted, device pins dropped; then unregister
        the host arena (before the server closes the tiers' memory and the arena). Loop
        thread, at shutdown."""
        self._queue.stop()
        left = self._queue.join()
        self._queue.finish_done()
        self._jobs.remove_queue(self._queue)
        for job in left:
            self.tiers.host.pool.abort(job.host_blocks)
            job.tier.pool.free(job.device_blocks)
            self.demoting_blocks[job.tier.tier_id] -= len(job.device_blocks)
            self._inflight_bytes -= job.num_bytes
        if self._registered is not None:
            memory, blocks = self._registered
            self._registered = None
            try:
                memory.unregister_host(blocks)
            except Exception as exc:  # best effort at shutdown: the process unmaps it next
                logger.warning("unregistering the host arena from the device failed: %s", exc)

    # ---------------------------------------------------------- worker thread
    def _register_host(self, memory, blocks: np.ndarray) -> None:
        """Page-lock the host arena's blocks (`memory.register_host`), before the first
        copy: seconds for a large arena, so on the worker, never in the loop. On
        failure: one warning, and the pageable in-flight budget stays."""
        try:
            memory.register_host(blocks)
        except Exception as exc:  # a driver error (shm/cuda_driver.py's CudaError)
            logger.warning(
                "the host arena (%d bytes) could not be page-locked for demotion copies "
                "(%s): they are staged through pageable memory, several times slower, with "
                "at most %d bytes in flight; raise the daemon's RLIMIT_MEMLOCK "
                "(LimitMEMLOCK=infinity in its systemd unit, or ulimit -l unlimited)",
                blocks.nbytes, exc, self.max_inflight_bytes)
            return
        self._registered = (memory, blocks)
        self.max_inflight_bytes = MAX_INFLIGHT_DEMOTION_BYTES

    def _copy(self, jobs: list[DemotionJob]) -> None:
        """Copy each job's device blocks into its host blocks; errors are the loop's
        to report (`_finish`). The first call page-locks the host arena first."""
        if self._to_register is not None:
            to_register, self._to_register = self._to_register, None
            self._register_host(*to_register)
        arena = self.tiers.host.memory
        for job in jobs:
            started = time.perf_counter()
            try:
                memory = job.tier.memory
                for device_block, host_block in zip(job.device_blocks, job.host_blocks):
                    dst = arena.numpy_view(arena.block_offset(host_block.block_id),
                                           device_block.num_bytes)
                    memory.copy_to_host(device_block.block_id, device_block.num_bytes, dst)
            except Exception as exc:  # a device error: reported by `_finish`
                job.error = exc
            job.busy_us = int((time.perf_counter() - started) * 1e6)
            self._queue.post(job)
