"""One session per client connection: what it pinned and what it is writing.

Why this file exists: a client may only RELEASE the leases it holds and COMMIT/ABORT
what it allocated, and when its connection ends (close, crash = EOF) everything it held is given
back. The session is the record that makes both checks O(request).
"""

import time

from lmcached.daemon.free_queue import BlockHash, KVCacheBlock
from lmcached.wire.protocol import tier_of


class PendingValue:
    """A value this session is writing: its key, its WRITING blocks (all in one tier),
    PUT or chunk, when it was allocated (time.monotonic() seconds), and the hash of the
    chunk before it in the ALLOC's chain (b"": none or not known; the event feed's)."""

    __slots__ = ("key", "blocks", "replace", "allocated_at", "tier_id", "parent")

    def __init__(self, key: BlockHash, blocks: list[KVCacheBlock], replace: bool,
                 allocated_at: float, parent: bytes = b"") -> None:
        self.key = key
        self.parent = parent
        self.blocks = blocks
        self.replace = replace  # PUT replaces an existing key; a chunk never needs to
        self.allocated_at = allocated_at
        self.tier_id = tier_of(blocks[0].ref)  # the blocks' tier (0: the host arena)


class Session:
    """State of one client connection.

    Attributes:
        session_id: daemon-unique id (shown by `lmcached clients`).
        pid, uid, gid: peer credentials from SO_PEERCRED at accept.
        name: the client's self-description from HELLO.
        namespaces: namespace ids of HELLO's layouts, in order (empty: admin tools).
        record_bytes: namespace id -> bytes of its layout's full chunk record, the most
            one ALLOC'd chunk may take (key-value namespaces are absent: their values
            are bounded by `--max-session-share`).
        devices: HELLO's device UUIDs (tiers this session maps; "*": all, unmapped).
        readable: tier ids whose blocks this session may be handed, in read preference
            order (its own device tiers, then the host arena; (0,) for host-only).
        opened_tiers: device tiers whose file descriptor OPEN_TIER sent (once each).
        reply_fds: descriptors the server sends with the reply being encoded (SCM_RIGHTS),
            set by the handler and taken by the server; the daemon keeps them open.
        leases: lease id -> the blocks it pinned (one ref each), from ACQUIRE / GET.
        writing: block ref -> the PendingValue it belongs to (every block of it), in
            allocation order (oldest first).
        expired: block refs of values the daemon aborted because they stayed WRITING
            too long (`expire_pending`), until a COMMIT or ABORT names them or they
            are allocated to this session again.
        pins: block ref -> how many of this session's leases pin it.
        num_host_pinned / num_host_writing: host arena (tier 0) blocks this session
            pins (each counted once, however many of its leases pin it) and writes: what
            `--max-session-share` bounds.
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
        "record_bytes",
        "devices",
        "readable",
        "opened_tiers",
        "reply_fds",
        "greeted",
        "leases",
        "writing",
        "expired",
        "pins",
        "num_host_pinned",
        "num_host_writing",
        "num_requests",
        "tenants",
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
        self.record_bytes: dict[int, int] = {}
        self.devices: list[str] = []
        self.readable: tuple[int, ...] = (0,)
        self.opened_tiers: set[int] = set()
        self.reply_fds: list[int] = []
        self.greeted = False
        self.leases: dict[int, list[KVCacheBlock]] = {}
        self.writing: dict[int, PendingValue] = {}
        self.expired: set[int] = set()
        self.pins: dict[int, int] = {}
        # tenant fingerprints this session was counted under (at most
        # MAX_TENANTS_PER_SESSION; its others count under "other")
        self.tenants: set[bytes] = set()
        self.num_host_pinned = 0
        self.num_host_writing = 0
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

    @property
    def num_host_blocks_held(self) -> int:
        """Host arena blocks this session holds: pinned plus WRITING blocks."""
        return self.num_host_pinned + self.num_host_writing

    def num_new_host_blocks(self, blocks: list[KVCacheBlock]) -> int:
        """Host arena blocks among `blocks` (distinct) this session does not pin yet."""
        pins = self.pins
        return sum(1 for block in blocks if not tier_of(block.ref) and block.ref not in pins)

    def add_lease(self, lease: int, blocks: list[KVCacheBlock]) -> None:
        """Record one pin on each of `blocks` (after the pool touched them) as `lease`."""
        self.leases[lease] = blocks
        pins = self.pins
        num_new = 0
        for block in blocks:
            ref = block.ref
            count = pins.get(ref, 0)
            if not count and not tier_of(ref):
                num_new += 1
            pins[ref] = count + 1
        self.num_host_pinned += num_new

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
        pins = self.pins
        num_gone = 0
        for block in blocks:
            ref = block.ref
            count = pins[ref] - 1
            if count:
                pins[ref] = count
            else:
                del pins[ref]
                num_gone += not tier_of(ref)
        self.num_host_pinned -= num_gone
        return blocks

    def add_pending(self, value: PendingValue) -> None:
        """Record a value being written by this session."""
        expired = self.expired
        for block in value.blocks:
            self.writing[block.ref] = value
            if expired:
                expired.discard(block.ref)
        if not value.tier_id:
            self.num_host_writing += len(value.blocks)

    def take_pending(self, refs: list[int]) -> list[PendingValue] | None:
        """Remove and return the values any of whose blocks are listed, in order.

        Args:
            refs: block references (`block_ref(tier, block id)`) from this session's ALLOC.

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
            if not value.tier_id:
                self.num_host_writing -= len(value.blocks)
        return list(values.values())

    def expire_pending(self, allocated_before: float) -> list[PendingValue]:
        """Remove the values allocated before `allocated_before` (time.monotonic()
        seconds) and remember their block refs in `expired`.

        Walks `writing` from its oldest entry and stops at the first younger value:
        O(values removed).

        Returns:
            The removed values, oldest first; the caller aborts their blocks.
        """
        old = []
        for value in self.writing.values():
            if value.allocated_at >= allocated_before:
                break
            old.append(value)
        if not old:
            return []
        refs = [value.blocks[0].ref for value in old]
        values = self.take_pending(refs)
        assert values is not None, "a WRITING value left its session's index; bug"
        self.expired.update(block.ref for value in values for block in value.blocks)
        return values

    def clear(self) -> None:
        """Forget every lease and pending value (their blocks were given back)."""
        self.leases.clear()
        self.writing.clear()
        self.expired.clear()
        self.pins.clear()
        self.num_host_pinned = self.num_host_writing = 0
