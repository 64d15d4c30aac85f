"""The protocol of a tier under the host arena, and the fetches in flight it keeps.

Why this file exists: the service, INFO and the metrics treat every tier under the arena
(the disk tier, L2, a test's tier) the same way, through an ordered list of them (lookup
order: arena, then each tier of the list; `CacheService.spill_tiers`). A new tier is one
folder that implements `SpillTier` and one line that puts it in the list: nothing else
names it. After SGLang's `HiCacheStorage` (one ABC, one folder per backend).

What every tier shares, written once here:

- `FetchRequest`: the chain a LOOKUP / ACQUIRE missed in the arena at chunk `first`.
- `FetchJobs`: the fetches a tier has in flight, keyed by (namespaces, first hash, last
  hash) so that a lookup of the same chain joins the fetch in flight instead of starting
  another, and bounded (beyond `max_jobs`, or while the tier is down, a miss is answered at
  once: counted `fetches_skipped`).

Every method runs on the daemon's loop thread; a tier does its I/O on its own threads
(the daemon's job runner, lmcached/daemon/jobs.py) and applies their results on the loop.
"""

import abc
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from lmcached.wire.protocol import HASH_BYTES, Layout
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import KVCacheBlock

InfoFields = dict[str, int | float | str]
SpillKey = tuple[bytes, bytes]  # (namespace fingerprint, chunk hash), 16 bytes each


class FetchCounters(Protocol):
    """The counters every spill tier's stats dataclass has (INFO `<name>_<field>`):
    fetches started, joined, skipped (`FetchJobs`), and LOOKUP / ACQUIRE waits that ran
    out before their fetch ended (`CacheService.resume`)."""

    fetches: int
    fetches_joined: int
    fetches_skipped: int
    fetch_waits_timed_out: int


@dataclasses.dataclass(frozen=True, slots=True)
class FetchRequest:
    """A chain that missed in the arena from chunk `first` on: what a tier may fetch.

    Attributes:
        pool: the host arena's block pool (fetched chunks are installed there).
        namespaces: namespace ids of the request (a chunk is fetched in all or none).
        prefixes: their block-pool key prefixes (`keys.chunk_prefix`), one per namespace.
        hashes: the request's chunk hashes, HASH_BYTES each, concatenated.
        first: index of the first chunk missing in the arena.
        root: the hash before `hashes[0]` (the request's `parent`: ROOT_HASH, a salted
            chain's root, or the chunk before a run that starts mid-chain), from which
            the fetched chunks are verified.
        prefix_blocks: returns the blocks of the chain's chunks before `first` in the
            arena; called only for a new fetch, which pins them until it ends (its
            installs never evict them).
    """

    pool: BlockPool
    namespaces: list[int]
    prefixes: list[bytes]
    hashes: bytes
    first: int
    root: bytes
    prefix_blocks: Callable[[], list[KVCacheBlock]]

    def chunk_hashes(self) -> list[bytes]:
        """The hashes of the chunks to fetch, `hashes[first:]`, one per chunk."""
        hashes = self.hashes
        return [hashes[i:i + HASH_BYTES]
                for i in range(self.first * HASH_BYTES, len(hashes), HASH_BYTES)]

    def parent_of(self, i: int) -> bytes:
        """The hash before chunk `i` of the request (`root` for chunk 0)."""
        return self.hashes[(i - 1) * HASH_BYTES:i * HASH_BYTES] if i else self.root

    def job_key(self) -> tuple:
        """(namespaces, first hash, last hash): the key of a fetch of this chain's rest;
        a lookup of the same chain to the same end joins it."""
        first = self.first * HASH_BYTES
        return (tuple(self.namespaces), self.hashes[first:first + HASH_BYTES],
                self.hashes[-HASH_BYTES:])


class FetchJobs:
    """The fetches a tier has in flight, by `FetchRequest.job_key`.

    Args:
        max_jobs: fetches in flight at most; beyond, a miss is answered at once.
        stats: the tier's counters, where `fetches`, `fetches_joined` and
            `fetches_skipped` are counted.
    """

    def __init__(self, max_jobs: int, stats: "FetchCounters") -> None:
        self.max_jobs = max_jobs
        self.stats = stats
        self._jobs: dict[tuple, object] = {}

    def join(self, key: tuple, busy: bool = False) -> tuple[object | None, bool]:
        """The fetch in flight under `key` (joined, counted), or whether a new one may
        start: not when `busy` (the tier cannot fetch now) or `max_jobs` are in flight
        (counted `fetches_skipped`).

        Returns:
            (job, False) to join; (None, True) to start one; (None, False) to answer
            the miss at once.
        """
        job = self._jobs.get(key)
        if job is not None:
            self.stats.fetches_joined += 1
            return job, False
        if busy or len(self._jobs) >= self.max_jobs:
            self.stats.fetches_skipped += 1
            return None, False
        return None, True

    def add(self, key: tuple, job: object) -> None:
        """A fetch started under `key` (counted `fetches`)."""
        assert key not in self._jobs, "a second fetch of the same chain (a bug)"
        self._jobs[key] = job
        self.stats.fetches += 1

    def finish(self, key: tuple) -> None:
        """The fetch under `key` ended (idempotent)."""
        self._jobs.pop(key, None)

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator:
        return iter(list(self._jobs.values()))


class SpillTier(abc.ABC):
    """A tier under the host arena: chunks spill to it, misses are fetched back from it.

    Attributes:
        name: the tier's INFO section and the prefix of its fields (`<name>_enabled`);
            a tier absent from the list shows `{<name>_enabled: 0}` in its section.
        fetch_wait_s: how long a LOOKUP / ACQUIRE waits for this tier's fetch, in
            seconds; 0 = never (the fetch still runs and a later lookup sees its chunks).
        pool: the host arena's block pool once it exists (`set_pool`), else None.
    """

    name: str = ""
    fetch_wait_s: float = 0.0
    pool: BlockPool | None = None

    def set_pool(self, pool: BlockPool, block_bytes: int) -> None:
        """The host arena's block pool exists now, with blocks of `block_bytes`: the
        completions unpin and install there from now on."""
        self.pool = pool

    def set_layouts(self, layout_of: Callable[[int], Layout | None]) -> None:
        """Where the tier looks a namespace's layout up (the service's; None for a freed
        id), for tiers that read layouts lazily rather than through `register_namespace`."""

    def set_events(self, events) -> None:
        """The daemon's chunk event feed (`lmcached.daemon.events.EventFeed`), for tiers
        that announce the chunks entering and leaving them; others ignore it."""

    @abc.abstractmethod
    def register_namespace(self, ns: int, layout: Layout) -> None:
        """Note a namespace the daemon created (idempotent)."""

    def unregister_namespace(self, ns: int) -> None:
        """Forget a freed namespace (its id may be given to another layout): a fetch in
        flight for it installs nothing more."""

    @abc.abstractmethod
    def start_fetch(self, request: FetchRequest):
        """Start (or join) a fetch of the rest of `request`'s chain.

        Returns:
            The fetch (an object whose `done` turns true once its chunks are installed
            or dropped), or None when this tier starts nothing for it.
        """

    @abc.abstractmethod
    def spill(self, pool_key: bytes, blocks: list[KVCacheBlock]) -> None:
        """`BlockPool.on_evict` hook: the chunk under `pool_key` is being evicted from the
        arena, its `blocks` reused after the call returns. Never raises."""

    @abc.abstractmethod
    def write_through(self, pool: BlockPool, values: list[tuple[bytes, list[KVCacheBlock]]]) -> None:
        """Values just committed in the arena: (pool key, READY blocks) each."""

    def housekeeping(self) -> None:
        """Periodic work of the loop thread (the service's `housekeeping`)."""

    def evict(self, pool_key: bytes) -> bool:
        """Forget the chunk under `pool_key` (an EVICT or INVALIDATE); whether it held it."""
        return False

    def snapshot_keys(self) -> Iterable[SpillKey]:
        """The keys of the chunks the tier holds now, in the order a KV-event
        subscriber's snapshot pages them (most recently used first;
        lmcached/daemon/events.py), as (namespace fingerprint, chunk hash).

        Returns:
            An iterable over the tier's live index, O(1) to make: the caller copies it
            at once, on the loop thread, before the tier changes. Nothing for a tier that
            cannot list its keys (L2: a store shared by every node, whose keys are not
            this node's to announce).
        """
        return ()

    def chunk_parent(self, key: SpillKey) -> bytes | None:
        """The parent hash of the chunk under `key` (b"": not known, or the root of its
        chain) while the tier holds it, else None. O(1), no I/O: the event feed asks it
        for each snapshot key as it pages it, and for its ancestors. None for a tier that
        cannot list its keys."""
        return None

    def token_ids(self, key: SpillKey) -> bytes | None:
        """The token ids (int64 little-endian bytes) of the chunk under `key`, or None
        (the tier does not hold it, or cannot read them now). May do one small blocking
        read on the calling thread (the loop thread: the event feed bounds how many a
        page, `events.SNAPSHOT_DISK_READS`); unverified: whoever uses them hashes them.
        None for a tier that cannot list its keys."""
        return None

    @abc.abstractmethod
    def clear(self) -> int:
        """Remove every chunk (an admin's CLEAR); the fetches in flight install nothing
        after it and unpin their chains now.

        Returns:
            The chunks removed that the tier can count (0 when it cannot).
        """

    @abc.abstractmethod
    def stats(self) -> FetchCounters:
        """The tier's counters: a dataclass of ints (`spill.counters.counter` fields),
        `FetchCounters` among them."""

    @abc.abstractmethod
    def info(self) -> InfoFields:
        """INFO section `name`: `<name>_*` fields."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the tier's threads and release what it holds, before the arena goes."""
