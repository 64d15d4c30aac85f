"""The client's one chunk-chain core: request splitting, ACQUIRE of a chain, pinned runs,
and the COMMIT (or ABORT) of filled blocks.

Why this file exists: every client that reads or writes chunk chains (the engine, the
vLLM scheduler and worker, the adapters, CacheBlend's retriever) needs the same few
operations, with the same guarantees: requests no larger than one frame
(`chunks_per_request`), a pinned run served only while its pins hold (`PinnedChunks`),
and no half-written record ever readable (`fill_and_commit`). They are written here
once.
"""

import dataclasses
from typing import Callable

import numpy as np

from lmcached.client.daemon_link import CacheUnavailable, DaemonLink
from lmcached.client.layout import KVLayout
from lmcached.client.records import RecordIO
from lmcached.client.snapshot import Snapshot
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import (
    HASH_BYTES,
    MAX_CHUNKS_PER_REQUEST,
    MAX_FRAME_BYTES,
    Abort,
    Commit,
    DaemonError,
)

logger = init_logger(__name__)

# What a frame spends outside its per-chunk fields (tag, namespace id, list headers).
_FRAME_OVERHEAD_BYTES = 256
# Widest msgpack encodings: any int (a record size), and an int below 2**32 (a block id
# or a span length).
_INT_BYTES = 9
_BLOCK_ID_BYTES = 9  # a block reference (`block_ref`): a msgpack uint64


def chunks_per_request(layout: KVLayout, block_bytes: int, num_namespaces: int = 1) -> int:
    """Most chunks one LOOKUP / ACQUIRE / ALLOC of this layout may carry.

    Bounded so that neither the request (ALLOC: a hash and a record size per chunk) nor
    its reply (ACQUIRE: the block ids, span length and record size of each chunk in each
    namespace), nor the COMMIT of the blocks an ALLOC returns, exceeds MAX_FRAME_BYTES,
    and so that the daemon's MAX_CHUNKS_PER_REQUEST (over all namespaces) holds. Callers
    split longer requests.

    Args:
        layout: the chunks' layout (their record size).
        block_bytes: the daemon's block size (HELLO), bytes.
        num_namespaces: namespaces one ACQUIRE / LOOKUP lists (tensor parallel ranks).

    Returns:
        A chunk count >= 1.
    """
    blocks_per_chunk = -(-layout.record_bytes(layout.chunk_size) // block_bytes)
    request_bytes = HASH_BYTES + _INT_BYTES
    reply_bytes = num_namespaces * (_INT_BYTES + _BLOCK_ID_BYTES * (blocks_per_chunk + 1))
    fit = (MAX_FRAME_BYTES - _FRAME_OVERHEAD_BYTES) // max(request_bytes, reply_bytes)
    return max(1, min(MAX_CHUNKS_PER_REQUEST // num_namespaces, fit))


def acquire_chain(snapshot: Snapshot, hashes: list[bytes],
                  layout: KVLayout) -> list[list[list[int]]]:
    """ACQUIRE the longest prefix of the chunk chain `hashes` READY in every namespace
    of the link, in as few requests as frames allow (`chunks_per_request`), recording
    the leases.

    Returns:
        Per namespace (in the link's order), the block ids of each pinned chunk; every
        namespace gets the same number of chunks.

    Raises:
        CacheUnavailable, DaemonError: as `DaemonLink.request`.
    """
    num_namespaces = len(snapshot.namespaces)
    per_request = chunks_per_request(layout, snapshot.block_bytes, num_namespaces)
    chains: list[list[list[int]]] = [[] for _ in range(num_namespaces)]
    for pos in range(0, len(hashes), per_request):
        batch = hashes[pos : pos + per_request]
        spans = snapshot.acquire(b"".join(batch)).spans()
        found = len(spans) // num_namespaces  # namespace-major
        for i, chain in enumerate(chains):
            chain.extend(spans[i * found : (i + 1) * found])
        if found < len(batch):
            break
    return chains


def fill_and_commit(link: DaemonLink, block_ids: list[int], generation: int,
                    fill: Callable[[], None]) -> bool:
    """Fill blocks this session ALLOCated with `fill()`, then COMMIT them (WRITING ->
    READY, docs/architecture.md, "Block states"); ABORT them if `fill` raises, so no
    half-written record is ever readable.

    Args:
        link: the session's link (COMMIT and ABORT are sent on it).
        block_ids: the ALLOC reply's block ids (may be empty: nothing to commit).
        generation: the arena generation they were allocated in.
        fill: copies the records' bytes into the blocks.

    Returns:
        True once committed; False when the daemon is gone or refused the COMMIT
        (logged): the chunks are then simply not stored.

    Raises:
        Whatever `fill` raises, after the ABORT.
    """
    try:
        fill()
    except BaseException:
        if block_ids:
            try:
                link.request(Abort(block_ids), generation)
            except (CacheUnavailable, DaemonError):
                pass  # the session's end aborts them anyway
        raise
    if not block_ids:
        return True
    try:
        link.request(Commit(block_ids), generation)
    except CacheUnavailable:
        return False
    except DaemonError as exc:
        logger.warning("COMMIT refused, chunks not stored: %s", exc)
        return False
    return True


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
    chunks: list[tuple[int, int]] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        size, num_tokens = self.records.layout.chunk_size, len(self.tokens)
        first = self.first_chunk * size
        self.chunks = [(s, min(s + size, num_tokens))
                       for s in range(first, first + len(self.spans) * size, size)]

    @property
    def session_id(self) -> int:
        """The daemon session that holds the pins."""
        return self.pins.session_id

    @property
    def block_ids(self) -> list[int]:
        """Every block id of the verified chunks, in order."""
        return [block_id for span in self.spans for block_id in span]

    def holds(self, tokens: np.ndarray) -> bool:
        """Whether this run was pinned for exactly these tokens."""
        return len(self.tokens) == len(tokens) and np.array_equal(self.tokens, tokens)

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
