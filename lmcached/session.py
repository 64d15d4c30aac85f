"""One session per client connection: what it pinned and what it is writing.

Why this file exists: a client may only RELEASE what it pinned and COMMIT/ABORT what it
allocated, and when its connection ends (close, crash = EOF) everything it held is given
back. The session is the record that makes both checks O(request).
"""

import time

from lmcached.shm.free_queue import BlockHash, KVCacheBlock


class PendingValue:
    """A value this session is writing: its key, its WRITING blocks, PUT or chunk."""

    __slots__ = ("key", "blocks", "replace")

    def __init__(self, key: BlockHash, blocks: list[KVCacheBlock], replace: bool) -> None:
        self.key = key
        self.blocks = blocks
        self.replace = replace  # PUT replaces an existing key; a chunk never needs to


class Session:
    """State of one client connection.

    Attributes:
        session_id: daemon-unique id (shown by `lmcached clients`).
        pid, uid, gid: peer credentials from SO_PEERCRED at accept.
        name: the client's self-description from HELLO.
        ns: namespace id from HELLO's layout, or None (admin tools).
        pins: block id -> number of pins this session holds on it.
        writing: block id -> the PendingValue it belongs to (every block of it).
        num_requests: requests handled.
        created_at / last_request_at: time.monotonic() seconds.
    """

    __slots__ = (
        "session_id",
        "pid",
        "uid",
        "gid",
        "name",
        "ns",
        "greeted",
        "pins",
        "writing",
        "num_requests",
        "created_at",
        "last_request_at",
    )

    def __init__(self, session_id: int, pid: int, uid: int, gid: int) -> None:
        self.session_id = session_id
        self.pid = pid
        self.uid = uid
        self.gid = gid
        self.name = ""
        self.ns: int | None = None
        self.greeted = False
        self.pins: dict[int, int] = {}
        self.writing: dict[int, PendingValue] = {}
        self.num_requests = 0
        self.created_at = self.last_request_at = time.monotonic()

    @property
    def num_pinned_blocks(self) -> int:
        """Pins held, counting a block pinned twice twice."""
        return sum(self.pins.values())

    @property
    def num_writing_blocks(self) -> int:
        """Blocks allocated to this session and not yet committed or aborted."""
        return len(self.writing)

    def add_pins(self, blocks: list[KVCacheBlock]) -> None:
        """Record one pin on each of `blocks` (after the pool touched them)."""
        pins = self.pins
        for block in blocks:
            pins[block.block_id] = pins.get(block.block_id, 0) + 1

    def take_pins(self, block_ids: list[int]) -> bool:
        """Remove one pin per listed id if this session holds them all; else change nothing.

        Returns:
            False when some id is not pinned by this session (often enough).
        """
        pins = self.pins
        wanted: dict[int, int] = {}
        for block_id in block_ids:
            wanted[block_id] = wanted.get(block_id, 0) + 1
        for block_id, count in wanted.items():
            if pins.get(block_id, 0) < count:
                return False
        for block_id, count in wanted.items():
            left = pins[block_id] - count
            if left:
                pins[block_id] = left
            else:
                del pins[block_id]
        return True

    def add_pending(self, value: PendingValue) -> None:
        """Record a value being written by this session."""
        for block in value.blocks:
            self.writing[block.block_id] = value

    def take_pending(self, block_ids: list[int]) -> list[PendingValue] | None:
        """Remove and return the values any of whose blocks are listed, in order.

        Returns:
            None (nothing changed) when some id is not being written by this session.
        """
        writing = self.writing
        values: dict[int, PendingValue] = {}
        for block_id in block_ids:
            value = writing.get(block_id)
            if value is None:
                return None
            values[id(value)] = value
        for value in values.values():
            for block in value.blocks:
                del writing[block.block_id]
        return list(values.values())
