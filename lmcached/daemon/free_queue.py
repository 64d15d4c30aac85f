"""Block metadata and the LRU free-block queue.

Why this file exists: the daemon decides which KV chunk lives in which arena block with
two pieces of plain metadata, a `KVCacheBlock` per block and one doubly-linked queue of
the blocks nobody holds. Both follow vLLM v1's `KVCacheBlock` and
`FreeKVCacheBlockQueue` (vllm/v1/core/kv_cache_utils.py): the links are stored in the
blocks themselves (intrusive), so removing a block from the middle of the queue on a
cache hit is O(1) and allocates nothing, and two sentinel nodes remove the edge cases.

Queue order is eviction order::

    fake_head <-> [empty blocks ...] <-> [cached blocks, least recently used first] <-> fake_tail

`popleft()` therefore hands out an empty block while there is one, then the least
recently used cached block (whose hash the block pool evicts).

This class owns every link and the count: the block pool moves blocks only through its
methods, one block at a time (`popleft`, `remove`, `append`, `appendleft`) or a run of
blocks in one call (`popleft_n`, `append_n`, `prepend_n`, as vLLM's queue has them).
"""

import enum
from typing import Hashable, Iterator, NewType

# Key of one cached value in the block pool: (namespace id, 16-byte chunk hash) for KV
# chunks, (namespace id, str) for the generic key-value adapter. Opaque to this package.
BlockHash = NewType("BlockHash", Hashable)


class BlockState(enum.IntEnum):
    """Life cycle of an arena block (see docs/architecture.md, "Block states")."""

    FREE = 0  # empty, no hash; in the free queue
    WRITING = 1  # allocated to one writer, invisible to readers; never in the free queue
    READY = 2  # committed; readable while indexed; in the free queue iff ref_cnt == 0


class KVCacheBlock:
    """Metadata of one fixed-size block of the arena (after vLLM's `KVCacheBlock`).

    Attributes:
        block_id: index of the block in its tier's memory, 0 <= block_id < num_blocks.
        ref: the block's reference on the wire, `block_ref(tier, block_id)`
            (lmcached/wire/protocol.py); the block id itself in the host arena.
        ref_cnt: number of holders (writers and readers). A block with ref_cnt > 0 is
            never handed out again.
        block_hash: key of the cached value this block belongs to, or None when the
            block is empty or was detached from the index while still pinned.
        state: a `BlockState`.
        span: every block of the value this block belongs to, in order (a value larger
            than one block spans several, which are committed, pinned and evicted
            together). None for a FREE block.
        num_bytes: bytes of the value stored in this block (set by the writer's owner
            before commit; block_bytes except in a value's last block), 0 when FREE.
        prev_free_block / next_free_block: intrusive links of the free queue; None
            when the block is not in the queue.
    """

    __slots__ = (
        "block_id",
        "ref",
        "ref_cnt",
        "block_hash",
        "state",
        "span",
        "num_bytes",
        "prev_free_block",
        "next_free_block",
    )

    def __init__(self, block_id: int, ref: int | None = None) -> None:
        self.block_id = block_id
        self.ref = block_id if ref is None else ref
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.state = BlockState.FREE
        self.span: list["KVCacheBlock"] | None = None
        self.num_bytes = 0
        self.prev_free_block: "KVCacheBlock | None" = None
        self.next_free_block: "KVCacheBlock | None" = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"state={BlockState(self.state).name}, block_hash={self.block_hash!r})"
        )


class FreeKVCacheBlockQueue:
    """Doubly-linked queue of the blocks with ref_cnt == 0, in eviction order.

    After vLLM's `FreeKVCacheBlockQueue`: links live in the blocks, fake head and tail
    sentinels make every operation branch-free at the edges, and no operation
    allocates a Python object.

    Args:
        blocks: the blocks that start in the queue, in queue order (front first).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        self._splice(self.fake_head, blocks, self.fake_tail)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block (an empty one, else the LRU cached one).

        Raises:
            ValueError: the queue is empty.
        """
        block = self.fake_head.next_free_block
        if block is self.fake_tail:
            raise ValueError("no free blocks: the free-block queue is empty")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the `n` front blocks in one pass (vLLM's `popleft_n`).

        Args:
            n: how many blocks, 0 <= n <= num_free_blocks.

        Returns:
            The blocks in queue order (front first), unlinked.

        Raises:
            ValueError: n is negative or more than the queue holds (nothing changes).
        """
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(
                f"cannot pop {n} blocks: the free-block queue holds {self.num_free_blocks}"
            )
        head = self.fake_head
        block = head.next_free_block
        out = []
        for _ in range(n):
            out.append(block)
            following = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = following
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Remove `block` from anywhere in the queue in O(1).

        Raises:
            AssertionError: `block` is not in the queue (indicates a bug).
        """
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        assert prev_block is not None and next_block is not None, (
            f"block {block.block_id} is not in the free queue; this indicates a bug"
        )
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = None
        block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the back (most recently used: evicted last)."""
        last = self.fake_tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put `block` at the front (handed out first: used for empty blocks)."""
        first = self.fake_head.next_free_block
        first.prev_free_block = block
        block.next_free_block = first
        block.prev_free_block = self.fake_head
        self.fake_head.next_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the back in their order, so blocks[-1] is evicted last
        (vLLM's `append_n`). The blocks must not be in the queue."""
        self._splice(self.fake_tail.prev_free_block, blocks, self.fake_tail)
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the front in their order, so blocks[0] is handed out first
        (vLLM's `prepend_n`; `prepend_n(popleft_n(k))` leaves the queue as it was).
        The blocks must not be in the queue."""
        self._splice(self.fake_head, blocks, self.fake_head.next_free_block)
        self.num_free_blocks += len(blocks)

    @staticmethod
    def _splice(before: KVCacheBlock, blocks: list[KVCacheBlock],
                after: KVCacheBlock) -> None:
        """Link `blocks`, in order, between the adjacent nodes `before` and `after`."""
        prev = before
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The queued blocks front to back; do not change the queue while iterating."""
        block = self.fake_head.next_free_block
        tail = self.fake_tail
        while block is not tail:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Return the queued blocks front to back (for tests and debugging; O(n))."""
        return list(self)
