"""One session per client connection: what it pinned and what it is writing.

Why this file exists: a client may only RELEASE the leases it holds and COMMIT/ABORT
what it allocated, and when its connection ends (close, crash = EOF) everything it held is given
back. The session is the record that makes both checks O(request).
"""

import time

from lmcached.shm.free_queue import BlockHash, KVCacheBlock


class PendingValue:
    """A value this session is writing: its key, its WRITING blocks (all in one tier),
    PUT or chunk."""

    __slots__ = ("key", "blocks", "replace")

    def __init__(self, key: BlockHash, blocks: list[KVCacheBlock], replace: bool) -> None:
        self.key = key
        self.blocks = blocks
        self.replace = replace  # PUT replaces an existing key; a chunk never needs to

    @property
    def tier_id(self) -> int:
        """The tier of the value's blocks (0: the host arena)."""
        return self.blocks[0].ref >> 32


class Session:
    """State of one client connection.

    Attributes:
        session_id: daemon-unique id (shown by `lmcached clients`).
        pid, uid, gid: peer credentials from SO_PEERCRED at accept.
        name: the client's self-description from HELLO.
        namespaces: namespace ids of HELLO's layouts, in order (empty: admin tools).
        devices: HELLO's device UUIDs (tiers this session maps; "*": all, unmapped).
        readable: tier ids whose blocks this session may be handed, in read preference
            order (its own device tiers, then the host arena; (0,) for host-only).
        opened_tiers: device tiers whose file descriptor OPEN_TIER sent (once each).
        reply_fds: descriptors the server sends with the reply being encoded (SCM_RIGHTS),
            set by the handler and taken by the server; the daemon keeps them open.
        leases: lease id -> the blocks it pinned (one ref each), from ACQUIRE / GET.
        writing: block ref -> the PendingValue it belongs to (every block of it).
        num_requests: requests handled.
        created_at / last_request_at: time.monotonic() seconds.
    """

    __slots__ = (
        "session_id",
        "pid",
        "uid",
        "gid",
        "name",
        "namespaces",
        "devices",
        "readable",
        "opened_tiers",
        "reply_fds",
        "greeted",
        "leases",
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
        self.namespaces: list[int] = []
        self.devices: list[str] = []
        self.readable: tuple[int, ...] = (0,)
        self.opened_tiers: set[int] = set()
        self.reply_fds: list[int] = []
        self.greeted = False
        self.leases: dict[int, list[KVCacheBlock]] = {}
        self.writing: dict[int, PendingValue] = {}
        self.num_requests = 0
        self.created_at = self.last_request_at = time.monotonic()

    @property
    def num_pinned_blocks(self) -> int:
        """Pins held by this session's leases, counting a block pinned twice twice."""
        return sum(len(blocks) for blocks in self.leases.values())

    @property
    def num_writing_blocks(self) -> int:
        """Blocks allocated to this session and not yet committed or aborted."""
        return len(self.writing)

    def add_lease(self, lease: int, blocks: list[KVCacheBlock]) -> None:
        """Record one pin on each of `blocks` (after the pool touched them) as `lease`."""
        self.leases[lease] = blocks

    def take_leases(self, leases: list[int]) -> list[KVCacheBlock] | None:
        """Remove the listed leases if this session holds them all; else change nothing.

        Returns:
            The blocks they pinned (one entry per pin), or None when some lease is not
            held (unknown, already released, or listed twice).
        """
        held = self.leases
        if len(set(leases)) != len(leases) or any(lease not in held for lease in leases):
            return None
        blocks = []
        for lease in leases:
            blocks.extend(held.pop(lease))
        return blocks

    def add_pending(self, value: PendingValue) -> None:
        """Record a value being written by this session."""
        for block in value.blocks:
            self.writing[block.ref] = value

    def take_pending(self, refs: list[int]) -> list[PendingValue] | None:
        """Remove and return the values any of whose blocks are listed, in order.

        Args:
            refs: block references (`tier << 32 | block id`) from this session's ALLOC.

        Returns:
            None (nothing changed) when some ref is not being written by this session.
        """
        writing = self.writing
        values: dict[int, PendingValue] = {}
        for ref in refs:
            value = writing.get(ref)
            if value is None:
                return None
            values[id(value)] = value
        for value in values.values():
            for block in value.blocks:
                del writing[block.ref]
        return list(values.values())
