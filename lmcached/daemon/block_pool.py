"""The block pool: which cached value lives in which arena block, ref counts, LRU eviction.

Why this file exists: it is the only place that changes block metadata. The daemon owns
one `BlockPool` per arena; clients never see it (they exchange block ids with the daemon).
Pure data structure: no sockets, no shared memory, no clock.

Semantics follow vLLM v1's `BlockPool` (vllm/v1/core/block_pool.py), extended with an
explicit WRITING state (a block being filled by one writer is invisible to readers) and
with values that span several blocks:

    allocate(n) -> WRITING blocks, ref_cnt 1, held by the caller
    commit(blocks, h) -> READY and indexed under h; the caller still holds its ref
    abort(blocks) -> FREE, ref_cnt 0, front of the free queue
    touch(blocks) -> ref_cnt += 1 (a zero-ref block leaves the free queue: a cache hit)
    free(blocks) -> ref_cnt -= 1; blocks reaching 0 are appended to the free queue in
                    REVERSE order (the tail of a prefix chain is evicted before its head);
                    blocks without a hash go to the FRONT

Popping a cached block from the free queue evicts its whole value (every block of its
span leaves the index and moves to the front of the queue as an empty block).
"""

from collections.abc import Callable

from lmcached.wire.protocol import block_ref

from lmcached.daemon.free_queue import BlockHash, BlockState, FreeKVCacheBlockQueue, KVCacheBlock
from lmcached.daemon.pool_bookkeeping import ValueLedger
from lmcached.daemon.pool_invariants import check_pool_invariants
from lmcached.daemon.stats import PoolStats

# Plain-int aliases of the states for the hot paths (no enum attribute lookups).
_FREE, _WRITING, _READY = int(BlockState.FREE), int(BlockState.WRITING), int(BlockState.READY)


class BlockPool:
    """Metadata of `num_blocks` arena blocks: states, ref counts, hash index, LRU queue.

    After vLLM v1's `BlockPool`. Errors follow three kinds: pressure returns a value
    (`allocate` returns None, `commit` returns False), misuse raises `ValueError` with the
    fix in the message, and a broken invariant is an `AssertionError` saying it is a bug.

    Args:
        num_blocks: number of blocks in the arena, > 0 (ValueError otherwise).
        tier_id: the tier these blocks belong to (0: the host arena); each block's
            `ref` is `block_ref(tier_id, block_id)` (lmcached/wire/protocol.py).

    Attributes:
        blocks: every block, indexed by block id.
        free_block_queue: blocks with ref_cnt == 0 in eviction order.
        cached: value key -> its blocks (one or more), for READY values.
        stats: its hits, misses and evictions (`stats.PoolStats`).
        on_evict: called as `on_evict(key, blocks)` when pressure (`allocate`) evicts a
            value, before its blocks are handed out, while their bytes and `num_bytes`
            are intact (the daemon's L2 tier copies them, lmcached/daemon/l2/tier.py); None = no
            hook. Evictions on request (`evict`, `evict_lru`, `clear`) do not call it.
        ledger: per value, what the pool keeps and tells beside its index (chain parents,
            namespace counts, the event feed; lmcached/daemon/pool_bookkeeping.py), told
            where a value enters (`ValueLedger.stored`) or leaves (`.removed`) the index.
        clear_generation: how many `clear`s this pool has seen. A tier that installs
            values fetched in the background (disk, L2) notes it when a fetch starts and
            commits nothing once it changed: no fetch started before a CLEAR installs after.
    """

    def __init__(self, num_blocks: int, tier_id: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tier_id = tier_id
        self.blocks = [KVCacheBlock(i, block_ref(tier_id, i)) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached: dict[BlockHash, list[KVCacheBlock]] = {}
        self.num_writing_blocks = 0
        self.num_cached_blocks = 0  # READY and indexed
        self.num_detached_blocks = 0  # READY, pinned, removed from the index
        self.num_pinned_blocks = 0  # READY with ref_cnt > 0 (indexed or detached)
        self.num_cached_bytes = 0  # sum of num_bytes over READY indexed blocks
        self.stats = PoolStats()
        self.on_evict: Callable[[BlockHash, list[KVCacheBlock]], None] | None = None
        self.ledger = ValueLedger()
        self.clear_generation = 0

    # ------------------------------------------------------------------ gauges
    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` may hand out: empty ones plus unpinned cached ones."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_empty_blocks(self) -> int:
        """Blocks in state FREE (no value at all)."""
        return (self.num_blocks - self.num_writing_blocks - self.num_cached_blocks
                - self.num_detached_blocks)

    # -------------------------------------------------------------- allocation
    def allocate(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Hand out `num_blocks` blocks in state WRITING, each with ref_cnt 1.

        Empty blocks go first, then the least recently used cached values are evicted.
        A pinned or WRITING block is never handed out.

        Args:
            num_blocks: how many blocks, >= 1.

        Returns:
            The blocks, or None (nothing changed) when fewer than `num_blocks` blocks
            have ref_cnt 0.

        Raises:
            ValueError: num_blocks < 1.
        """
        if num_blocks < 1:
            raise ValueError(f"allocate needs num_blocks >= 1, got {num_blocks}")
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            return None
        out = []
        while len(out) < num_blocks:
            taken = queue.popleft_n(num_blocks - len(out))
            for i, block in enumerate(taken):
                assert block.ref_cnt == 0, f"free queue handed out {block!r}; this indicates a bug"
                block.ref_cnt = 1
                block.state = _WRITING
                out.append(block)
                if block.block_hash is None:
                    continue
                if len(block.span) > 1:
                    # Evicting a value of several blocks empties the rest of them, which
                    # are handed out next (as popping one block at a time would): put
                    # back the blocks taken after this one before they move to the front.
                    queue.prepend_n(taken[i + 1 :])
                    self._evict_popped(block)
                    break
                self._evict_popped(block)
        self.num_writing_blocks += num_blocks
        return out

    def allocate_empty(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """`allocate` from empty blocks only: never evicts a cached value. Returns None
        (nothing changed) when fewer than `num_blocks` blocks are empty; ValueError when
        num_blocks < 1.

        Empty blocks are always the front of the free queue, so these are the blocks
        `allocate` would hand out first. A device tier places new chunks this way and
        makes room by demotion instead (lmcached/daemon/demotion.py).
        """
        if num_blocks < 1:
            raise ValueError(f"allocate_empty needs num_blocks >= 1, got {num_blocks}")
        if num_blocks > self.num_empty_blocks:
            return None
        blocks = self.allocate(num_blocks)
        assert blocks is not None and all(b.block_hash is None for b in blocks), (
            "allocate_empty evicted a cached value; this indicates a bug")
        return blocks

    def _evict_popped(self, block: KVCacheBlock) -> None:
        """Evict the value of `block`, just popped from the free queue."""
        if self.on_evict is not None:
            self.on_evict(block.block_hash, self.cached[block.block_hash])
        span = self.cached.pop(block.block_hash)
        self.ledger.removed(block.block_hash)
        self.num_cached_bytes -= sum(b.num_bytes for b in span)
        if len(span) > 1:
            for other in span:
                if other is not block:
                    # The rest of the span is still queued (ref_cnt 0): it becomes
                    # empty and moves to the front, so it is handed out next.
                    self.free_block_queue.remove(other)
                    self._reset(other)
                    self.free_block_queue.appendleft(other)
        block.block_hash = None
        block.span = None
        self.num_cached_blocks -= len(span)
        block.num_bytes = 0
        self.stats.evictions += 1

    @staticmethod
    def _reset(block: KVCacheBlock) -> None:
        block.block_hash = None
        block.span = None
        block.num_bytes = 0
        block.state = _FREE

    def commit(self, blocks: list[KVCacheBlock], block_hash: BlockHash, replace: bool = False,
               *, parent: bytes = b"") -> bool:
        """Make WRITING blocks READY, index them under `block_hash` and announce them.

        The caller still holds its reference afterwards and releases it with `free`.
        Every value indexed is told to `ledger` here (`ValueLedger.stored`: its parent
        kept, a stored event published): whatever installs a chunk (a client's COMMIT,
        a disk or L2 fetch, the prewarm, a demotion) cannot forget to.

        Args:
            blocks: the value's blocks in order, all WRITING (from one `allocate`).
            block_hash: the value's key.
            replace: when the key is already cached, remove the old value from the index
                (its readers keep their pins until they free them) instead of refusing.
            parent: the chunk hash before it in its chain (b"" or ROOT_HASH: not known,
                or the chain's first chunk).

        Returns:
            True when indexed; False when the key was already cached and `replace` is
            False (the blocks stay WRITING: `abort` them).

        Raises:
            ValueError: a block is not in state WRITING, or `blocks` is empty.
        """
        return self.commit_many([blocks], [block_hash], replace, parents=[parent])[0]

    def commit_many(self, spans: list[list[KVCacheBlock]], block_hashes: list[BlockHash],
                    replace: bool = False, *,
                    parents: list[bytes] | None = None) -> list[bool]:
        """`commit` for several values at once (one request's chunks), in order: each
        value indexed is told to `ledger` as it is indexed, so the stored events follow the
        values' order.

        Every span is validated before any is committed, so a ValueError changes nothing.

        Args:
            parents: per value, its `commit` parent (None: b"" for every one).

        Returns:
            Per value, as `commit`.
        """
        if len(spans) != len(block_hashes):
            raise ValueError(f"{len(spans)} spans but {len(block_hashes)} hashes")
        if parents is not None and len(parents) != len(spans):
            raise ValueError(f"{len(spans)} spans but {len(parents)} parents")
        for blocks in spans:
            if not blocks:
                raise ValueError("commit needs at least one block per value")
            for block in blocks:
                if block.state != _WRITING:
                    raise ValueError(f"commit of block {block.block_id} in state "
                                     f"{BlockState(block.state).name}: only blocks from "
                                     "allocate() (WRITING) can be committed")
        cached = self.cached
        results = []
        num_committed_blocks = 0
        num_committed_bytes = 0
        stored = self.ledger.stored
        for i, (blocks, block_hash) in enumerate(zip(spans, block_hashes)):
            replaced = block_hash in cached
            if replaced:
                if not replace:
                    results.append(False)
                    continue
                self._unindex(block_hash, replacing=True)  # not an eviction
            span = list(blocks)
            for block in span:
                block.state = _READY
                block.block_hash = block_hash
                block.span = span
                num_committed_bytes += block.num_bytes
            cached[block_hash] = span
            num_committed_blocks += len(span)
            results.append(True)
            stored(block_hash, parents[i] if parents is not None else b"", span[0].block_id,
                   replaced)
        self.num_writing_blocks -= num_committed_blocks
        self.num_cached_blocks += num_committed_blocks
        self.num_pinned_blocks += num_committed_blocks
        self.num_cached_bytes += num_committed_bytes
        return results

    def abort(self, blocks: list[KVCacheBlock]) -> None:
        """Return WRITING blocks to the pool as empty blocks (front of the free queue);
        ValueError when a block is not WRITING, or is held by more than its writer."""
        for block in blocks:
            if block.state != _WRITING or block.ref_cnt != 1:
                raise ValueError(f"abort of {block!r}: only WRITING blocks held by their "
                                 "writer alone can be aborted")
        for block in blocks:
            block.ref_cnt = 0
            self._reset(block)
        self.free_block_queue.prepend_n(blocks)
        self.num_writing_blocks -= len(blocks)

    # ----------------------------------------------------------------- readers
    def get_cached(self, block_hash: BlockHash) -> list[KVCacheBlock] | None:
        """Return the READY blocks indexed under `block_hash`, or None. No side effects."""
        return self.cached.get(block_hash)

    def num_ready_prefix(self, block_hashes: list[BlockHash]) -> int:
        """Length of the longest prefix of `block_hashes` that is cached. No side effects."""
        cached = self.cached
        n = 0
        for block_hash in block_hashes:
            if block_hash not in cached:
                break
            n += 1
        return n

    def acquire_prefix(self, block_hashes: list[BlockHash]) -> list[list[KVCacheBlock]]:
        """Pin the values of the longest cached prefix of `block_hashes`.

        Counts a hit per value found and a miss per value of the request not found.

        Returns:
            One block list per pinned value, in request order; the caller `free`s them.
        """
        spans = []
        cached = self.cached
        for block_hash in block_hashes:
            span = cached.get(block_hash)
            if span is None:
                break
            self.touch(span)
            spans.append(span)
        self.stats.hits += len(spans)
        self.stats.misses += len(block_hashes) - len(spans)
        return spans

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add one reference to each READY block; a zero-ref block leaves the free queue.
        ValueError when a block is not READY."""
        for block in blocks:
            if block.state != _READY:
                raise ValueError(f"touch of {block!r}: only READY blocks can be pinned")
        remove = self.free_block_queue.remove
        num_pinned = 0
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)  # a cache hit: O(1) from the middle of the queue
                num_pinned += 1
            block.ref_cnt += 1
        self.num_pinned_blocks += num_pinned

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each READY block, tail first.

        Blocks reaching ref_cnt 0 are appended to the free queue in reverse order of
        `blocks` (so the end of a prefix chain is evicted before its beginning); blocks
        that lost their hash while pinned become empty and go to the front.

        Raises:
            ValueError: a block is WRITING (commit or abort it) or has ref_cnt 0.
        """
        for block in blocks:
            if block.state != _READY or block.ref_cnt < 1:
                raise ValueError(f"free of {block!r}: only pinned READY blocks can be freed "
                                 "(commit or abort WRITING blocks)")
        queue = self.free_block_queue
        released = []  # cached blocks reaching ref_cnt 0, tail first
        num_unpinned = 0
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            num_unpinned += 1
            if block.block_hash is None:
                self._reset(block)
                self.num_detached_blocks -= 1
                queue.appendleft(block)
            else:
                released.append(block)
        queue.append_n(released)
        self.num_pinned_blocks -= num_unpinned

    # ---------------------------------------------------------------- eviction
    def lru_values(self, limit: int,
                   max_blocks: int | None = None) -> list[tuple[BlockHash, list[KVCacheBlock]]]:
        """Up to `limit` unpinned cached values in eviction order (least recently used
        first), without evicting them. No side effects.

        Every value returned has ref_cnt 0 (only unpinned blocks are in the free queue),
        so a caller that pins them before it lets go of the loop never moves a pinned
        value.

        Args:
            limit: values wanted at most.
            max_blocks: queued blocks visited at most, empty ones included (a bound on
                the loop's work); None = no bound.

        Returns:
            (key, blocks) pairs, each value once.
        """
        if limit <= 0:
            return []
        found: dict[BlockHash, list[KVCacheBlock]] = {}
        visited = 0
        for block in self.free_block_queue:
            if block.block_hash is not None and block.block_hash not in found:
                found[block.block_hash] = block.span
                if len(found) >= limit:
                    break
            visited += 1
            if max_blocks is not None and visited >= max_blocks:
                break
        return list(found.items())

    def evict(self, block_hash: BlockHash) -> bool:
        """Remove a value from the index now; True when the key was cached.

        Unpinned blocks become empty (front of the free queue); pinned blocks keep
        their bytes for their current readers, are no longer found by anyone, and
        become empty when freed.
        """
        if not self._unindex(block_hash):
            return False
        self.stats.evictions += 1
        return True

    def evict_lru(self, num_values: int) -> int:
        """Evict up to `num_values` unpinned values, least recently used first; returns
        how many."""
        victims = self.lru_values(num_values)
        for block_hash, _ in victims:
            self.evict(block_hash)
        return len(victims)

    def clear(self) -> int:
        """Evict every cached value, pinned or not (as `evict`: a pinned value keeps its
        bytes for its current readers, is found by no one, and becomes empty when freed),
        and advance `clear_generation`. Returns how many values."""
        self.clear_generation += 1
        victims = list(self.cached)
        for block_hash in victims:
            self.evict(block_hash)
        return len(victims)

    def _unindex(self, block_hash: BlockHash, replacing: bool = False) -> bool:
        span = self.cached.pop(block_hash, None)
        if span is None:
            return False
        if not replacing:  # a replacement puts a value of the same key back at once
            self.ledger.removed(block_hash)
        self.num_cached_bytes -= sum(b.num_bytes for b in span)
        for block in span:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self._reset(block)
                self.free_block_queue.appendleft(block)
            else:
                block.block_hash = None
                self.num_detached_blocks += 1
        self.num_cached_blocks -= len(span)
        return True

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Verify every invariant in O(num_blocks) (tests and debug builds): the blocks'
        (lmcached/daemon/pool_invariants.py) and the ledger's; AssertionError (a bug)
        when one is broken."""
        check_pool_invariants(self)
        self.ledger.check_invariants(self.cached)
