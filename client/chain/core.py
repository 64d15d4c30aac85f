"""`Chain`: one layout's lookup, ACQUIRE with record checks, and split store.

Part of the client's chunk-chain core (client/chain/__init__.py).
"""

import functools
from typing import Callable

import numpy as np

from lmcached.client.chain.frames import (
    acquire_chain,
    check_verify,
    chunks_per_request,
    fill_and_commit,
    wire_parent,
)
from lmcached.client.chain.pins import PinnedChunks, Pins
from lmcached.client.daemon_link import CacheUnavailable, DaemonLink
from lmcached.client.hashing import tenant_fingerprint
from lmcached.client.kv_io import ChunkCopier
from lmcached.client.layout import KVLayout
from lmcached.client.records import RecordIO
from lmcached.client.snapshot import Snapshot
from lmcached.client.tier_map import DeviceRecordIO
from lmcached.client.tiered_records import TieredRecords
from lmcached.shm.arena import Arena
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import NOSPACE, Abort, Alloc, Invalidate, Lookup, tier_of
from lmcached.wire.connection import DaemonError
from lmcached.wire.record_format import ROOT_HASH

logger = init_logger(__name__)

# Writes chunk i's record (header, token ids, KV) into the blocks of one span.
ChunkWrite = Callable[[RecordIO | TieredRecords, list[int], int], None]


def chain_parents(hashes: list[bytes], parent: bytes) -> list[bytes]:
    """Per chunk of the chain run `hashes`, the hash before it (`Chain.store`'s
    `parents`): `parent` (the hash before `hashes[0]`), then each chunk's predecessor."""
    return [parent, *hashes[:-1]] if hashes else []


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
                       else DeviceRecordIO(m, self.layout, self.fingerprint)
                       for t, m in snapshot.tiers.items()}
            self._tiered = tiered = TieredRecords({0: self._records, **by_tier})
        return tiered

    def forget(self) -> None:
        """Drop the readers of the current arena (the link is closing)."""
        self._records = self._tiered = None

    # ------------------------------------------------------------------- read
    def lookup(self, hashes: list[bytes], parent: bytes = ROOT_HASH,
               salt: str | None = None) -> int:
        """How many leading chunks of `hashes` are READY (LOOKUP: no pins, no LRU change),
        in requests of `chunks_per_request`; 0 when the daemon is unavailable.

        Args:
            hashes: the chunks' prefix hashes, in chain order.
            parent: the hash before `hashes[0]` (`acquire_chain`'s).
            salt: the request's cache salt (`acquire_chain`'s), counted by its tenant.
        """
        tenant = tenant_fingerprint(salt)

        def count(snapshot: Snapshot) -> int:
            per_request = chunks_per_request(self.layout, snapshot.block_bytes)
            num_chunks = 0
            for pos in range(0, len(hashes), per_request):
                batch = hashes[pos : pos + per_request]
                found = snapshot.request(Lookup(snapshot.namespaces, b"".join(batch),
                                                wire_parent(hashes, pos, parent), tenant))
                num_chunks += found.num_chunks
                if found.num_chunks < len(batch):
                    break
            return num_chunks

        return self.link.call("LOOKUP", count, 0)

    def acquire(self, tokens: np.ndarray, first_chunk: int, hashes: list[bytes],
                parent: bytes = ROOT_HASH, salt: str | None = None) -> PinnedChunks | None:
        """ACQUIRE the cached run of chunks from chunk `first_chunk`, and check their records.

        Args:
            tokens: int64 `[num_tokens]` token ids of the request.
            first_chunk: the run's first chunk in the request.
            hashes: the prefix hashes of the chunks from `first_chunk` on (non-empty).
            parent: the hash before `hashes[0]` (`acquire_chain`'s).
            salt: the request's cache salt (kept in the run; its hashes already hold it).

        Returns:
            The pinned run (its `spans` and `chunks` cover the chunks that passed `check`;
            its pins hold all that was acquired), or None when the daemon is unavailable
            or refused (nothing stays pinned).
        """

        def acquire(snapshot: Snapshot) -> PinnedChunks:
            (spans,) = acquire_chain(snapshot, hashes, self.layout, parent, salt)
            return PinnedChunks(tokens, first_chunk, spans, hashes[: len(spans)],
                                self.records(snapshot), Pins.of(snapshot), salt)

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
                self._invalidate([hashes[num_ok]], [span[0]], session_id)
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
            self._invalidate([hashes[i] for i in failed], [spans[i][0] for i in failed],
                             session_id)
        self._warn_once("checksum", "block %s holds the requested tokens but no payload "
                        "checksum or a wrong one (written by a writer without "
                        "verify='checksum', or its KV bytes changed after COMMIT): treated "
                        "as a miss; further failures are only counted", spans[num_ok])
        return num_ok

    def _invalidate(self, chunk_hashes: list[bytes], block_ids: list[int],
                    session_id: int) -> None:
        """Tell the daemon that the records of these chunks are corrupt (INVALIDATE in the
        link's first namespace, fire-and-forget: no reply is awaited), so that the next
        store replaces them. Never raises.

        Args:
            chunk_hashes: the chunks' hashes.
            block_ids: the first block of each chunk's value, as read.
            session_id: the session whose pins hold those blocks. Sent only while it is
                the current one, and before those pins are released: then the daemon
                sees the blocks as they were read (a block is never reused while
                pinned).
        """
        link = self.link
        if not block_ids:
            return
        with link.lock:
            reply = link.hello_reply
            if reply is None or reply.session_id != session_id:
                return
            try:
                link.request(Invalidate(reply.namespaces[0], b"".join(chunk_hashes),
                                        list(block_ids)), reply.generation)
            except (CacheUnavailable, DaemonError):
                pass  # a chunk not dropped is only read as a miss again

    # ------------------------------------------------------------------ store
    def store(self, hashes: list[bytes], num_tokens: list[int], write: ChunkWrite,
              wait: Callable[[], None] = lambda: None,
              parents: list[bytes] | None = None) -> int:
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
            wait: waits for the copies `write` queued from the source (e.g. a GPU) to
                land. Copies into a device tier are waited for here in any case
                (`records.synchronize()`, whatever the source's device), so no COMMIT
                publishes a header over KV still in flight.
            parents: per chunk, the hash of the chunk before it in its chain, ROOT_HASH
                for a chain's first chunk (salted or not), which the daemon publishes in
                its KV event feed (ALLOC's `parents`); None: each chunk's parent is the
                chunk before it in `hashes` (`chain_parents(hashes, ROOT_HASH)`).

        Returns:
            Chunks written and committed (0 when the daemon is unavailable or refused).

        Raises:
            ValueError: `parents` is not one 16-byte hash per chunk.
            Whatever `write` or `wait` raises, after the ABORT of the request's blocks.
        """
        if parents is None:
            parents = chain_parents(hashes, ROOT_HASH)
        if len(parents) != len(hashes) or any(len(p) != len(ROOT_HASH) for p in parents):
            raise ValueError(f"store needs one {len(ROOT_HASH)}-byte parent hash per chunk: "
                             f"{len(parents)} parents for {len(hashes)} chunks")
        return self._store_from(hashes, num_tokens, write, wait, 0, parents)

    def _store_from(self, hashes: list[bytes], num_tokens: list[int], write: ChunkWrite,
                    wait: Callable[[], None], pos: int, parents: list[bytes]) -> int:
        """`store` of the chunks from `pos` on."""
        layout, link = self.layout, self.link

        def alloc(snapshot: Snapshot):
            end = min(len(hashes), pos + chunks_per_request(layout, snapshot.block_bytes))
            num_bytes = [layout.record_bytes(n) for n in num_tokens[pos:end]]
            reply = snapshot.request(Alloc(snapshot.ns, b"".join(hashes[pos:end]), num_bytes,
                                           snapshot.home_tier, b"".join(parents[pos:end])))
            return reply, end, snapshot.generation, self.records(snapshot)

        allocated = link.call("ALLOC", alloc, None)
        if allocated is None:
            return 0
        reply, end, generation, records = allocated
        if not records.maps(reply.block_ids):
            self._abort_unmapped(reply.block_ids, generation)
            return 0
        writes, seals, into_device_tier = [], [], False
        for i, span in enumerate(reply.spans(), pos):
            if span is None:  # EXISTS or NOSPACE
                continue
            writes.append(functools.partial(write, records, span, i))
            into_device_tier = into_device_tier or tier_of(span[0]) != 0
            if self.verify == "checksum":
                seals.append(functools.partial(records.seal, span, num_tokens[i]))
        written, num_nospace, num_later = len(writes), reply.status.count(NOSPACE), 0

        def fill() -> None:
            nonlocal num_later
            self.copier.run(writes)
            wait()  # device-to-host copies done before the seals and the COMMIT
            if into_device_tier:  # copies into a device tier landed, whatever the source
                records.synchronize()
            self.copier.run(seals)  # checksums of the final bytes, before COMMIT
            if end < len(hashes) and not num_nospace:
                num_later = self._store_from(hashes, num_tokens, write, wait, end, parents)

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
