"""`ValueLedger`: what a block pool keeps and tells beside its blocks, per value.

Why this file exists: `BlockPool` (lmcached/daemon/block_pool.py) moves blocks between
FREE, WRITING and READY. Around its index the rest of the daemon reads per-value tables
(each chunk's chain parent, the values of each namespace) and the event feed hears of
every value entering or leaving it. The pool holds one `ValueLedger` (`pool.ledger`)
and tells it, at the two places a value enters or leaves its index; the ledger keeps
its own state and never looks into the pool:

    BlockPool.commit_many --> ledger.stored(key, parent, block_id, replaced)
                              count the key's group; parents[key] = parent;
                              events.stored(key, parent, block_id)
    a value leaves the index --> ledger.removed(key)
    (eviction, EVICT, CLEAR)     events.removed(key); parents.pop(key);
                                 count it out of its group, on_group_empty(group)
"""

from collections.abc import Callable, Collection, Hashable

from lmcached.wire.record_format import ROOT_HASH

from lmcached.daemon.free_queue import BlockHash


class ValueLedger:
    """One block pool's per-value tables and announcements.

    Attributes:
        group_of: maps a key to its group (the daemon: its namespace,
            `keys.namespace_tag_of`), so that the ledger counts the indexed values of
            each group in `num_values_by_group`; None = no counting.
        num_values_by_group: group -> values in the pool's index now (groups with none
            are absent).
        on_group_empty: called as `on_group_empty(group)` when the last indexed value
            of a group leaves the index (an eviction of any kind; a replacement keeps
            its key's group counted); None = no hook.
        events: the daemon's event feed (lmcached/daemon/events.py), told of every
            value that leaves the index (`EventFeed.removed`, O(1)) and of every chunk
            the pool's `commit` indexes; None = not told.
        parents: key -> the chunk hash before it in its chain, for each indexed chunk
            whose writer named one (`BlockPool.commit`'s `parent`): what a router chains
            an announcement by, carried along when the chunk moves to another tier (a
            demotion, a disk slot). Dropped when the chunk leaves the index.
    """

    def __init__(self) -> None:
        self.group_of: Callable[[BlockHash], Hashable] | None = None
        self.num_values_by_group: dict[Hashable, int] = {}
        self.on_group_empty: Callable[[Hashable], None] | None = None
        self.events = None  # an EventFeed (events.py, a layer above: not imported)
        self.parents: dict[BlockHash, bytes] = {}

    def stored(self, block_hash: BlockHash, parent: bytes, block_id: int,
               replaced: bool = False) -> None:
        """A value just entered the pool's index (`BlockPool.commit_many`, whoever
        installs it): count it in its group, keep its parent and tell the event feed,
        if any. O(1).

        Args:
            block_hash: the value's key.
            parent: the chunk hash before it in its chain (b"" or ROOT_HASH: not known,
                or the chain's first chunk; b"" keeps the parent a replaced value had).
            block_id: its first block (the record header, read for token ids).
            replaced: the key was indexed already and its old value was taken out of
                the index without `removed` (a replacement): it stays counted once.
        """
        if not replaced and self.group_of is not None:
            group = self.group_of(block_hash)
            counts = self.num_values_by_group
            counts[group] = counts.get(group, 0) + 1
        if parent == ROOT_HASH:
            parent = b""
        if parent:
            self.parents[block_hash] = parent
        if self.events is not None:
            self.events.stored(block_hash, parent, block_id)

    def removed(self, block_hash: BlockHash) -> None:
        """A value just left the pool's index (any eviction; not a replacement): tell
        the event feed, forget its parent, count it out of its group and, when it was
        the group's last, call `on_group_empty`. O(1)."""
        if self.events is not None:
            self.events.removed(block_hash)
        self.parents.pop(block_hash, None)
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

    def check_invariants(self, indexed: Collection[BlockHash]) -> None:
        """Verify the tables against the pool's indexed keys, `indexed`, in
        O(len(indexed)) (`BlockPool.check_invariants`).

        Raises:
            AssertionError: a table disagrees with the index (indicates a bug).
        """
        if self.group_of is not None:
            groups: dict[Hashable, int] = {}
            for block_hash in indexed:
                group = self.group_of(block_hash)
                groups[group] = groups.get(group, 0) + 1
            assert groups == self.num_values_by_group, (
                f"num_values_by_group {self.num_values_by_group} != {groups}; bug"
            )
        stale = [key for key in self.parents if key not in indexed]
        assert not stale, f"parents kept for {len(stale)} keys no longer indexed (a bug)"
