"""The client's one chunk-chain core: lookup, ACQUIRE with pins and record checks, and
store (ALLOC -> fill -> COMMIT, or ABORT), split into frame-sized requests.

Why this file exists: every client that reads or writes chunk chains (the engine, the
vLLM scheduler and worker, the adapters, CacheBlend's retriever) needs the same few
operations with the same guarantees, and copies written per caller had drifted apart
(one evicted its own head, one skipped checksums). They are written here once:

    chunks_per_request   the most chunks one LOOKUP / ACQUIRE / ALLOC may carry
    acquire_chain        ACQUIRE of a chain in every namespace of a session, split
    Pins, PinnedChunks   leases, valid while their session is open; a pinned, checked run
    fill_and_commit      fill ALLOCated blocks, then COMMIT; ABORT if the fill fails
    Chain                one layout's lookup, acquire + checks (token ids, checksums,
                         INVALIDATE of a corrupt record) and store (a split store keeps
                         earlier requests WRITING until the whole store is filled)
"""

import dataclasses
import functools
from typing import Callable

import numpy as np

from lmcached.client.daemon_link import CacheUnavailable, DaemonLink
from lmcached.client.kv_io import ChunkCopier
from lmcached.client.layout import KVLayout
from lmcached.client.records import RecordIO, TieredRecords
from lmcached.client.snapshot import Snapshot
from lmcached.client.tier_map import DeviceRecordIO
from lmcached.shm.arena import Arena
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import (
    HASH_BYTES,
    MAX_CHUNKS_PER_REQUEST,
    MAX_FRAME_BYTES,
    NOSPACE,
    Abort,
    Alloc,
    Commit,
    DaemonError,
    Lookup,
    tier_of,
)

logger = init_logger(__name__)

# Writes chunk i's record (header, token ids, KV) into the blocks of one span.
ChunkWrite = Callable[[RecordIO | TieredRecords, list[int], int], None]

# What a frame spends outside its per-chunk fields (tag, namespace id, list headers).
_FRAME_OVERHEAD_BYTES = 256
# Widest msgpack encodings: any int (a record size), and an int below 2**32 (a block id
# or a span length).
_INT_BYTES = 9
_BLOCK_ID_BYTES = 9  # a block reference (`block_ref`): a msgpack uint64


def chunk_ranges(num_tokens: int, chunk_size: int, first_chunk: int,
                 num_chunks: int | None = None) -> list[tuple[int, int]]:
    """`[start, end)` token ranges of a request's chunks from chunk `first_chunk` on
    (at most `num_chunks` of them); the last one may be partial."""
    first = first_chunk * chunk_size
    end = num_tokens if num_chunks is None else min(num_tokens, first + num_chunks * chunk_size)
    return [(s, min(s + chunk_size, num_tokens)) for s in range(first, end, chunk_size)]


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


class Chain:
    """One client's chunk chains of one layout, over its `DaemonLink`: lookup, ACQUIRE
    with record checks, and store (ALLOC -> fill -> COMMIT, or ABORT).

    The engine, the vLLM worker and (through the engine) CacheBlend's retriever each
    hold one; the vLLM scheduler, which reads no records, uses `acquire_chain` and `Pins`.

    Args:
        link: the session (its first namespace is this layout's).
        layout: the chunks' layout.
        verify: "tokens": readers check each record's header and token ids. "checksum":
            also its payload checksum, and stores seal one into every record
            (docs/architecture.md, "Trust model").
        copier: threads that write, seal and checksum records (default: one, inline).
        fingerprint: the identity written into and expected in each record header
            (default `layout.fingerprint`; the vLLM worker folds in its paged format).

    Attributes:
        num_stored_chunks: chunks written and committed.
        num_nospace_chunks: chunks not stored because nothing was evictable.
        num_verify_failures: records that did not hold the requested tokens (misses).
        num_checksum_failures: checks of runs in which a record held the requested
            tokens but no payload checksum, or a wrong one (verify="checksum" only).

    Raises:
        ValueError: verify is not "tokens" or "checksum".
    """

    def __init__(self, link: DaemonLink, layout: KVLayout, verify: str = "tokens",
                 copier: ChunkCopier | None = None, fingerprint: int | None = None) -> None:
        check_verify(verify)
        self.link = link
        self.layout = layout
        self.verify = verify
        self.copier = copier or ChunkCopier(1)
        self.fingerprint = layout.fingerprint if fingerprint is None else fingerprint
        self.num_stored_chunks = 0
        self.num_nospace_chunks = 0
        self.num_verify_failures = 0
        self.num_checksum_failures = 0
        self._records: RecordIO | None = None
        self._tiered: TieredRecords | None = None
        self._warned: set[str] = set()

    # ---------------------------------------------------------------- records
    def records(self, snapshot: Snapshot) -> RecordIO | TieredRecords:
        """Record reader/writer for the snapshot's arena and device tiers (re-made after a
        restart): a `TieredRecords` when the session maps device tiers."""
        self._records = RecordIO.for_arena(self._records, snapshot.arena, self.layout,
                                           self.fingerprint)
        if not snapshot.tiers:
            return self._records
        tiered = self._tiered
        if tiered is None or tiered.arena is not snapshot.arena or any(
                tiered.by_tier.get(t) is None or tiered.by_tier[t].arena is not m
                for t, m in snapshot.tiers.items()):
            by_tier = {t: RecordIO(m, self.layout, self.fingerprint) if isinstance(m, Arena)
                       else DeviceRecordIO(m, self.layout) for t, m in snapshot.tiers.items()}
            self._tiered = tiered = TieredRecords({0: self._records, **by_tier})
        return tiered

    def forget(self) -> None:
        """Drop the readers of the current arena (the link is closing)."""
        self._records = self._tiered = None

    # ------------------------------------------------------------------- read
    def lookup(self, hashes: list[bytes]) -> int:
        """How many leading chunks of `hashes` are READY (LOOKUP: no pins, no LRU change),
        in requests of `chunks_per_request`; 0 when the daemon is unavailable."""

        def count(snapshot: Snapshot) -> int:
            per_request = chunks_per_request(self.layout, snapshot.block_bytes)
            num_chunks = 0
            for pos in range(0, len(hashes), per_request):
                batch = hashes[pos : pos + per_request]
                found = snapshot.request(Lookup(snapshot.namespaces, b"".join(batch)))
                num_chunks += found.num_chunks
                if found.num_chunks < len(batch):
                    break
            return num_chunks

        return self.link.call("LOOKUP", count, 0)

    def acquire(self, tokens: np.ndarray, first_chunk: int,
                hashes: list[bytes]) -> PinnedChunks | None:
        """ACQUIRE the cached run of chunks from chunk `first_chunk`, and check their records.

        Args:
            tokens: int64 `[num_tokens]` token ids of the request.
            first_chunk: the run's first chunk in the request.
            hashes: the prefix hashes of the chunks from `first_chunk` on (non-empty).

        Returns:
            The pinned run (its `spans` and `chunks` cover the chunks that passed `check`;
            its pins hold all that was acquired), or None when the daemon is unavailable
            or refused (nothing stays pinned).
        """

        def acquire(snapshot: Snapshot) -> PinnedChunks:
            (spans,) = acquire_chain(snapshot, hashes, self.layout)
            return PinnedChunks(tokens, first_chunk, spans, hashes[: len(spans)],
                                self.records(snapshot), Pins.of(snapshot))

        run = self.link.call("ACQUIRE", acquire, None)
        if run is not None and run.spans:
            run.truncate(self.check(run.records, run.spans, run.hashes, tokens, run.chunks,
                                    run.session_id))
        return run

    def check(self, records: RecordIO | TieredRecords, spans: list[list[int]],
              hashes: list[bytes], tokens: np.ndarray, chunks: list[tuple[int, int]],
              session_id: int | None) -> int:
        """How many leading records hold exactly their chunk: header, hash and token ids
        and, with verify="checksum", a matching payload checksum (on the copy threads).

        A failure is counted and warned about once; the records after it are not
        served. With `session_id` (the session whose pins hold the blocks, still open)
        every failed record is INVALIDATEd, so that the next store replaces it; not a
        block of a tier this process has not mapped (others read it).

        Args:
            records: reader of the blocks' arena generation.
            spans / hashes / chunks: block ids, prefix hash and `[start, end)` token
                range of each record, aligned.
            tokens: int64 token ids of the request.
            session_id: see above; None: nothing is INVALIDATEd.
        """
        num_ok = records.verify_prefix(spans, hashes, tokens, chunks, records.fingerprint)
        if num_ok < len(spans):
            span = spans[num_ok]
            self.num_verify_failures += 1
            self._warn_once("tokens", "block %s does not hold the requested tokens (hash "
                            "collision, corrupted index, or a tier this process has not "
                            "mapped): treated as a miss; further mismatches are only "
                            "counted", span)
            if session_id is not None and records.maps(span):
                self.link.invalidate([hashes[num_ok]], [span[0]], session_id)
        if self.verify == "checksum" and num_ok:
            num_ok = self._check_checksums(records, spans[:num_ok], hashes, chunks, session_id)
        return num_ok

    def _check_checksums(self, records: RecordIO | TieredRecords, spans: list[list[int]],
                         hashes: list[bytes], chunks: list[tuple[int, int]],
                         session_id: int | None) -> int:
        """How many of the records `spans` lead with a matching payload checksum."""
        ok = [False] * len(spans)

        def check(i: int, span: list[int], num_tokens: int) -> None:
            ok[i] = records.checksum_ok(span, num_tokens)

        self.copier.run([functools.partial(check, i, span, end - start)
                         for i, (span, (start, end)) in enumerate(zip(spans, chunks))])
        if all(ok):
            return len(spans)
        num_ok = ok.index(False)
        self.num_checksum_failures += 1
        failed = [i for i, good in enumerate(ok) if not good]
        if session_id is not None:
            self.link.invalidate([hashes[i] for i in failed], [spans[i][0] for i in failed],
                                 session_id)
        self._warn_once("checksum", "block %s holds the requested tokens but no payload "
                        "checksum or a wrong one (written by a writer without "
                        "verify='checksum', or its KV bytes changed after COMMIT): treated "
                        "as a miss; further failures are only counted", spans[num_ok])
        return num_ok

    # ------------------------------------------------------------------ store
    def store(self, hashes: list[bytes], num_tokens: list[int], write: ChunkWrite,
              wait: Callable[[], None] = lambda: None) -> int:
        """Store the chunks of `hashes` that are not cached: ALLOC, fill, COMMIT.

        A store of more chunks than one request carries (`chunks_per_request`) is
        split, and the chunks after a request's are stored (recursively) while its
        blocks are still WRITING, which nothing evicts: a split store never evicts its
        own beginning to make room for its end, and gets NOSPACE where one request
        would (then the chunks after are not asked for). The end is committed first,
        so it is evicted first. With verify="checksum" every record is sealed.

        Args:
            hashes: the chunks' prefix hashes, in chain order.
            num_tokens: tokens of each chunk (its record size).
            write: `write(records, span, i)` writes chunk i's record into `span`.
            wait: waits for the copies `write` queued (e.g. from a GPU) to land.

        Returns:
            Chunks written and committed (0 when the daemon is unavailable or refused).

        Raises:
            Whatever `write` or `wait` raises, after the ABORT of the request's blocks.
        """
        return self._store_from(hashes, num_tokens, write, wait, 0)

    def _store_from(self, hashes: list[bytes], num_tokens: list[int], write: ChunkWrite,
                    wait: Callable[[], None], pos: int) -> int:
        """`store` of the chunks from `pos` on."""
        layout, link = self.layout, self.link

        def alloc(snapshot: Snapshot):
            end = min(len(hashes), pos + chunks_per_request(layout, snapshot.block_bytes))
            num_bytes = [layout.record_bytes(n) for n in num_tokens[pos:end]]
            reply = snapshot.request(Alloc(snapshot.ns, b"".join(hashes[pos:end]), num_bytes,
                                           snapshot.home_tier))
            return reply, end, snapshot.generation, self.records(snapshot)

        allocated = link.call("ALLOC", alloc, None)
        if allocated is None:
            return 0
        reply, end, generation, records = allocated
        if not records.maps(reply.block_ids):
            self._abort_unmapped(reply.block_ids, generation)
            return 0
        writes, seals = [], []
        for i, span in enumerate(reply.spans(), pos):
            if span is None:  # EXISTS or NOSPACE
                continue
            writes.append(functools.partial(write, records, span, i))
            if self.verify == "checksum":
                seals.append(functools.partial(records.seal, span, num_tokens[i]))
        written, num_nospace, num_later = len(writes), reply.status.count(NOSPACE), 0

        def fill() -> None:
            nonlocal num_later
            self.copier.run(writes)
            wait()  # device-to-host copies done before the seals and the COMMIT
            self.copier.run(seals)  # checksums of the final bytes, before COMMIT
            if end < len(hashes) and not num_nospace:
                num_later = self._store_from(hashes, num_tokens, write, wait, end)

        if not fill_and_commit(link, reply.block_ids, generation, fill):
            return num_later
        if num_nospace:
            num_nospace += len(hashes) - end  # never asked for: they would not fit either
            logger.debug("stored %d of %d new chunks: the arena is full of pinned data",
                         written, written + num_nospace)
        self.num_stored_chunks += written
        self.num_nospace_chunks += num_nospace
        return written + num_later

    def _abort_unmapped(self, block_ids: list[int], generation: int) -> None:
        """ABORT an ALLOC reply that holds a block of a tier this process has not mapped
        (the daemon places chunks only in the tier the session asked for, or in the host
        arena, so this indicates a bug): nothing is written, one warning."""
        self._warn_once("unmapped", "ALLOC answered blocks of tiers %s, but this process "
                        "maps tiers %s: chunks not stored; further cases are not logged",
                        sorted({tier_of(ref) for ref in block_ids}),
                        sorted({0, *self.link.tiers}))
        try:
            self.link.request(Abort(block_ids), generation)
        except (CacheUnavailable, DaemonError):
            pass  # the session's end aborts them anyway

    def _warn_once(self, kind: str, message: str, *args) -> None:
        """Log `message % args` the first time a failure of `kind` happens."""
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)


def check_verify(verify: str) -> None:
    """Raise ValueError unless `verify` is "tokens" or "checksum"."""
    if verify not in ("tokens", "checksum"):
        raise ValueError(f'verify must be "tokens" or "checksum", got {verify!r}')
