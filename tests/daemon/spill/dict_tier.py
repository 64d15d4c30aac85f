"""A spill tier kept in a Python dict: the test-only tier that shows what a new tier takes.

This folder and the line that attaches it (`CacheService.attach_tier`, the spill tier
list) are all it needs: it implements `lmcached.daemon.spill.tier.SpillTier` and passes
the same contract tests as the disk tier and L2 (tests/daemon/test_spill_contract.py).
Chunks are copied into the dict when the arena evicts them (`spill`) or commits them
(`write_through`); a fetch is queued by `start_fetch` and installed by the next
`housekeeping` (the loop's periodic pass), so that a second lookup meanwhile joins it.
It trusts its own memory: it verifies nothing (a real tier checks the envelope,
lmcached/daemon/spill/envelope.py).
"""

import dataclasses

from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import KVCacheBlock
from lmcached.daemon.keys import CHUNK_TAG
from lmcached.daemon.spill.counters import counter, info_fields
from lmcached.daemon.spill.envelope import namespace_fingerprint
from lmcached.daemon.spill.tier import FetchJobs, FetchRequest, SpillKey, SpillTier
from lmcached.shm.arena import Arena
from lmcached.wire.protocol import Layout
from lmcached.wire.record_format import RECORD_HEADER_BYTES, read_header

MAX_FETCH_JOBS = 4


@dataclasses.dataclass(slots=True)
class DictStats:
    """The dict tier's counters (INFO-style fields `dict_<name>`)."""

    writes: int = counter()
    fetches: int = counter()
    fetches_joined: int = counter()
    fetches_skipped: int = counter()
    fetch_hit_chunks: int = counter()
    fetch_waits_timed_out: int = counter()


@dataclasses.dataclass
class DictFetch:
    """A fetch queued until the next housekeeping: (pool key, record) per chunk."""

    key: tuple
    items: list[tuple[bytes, bytes]]
    held: list[KVCacheBlock]
    generation: int
    done: bool = False


class DictTier(SpillTier):
    """Chunks in a dict, by block-pool key.

    Args:
        arena: the daemon's arena (records are copied out of and into its blocks).
        fetch_wait_s: how long a LOOKUP / ACQUIRE waits for its fetch, in seconds.
    """

    name = "dict"

    def __init__(self, arena: Arena, fetch_wait_s: float = 5.0) -> None:
        self.arena = arena
        self.fetch_wait_s = fetch_wait_s
        self.chunks: dict[bytes, bytes] = {}
        self.counts = DictStats()
        self._jobs = FetchJobs(MAX_FETCH_JOBS, self.counts)
        self._queued: list[DictFetch] = []
        self._namespaces: set[int] = set()
        self._fingerprints: dict[int, bytes] = {}  # ns id -> its namespace fingerprint
        self._ns_of_fp: dict[bytes, int] = {}

    def register_namespace(self, ns: int, layout: Layout) -> None:
        if layout.fmt != "kv":
            self._namespaces.add(ns)
            fp = self._fingerprints[ns] = namespace_fingerprint(layout)
            self._ns_of_fp[fp] = ns

    def unregister_namespace(self, ns: int) -> None:
        self._namespaces.discard(ns)
        self._ns_of_fp.pop(self._fingerprints.pop(ns, b""), None)

    def _pool_key(self, key: SpillKey) -> bytes | None:
        ns = self._ns_of_fp.get(key[0])
        return None if ns is None else CHUNK_TAG + ns.to_bytes(4, "little") + key[1]

    def snapshot_keys(self):
        """Its chunks of live namespaces, the last copied first (no parents kept)."""
        fps = self._fingerprints
        for pool_key in reversed(self.chunks):
            fp = fps.get(int.from_bytes(pool_key[1:5], "little"))
            if fp is not None:
                yield fp, pool_key[5:]

    def chunk_parent(self, key: SpillKey) -> bytes | None:
        pool_key = self._pool_key(key)
        return b"" if pool_key is not None and pool_key in self.chunks else None

    def token_ids(self, key: SpillKey) -> bytes | None:
        pool_key = self._pool_key(key)
        record = self.chunks.get(pool_key) if pool_key is not None else None
        if record is None:
            return None
        return record[RECORD_HEADER_BYTES:read_header(record).tokens_end]

    def _copy(self, pool_key: bytes, blocks: list[KVCacheBlock]) -> None:
        if pool_key[:1] != CHUNK_TAG or int.from_bytes(pool_key[1:5], "little") not in \
                self._namespaces:
            return
        arena = self.arena
        self.chunks[pool_key] = b"".join(
            bytes(arena.numpy_view(arena.block_offset(b.block_id), b.num_bytes)) for b in blocks)
        self.counts.writes += 1

    def spill(self, pool_key: bytes, blocks: list[KVCacheBlock]) -> None:
        self._copy(pool_key, blocks)

    def write_through(self, pool: BlockPool, values) -> None:
        for pool_key, blocks in values:
            self._copy(pool_key, blocks)

    def start_fetch(self, request: FetchRequest) -> DictFetch | None:
        if any(ns not in self._namespaces for ns in request.namespaces):
            return None
        items = []
        for chunk_hash in request.chunk_hashes():
            found = [(p + chunk_hash, self.chunks.get(p + chunk_hash)) for p in request.prefixes]
            if any(record is None for _, record in found):
                break
            items.extend(found)
        if not items:
            return None
        key = request.job_key()
        job, may_start = self._jobs.join(key)
        if not may_start:
            return job
        job = DictFetch(key, items, request.prefix_blocks(), request.pool.clear_generation)
        request.pool.touch(job.held)
        self._jobs.add(key, job)
        self._queued.append(job)
        return job

    def housekeeping(self) -> None:
        """Install the queued fetches (what a real tier's threads and completions do)."""
        pool, block_bytes, arena = self.pool, self.arena.block_bytes, self.arena
        queued, self._queued = self._queued, []
        for job in queued:
            for pool_key, record in job.items:
                if job.generation != pool.clear_generation or pool_key in pool.cached:
                    continue
                blocks = pool.allocate(-(-len(record) // block_bytes))
                if blocks is None:
                    break
                for i, block in enumerate(blocks):
                    piece = record[i * block_bytes:(i + 1) * block_bytes]
                    block.num_bytes = len(piece)
                    arena.numpy_view(arena.block_offset(block.block_id), len(piece))[:] = \
                        memoryview(piece)
                pool.commit(blocks, pool_key)
                job.held.extend(blocks)
                self.counts.fetch_hit_chunks += 1
            pool.free(job.held)
            job.held, job.done = [], True
            self._jobs.finish(job.key)

    def evict(self, pool_key: bytes) -> bool:
        return self.chunks.pop(pool_key, None) is not None

    def clear(self) -> int:
        num_chunks = len(self.chunks)
        self.chunks.clear()
        for job in self._jobs:
            if job.held and self.pool is not None:
                self.pool.free(job.held)
            job.held = []
        return num_chunks

    def stats(self) -> DictStats:
        return self.counts

    def info(self) -> dict:
        return {"dict_enabled": 1, "dict_chunks": len(self.chunks),
                **info_fields(self.counts, "dict_")}

    def close(self) -> None:
        self.chunks.clear()
