"""What the block pool keeps and tells beside its blocks, and the evictions asked of it.

Why this file exists: `BlockPool` (lmcached/daemon/block_pool.py) moves blocks between
FREE, WRITING and READY; around its index it also keeps per-value tables that the rest of
the daemon reads (each chunk's chain parent, the values of each namespace, how many
CLEARs it has seen) and tells the event feed of every value entering or leaving it. That
bookkeeping, and the evictions a request asks for (EVICT, INVALIDATE, CLEAR, a tier's
`evict_lru`, in the order `lru_values` gives, which the demotion and the disk's
write-ahead read too), are written here, as `ValueBookkeeping`, the pool's base class:
it works on the pool's `cached`, `free_block_queue`, `stats` and `_unindex`.

    commit_many --> _publish_stored   parents[key] = parent; events.stored(...)
    a value leaves the index --> _uncount: num_values_by_group, on_group_empty;
                                 events.removed(key); parents.pop(key)
    clear --> clear_generation += 1; evict every value
"""

from collections.abc import Callable, Hashable

from lmcached.wire.record_format import ROOT_HASH

from lmcached.daemon.free_queue import BlockHash, KVCacheBlock


class ValueBookkeeping:
    """The block pool's per-value tables, announcements and requested evictions.

    Attributes:
        clear_generation: how many `clear`s this pool has seen. A tier that installs
            values fetched in the background (disk, L2) notes it when a fetch starts and
            commits nothing once it changed: a fetch started before a CLEAR never
            installs after it.
        group_of: maps a key to its group (the daemon: its namespace,
            `keys.namespace_tag_of`), so that the pool counts the indexed values of
            each group in `num_values_by_group`; None = no counting.
        num_values_by_group: group -> values in the index now (groups with none are
            absent).
        on_group_empty: called as `on_group_empty(group)` when the last indexed value
            of a group leaves the index (an eviction of any kind; a replacement keeps
            its key's group counted); None = no hook.
        events: the daemon's event feed (lmcached/daemon/events.py), told of every
            value that leaves the index (`EventFeed.removed`, O(1)) and of every chunk
            `commit` indexes; None = not told.
        parents: key -> the chunk hash before it in its chain, for each indexed chunk
            whose writer named one (`commit`'s `parent`): what a router chains an
            announcement by, carried along when the chunk moves to another tier (a
            demotion, a disk slot). Dropped when the chunk leaves the index.
    """

    cached: dict[BlockHash, list[KVCacheBlock]]

    def __init__(self) -> None:
        self.group_of: Callable[[BlockHash], Hashable] | None = None
        self.num_values_by_group: dict[Hashable, int] = {}
        self.on_group_empty: Callable[[Hashable], None] | None = None
        self.clear_generation = 0
        self.events = None  # an EventFeed (events.py, a layer above: not imported)
        self.parents: dict[BlockHash, bytes] = {}

    # ------------------------------------------------------------ announcements
    def _publish_stored(self, block_hash: BlockHash, parent: bytes, block_id: int) -> None:
        """A chunk just committed entered this pool (`commit_many`, whoever installs
        it): keep its parent (`parents`) and tell the event feed, if any. O(1).

        Args:
            block_hash: the value's key.
            parent: the chunk hash before it in its chain (b"" or ROOT_HASH: not known,
                or the chain's first chunk).
            block_id: its first block (the record header, read for token ids).
        """
        if parent == ROOT_HASH:
            parent = b""
        if parent:
            self.parents[block_hash] = parent
        if self.events is not None:
            self.events.stored(block_hash, parent, block_id)

    def _uncount(self, block_hash: BlockHash) -> None:
        """Count a value that just left the index out of its group (`group_of`)."""
        if self.group_of is None:
            return
        group = self.group_of(block_hash)
        left = self.num_values_by_group[group] - 1
        if left:
            self.num_values_by_group[group] = left
            return
        del self.num_values_by_group[group]
        if self.on_group_empty is not None:
            self.on_group_empty(group)
