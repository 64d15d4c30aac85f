"""Frame-sized chunk-chain requests: how many chunks one request carries, the ACQUIRE of
a chain in every namespace of a session, and the COMMIT (or ABORT) of filled blocks.

Part of the client's chunk-chain core (client/chain/__init__.py).
"""

from typing import Callable

from lmcached.client.daemon_link import CacheUnavailable, DaemonLink
from lmcached.client.hashing import tenant_fingerprint
from lmcached.client.layout import KVLayout
from lmcached.client.snapshot import Snapshot
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import (
    HASH_BYTES,
    MAX_CHUNKS_PER_REQUEST,
    MAX_FRAME_BYTES,
    Abort,
    Commit,
)
from lmcached.wire.connection import DaemonError
from lmcached.wire.record_format import ROOT_HASH

logger = init_logger(__name__)

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

    Bounded so that neither the request (ALLOC: a hash, a parent hash and a record size
    per chunk) nor its reply (ACQUIRE: the block ids, span length and record size of
    each chunk in each namespace), nor the COMMIT of the blocks an ALLOC returns,
    exceeds MAX_FRAME_BYTES, and so that the daemon's MAX_CHUNKS_PER_REQUEST (over all
    namespaces) holds. Callers split longer requests.

    Args:
        layout: the chunks' layout (their record size).
        block_bytes: the daemon's block size (HELLO), bytes.
        num_namespaces: namespaces one ACQUIRE / LOOKUP lists (tensor parallel ranks).

    Returns:
        A chunk count >= 1.
    """
    blocks_per_chunk = -(-layout.record_bytes(layout.chunk_size) // block_bytes)
    request_bytes = 2 * HASH_BYTES + _INT_BYTES  # ALLOC: hash, parent hash, record size
    reply_bytes = num_namespaces * (_INT_BYTES + _BLOCK_ID_BYTES * (blocks_per_chunk + 1))
    fit = (MAX_FRAME_BYTES - _FRAME_OVERHEAD_BYTES) // max(request_bytes, reply_bytes)
    return max(1, min(MAX_CHUNKS_PER_REQUEST // num_namespaces, fit))


def wire_parent(hashes: list[bytes], pos: int, parent: bytes) -> bytes:
    """The `parent` field of a LOOKUP / ACQUIRE of `hashes[pos:]`: the hash of the chunk
    before it (`parent` is the one before `hashes[0]`), b"" for ROOT_HASH (the field's
    default: an unsalted chain from its start sends nothing more than before)."""
    before = hashes[pos - 1] if pos else parent
    return b"" if before == ROOT_HASH else before


def acquire_chain(snapshot: Snapshot, hashes: list[bytes], layout: KVLayout,
                  parent: bytes = ROOT_HASH, salt: str | None = None) -> list[list[list[int]]]:
    """ACQUIRE the longest prefix of the chunk chain `hashes` READY in every namespace
    of the link, in as few requests as frames allow (`chunks_per_request`), recording
    the leases.

    Args:
        snapshot: the session's snapshot.
        hashes: the chunks' prefix hashes, in chain order.
        layout: the chunks' layout (how many fit a request).
        parent: the hash of the chunk before `hashes[0]`: ROOT_HASH at the start of an
            unsalted chain, `root_hash(salt)` at the start of a salted one. The daemon's
            L2 tier verifies fetched chunks from it.
        salt: the request's cache salt (None: unsalted); its fingerprint
            (`tenant_fingerprint`) goes with each ACQUIRE, so that the daemon counts
            the chain's hits and misses under its tenant.

    Returns:
        Per namespace (in the link's order), the block ids of each pinned chunk; every
        namespace gets the same number of chunks.

    Raises:
        CacheUnavailable, DaemonError: as `DaemonLink.request`.
    """
    num_namespaces = len(snapshot.namespaces)
    per_request = chunks_per_request(layout, snapshot.block_bytes, num_namespaces)
    chains: list[list[list[int]]] = [[] for _ in range(num_namespaces)]
    tenant = tenant_fingerprint(salt)
    for pos in range(0, len(hashes), per_request):
        batch = hashes[pos : pos + per_request]
        spans = snapshot.acquire(b"".join(batch), wire_parent(hashes, pos, parent),
                                 tenant).spans()
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


def check_verify(verify: str) -> None:
    """Raise ValueError unless `verify` is "tokens" or "checksum"."""
    if verify not in ("tokens", "checksum"):
        raise ValueError(f'verify must be "tokens" or "checksum", got {verify!r}')
