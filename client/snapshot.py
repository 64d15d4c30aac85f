"""One snapshot of a client's daemon session: what one `DaemonLink.call` works in.

Why this file exists: namespace ids, block ids and leases mean something only in the
session and arena generation they came from. `DaemonLink.call` (client/daemon_link.py)
hands its body one `Snapshot`, so that nothing read from it goes stale after a reconnect;
the chunk-chain operations (client/chain/) send their requests through it.
"""

import dataclasses
from typing import Protocol

from lmcached.shm.arena import Arena
from lmcached.wire.protocol import Acquire, BlocksReply, Get, HelloReply


class SessionLink(Protocol):
    """What a snapshot sends its requests through: the `DaemonLink` that made it
    (client/daemon_link.py builds every snapshot, so this module names only the two
    methods it calls and does not import it back)."""

    def request(self, message, generation: int | None = None):
        """Send one request in session generation `generation` (`DaemonLink.request`)."""

    def release(self, leases: list[int], session_id: int) -> None:
        """RELEASE `leases` of session `session_id`, fire-and-forget (`DaemonLink.release`)."""

    def submit(self, messages: list, generation: int | None = None) -> None:
        """Send requests whose replies `collect` reads later (`DaemonLink.submit`)."""

    def collect(self, message_type: type):
        """The oldest submitted request's reply (`DaemonLink.collect`)."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One session's state, fixed for the duration of one `DaemonLink.call`.

    Namespace ids and block ids mean something only in the session and arena
    generation they came from; a snapshot keeps them together, so that nothing read from
    it goes stale after a reconnect. Its requests are refused (CacheUnavailable) once
    the link is on another generation.

    Attributes:
        link: the `DaemonLink` that made it; its requests go through it.
        hello: the session's HELLO reply (namespace ids, block size, generation).
        arena: the arena of that generation, mapped.
        leases: leases taken through `acquire` in this snapshot (released by
            `DaemonLink.call` if the call fails).
        tiers: the device tiers of that generation this session mapped, by tier id
            (block references `block_ref(tier, block)` of these tiers are readable here).
        home_tier: the tier id of the link's first device, 0 (the host arena) when
            none is mapped: where ALLOC asks for new chunks to go.
    """

    link: SessionLink
    hello: HelloReply
    arena: Arena
    leases: list[int] = dataclasses.field(default_factory=list)
    tiers: dict = dataclasses.field(default_factory=dict)
    home_tier: int = 0

    @property
    def generation(self) -> int:
        """The arena generation of this session."""
        return self.hello.generation

    @property
    def session_id(self) -> int:
        """The daemon's id of this session (leases belong to it)."""
        return self.hello.session_id

    @property
    def namespaces(self) -> list[int]:
        """Namespace id of each layout of the link, in order."""
        return self.hello.namespaces

    @property
    def ns(self) -> int:
        """The namespace of the link's first (usually only) layout."""
        return self.hello.namespaces[0]

    @property
    def block_bytes(self) -> int:
        """The daemon's block size, bytes."""
        return self.hello.block_bytes

    def request(self, message):
        """Send one request in this snapshot's generation (see `DaemonLink.request`)."""
        return self.link.request(message, self.generation)

    def acquire(self, hashes: bytes, parent: bytes = b"", tenant: bytes = b"") -> BlocksReply:
        """ACQUIRE the prefix of `hashes` READY in every namespace of the link, recording
        its lease in `leases`.

        Args:
            hashes: the chunks' prefix hashes, 16 bytes each.
            parent: the hash of the chunk before `hashes[0]` (b"": ROOT_HASH).
            tenant: the request's tenant fingerprint (`hashing.tenant_fingerprint`;
                b"": unsalted), by which the daemon counts hits per tenant.

        Raises:
            CacheUnavailable, DaemonError: as `DaemonLink.request`.
        """
        return self._pin(Acquire(self.namespaces, hashes, parent, bool(tenant), tenant))

    def release(self) -> None:
        """RELEASE the leases taken so far in this snapshot (fire-and-forget), and forget
        them."""
        leases = list(self.leases)
        self.leases.clear()
        self.link.release(leases, self.session_id)

    def submit(self, *messages) -> None:
        """Send requests (of one type, in one write) in this snapshot's generation without
        waiting for their replies (pipelining): `collect` reads the replies in order. A
        body that submits collects every reply before it returns (`DaemonLink.call` ends
        a session left out of step).

        Raises:
            CacheUnavailable, DaemonError: as `DaemonLink.request`.
        """
        self.link.submit(list(messages), self.generation)

    def collect(self, message_type: type):
        """The reply of the oldest submitted request (of `message_type`); an ACQUIRE's
        lease is recorded in `leases`, as `acquire` does.

        Raises:
            CacheUnavailable, DaemonError: as `DaemonLink.request`.
        """
        reply = self.link.collect(message_type)
        if message_type is Acquire and reply.lease:
            self.leases.append(reply.lease)
        return reply

    def acquire_value(self, key: str) -> BlocksReply:
        """GET the value under string `key` in the first namespace, recording its lease.

        Raises:
            CacheUnavailable, DaemonError: as `DaemonLink.request`.
        """
        return self._pin(Get(self.ns, key))

    def _pin(self, message) -> BlocksReply:
        """Send a pinning request (ACQUIRE, GET) and record the lease it answers."""
        reply = self.request(message)
        if reply.lease:
            self.leases.append(reply.lease)
        return reply
