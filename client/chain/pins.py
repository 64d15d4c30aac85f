"""Pins: the leases of one session, valid while it is open; a pinned, checked run of
chunk records (`PinnedChunks`) that readers serve only while its pins hold.

Part of the client's chunk-chain core (client/chain/__init__.py).
"""

import dataclasses

import numpy as np

from lmcached.client.chain.frames import chunk_ranges
from lmcached.client.daemon_link import DaemonLink
from lmcached.client.records import RecordIO
from lmcached.client.snapshot import Snapshot


@dataclasses.dataclass
class Pins:
    """The leases one `DaemonLink.call` took: they pin their blocks only while the
    session that took them is the link's open one.

    A reconnect (after a timeout, a restart, a closed engine) or the daemon closing the
    connection (`--idle-timeout`, a dropped client) releases them all, and their blocks
    may then hold another chunk: `hold()` says whether they still pin (no request sent).

    Attributes:
        link: the link whose session took them.
        session_id: that daemon session.
        generation: the arena generation of that session.
        leases: the daemon leases.
        released: `release()` was called.
    """

    link: DaemonLink
    session_id: int
    generation: int
    leases: list[int]
    released: bool = False

    @classmethod
    def of(cls, snapshot: Snapshot) -> "Pins":
        """The leases taken so far in `snapshot` (`Snapshot.acquire`)."""
        return cls(snapshot.link, snapshot.session_id, snapshot.generation,
                   list(snapshot.leases))

    def hold(self) -> bool:
        """Whether the leases still pin their blocks: not released, and their session is
        the link's open one (`DaemonLink.holds`)."""
        return not self.released and self.link.holds(self.session_id, self.generation)

    def release(self) -> None:
        """RELEASE the leases (fire-and-forget; idempotent; never raises)."""
        release_all([self])


def release_all(pins: list[Pins]) -> None:
    """RELEASE every lease of `pins` not released yet: one frame per session, not waited
    for (leases of a session that ended are not sent). Never raises."""
    by_session: dict[tuple[int, int], list[Pins]] = {}
    for pin in pins:
        if not pin.released:
            pin.released = True
            by_session.setdefault((id(pin.link), pin.session_id), []).append(pin)
    for session_pins in by_session.values():
        first = session_pins[0]
        first.link.release([lease for pin in session_pins for lease in pin.leases],
                           first.session_id)


@dataclasses.dataclass
class PinnedChunks:
    """A run of chunk records, pinned in the daemon and verified, from one request.

    Attributes:
        tokens: int64 `[num_tokens]` token ids of the request.
        first_chunk: index (in the request) of the first chunk of the run.
        spans: block ids of each verified chunk record, in chain order.
        hashes: the prefix hash of each verified chunk, aligned with `spans`.
        records: reader of the arena generation the blocks belong to.
        pins: the leases pinning the blocks (also those of chunks that failed
            verification, which are not in `spans`).
        salt: the request's cache salt (None: unsalted); a run serves only requests
            of the same tokens and salt.
        chunks: `[start, end)` token range (in the request) of each verified chunk
            (derived from the others).

    The pins hold only while their session does: `holds_pins()` says whether they still
    do, and readers ask it after reading (a reconnect or the daemon closing the
    connection releases them, and the blocks may then hold another prompt's KV).
    """

    tokens: np.ndarray
    first_chunk: int
    spans: list[list[int]]
    hashes: list[bytes]
    records: RecordIO
    pins: Pins
    salt: str | None = None
    chunks: list[tuple[int, int]] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.chunks = chunk_ranges(len(self.tokens), self.records.layout.chunk_size,
                                   self.first_chunk, len(self.spans))

    @property
    def session_id(self) -> int:
        """The daemon session that holds the pins."""
        return self.pins.session_id

    @property
    def block_ids(self) -> list[int]:
        """Every block id of the verified chunks, in order."""
        return [block_id for span in self.spans for block_id in span]

    def holds(self, tokens: np.ndarray, salt: str | None = None) -> bool:
        """Whether this run was pinned for exactly these tokens under this cache salt."""
        return (self.salt == salt and len(self.tokens) == len(tokens)
                and np.array_equal(self.tokens, tokens))

    def holds_pins(self) -> bool:
        """Whether the blocks still hold what was pinned (no request is sent).

        True while the pins hold (`Pins.hold`). Once the link is on a newer arena
        generation, the daemon that pinned the blocks is gone and hands none of them
        out again; the only writers left are those it gave a block before it stopped,
        and a writer writes a record's header first, so the records are checked
        (`records_match`). Otherwise (released, or the session ended but its daemon
        may still run: a timeout, `--idle-timeout`, or no session now) False.
        """
        pins = self.pins
        if pins.released:
            return False
        if pins.hold():
            return True
        current = pins.link.generation
        return current is not None and current != pins.generation and self.records_match()

    def records_match(self) -> bool:
        """Whether every verified record still holds exactly its chunk (header, hash
        and token ids: `RecordIO.verify_prefix`, about 1 us a chunk)."""
        return self.records.verify_prefix(self.spans, self.hashes, self.tokens, self.chunks,
                                          self.records.fingerprint) == len(self.spans)

    def truncate(self, num_chunks: int) -> None:
        """Keep only the first `num_chunks` verified chunks (the leases stay as they are)."""
        del self.spans[num_chunks:], self.chunks[num_chunks:], self.hashes[num_chunks:]

    def from_chunk(self, first_chunk: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """(spans, chunks) of the verified chunks from request chunk `first_chunk` on."""
        offset = max(first_chunk - self.first_chunk, 0)
        return self.spans[offset:], self.chunks[offset:]

    def release(self) -> None:
        """RELEASE the leases (fire-and-forget; idempotent; never raises)."""
        self.pins.release()
