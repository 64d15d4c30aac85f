"""Validation and room of the daemon's requests: keys, sizes, a session's share, leases.

Why this file exists: every value handler checks its namespace and hashes, and every
allocation or pin is bounded by the session's share of the host arena
(`--max-session-share`); those checks are written once here, as functions of the
request and of the daemon state they read (`CheckState`), which the handlers pass on.
"""

import math
from typing import TYPE_CHECKING, Protocol

from lmcached.daemon import keys
from lmcached.wire.protocol import (
    HASH_BYTES,
    MAX_CHUNKS_PER_REQUEST,
    TENANT_BYTES,
    BlocksReply,
    Layout,
    tier_of,
)
from lmcached.daemon.session import PendingValue, Session
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import KVCacheBlock
from lmcached.daemon.replies import RequestError
from lmcached.daemon.stats import MAX_TENANTS_PER_SESSION, TenantRow
from lmcached.shm.arena import HEADER_BYTES
from lmcached.wire.units import format_bytes

if TYPE_CHECKING:  # named for the CheckState protocol only (no import at run time)
    from lmcached.daemon.memory_tiers import TierSet
    from lmcached.daemon.server_config import ServerConfig
    from lmcached.daemon.stats import DaemonStats
    from lmcached.shm.arena import Arena


class NamespacePrefixes(Protocol):
    """What the checks and the value handlers read of the namespace registry
    (`namespaces.NamespaceRegistry`, which imports this module): the block-pool key
    prefix and the layout of each namespace id."""

    prefixes: dict[int, bytes]
    layouts: dict[int, Layout]


class CheckState(Protocol):
    """The daemon state the checks read and change: the `CacheService` (service.py;
    see it for each attribute)."""

    config: "ServerConfig"
    arena: "Arena"
    tiers: "TierSet"
    pool: BlockPool | None
    stats: "DaemonStats"
    ns_registry: NamespacePrefixes
    next_lease: int


def check_namespace(session: Session, ns: int) -> None:
    """Refuse a namespace that is not one of this session's HELLO layouts."""
    if ns not in session.namespaces:
        raise RequestError(
            "bad_namespace",
            f"namespace {ns} is not this session's (HELLO gave {session.namespaces})",
        )


def check_hashes(hashes: bytes, num_namespaces: int = 1) -> int:
    """The chunk count of a request's hashes, after validating their length."""
    if len(hashes) % HASH_BYTES:
        raise RequestError(
            "bad_request", f"hashes are {len(hashes)} bytes, not a multiple of {HASH_BYTES}"
        )
    num_chunks = len(hashes) // HASH_BYTES
    if num_chunks * max(num_namespaces, 1) > MAX_CHUNKS_PER_REQUEST:
        raise RequestError(
            "bad_request", f"more than {MAX_CHUNKS_PER_REQUEST} chunks (over all "
            "namespaces) in one request: split it"
        )
    return num_chunks


def tenant_row(state: CheckState, session: Session, tenant: bytes,
               salted: bool = False) -> TenantRow:
    """The counters (`TenantStats.row`) of a LOOKUP's or ACQUIRE's tenant
    fingerprint, after validating it (TENANT_BYTES, or empty: unsalted).

    A session is counted under at most MAX_TENANTS_PER_SESSION fingerprints (those it
    sent first, `Session.tenants`); its requests under any other count under
    "other", so that no one client fills the table's MAX_TENANTS rows. The daemon
    cannot tell a tenant's own fingerprint from a copy another client sends
    (docs/architecture.md, "Trust model": the counts are what clients claim)."""
    if len(tenant) not in (0, TENANT_BYTES):
        raise RequestError("bad_request", f"tenant is {len(tenant)} bytes: a tenant "
                           f"fingerprint is {TENANT_BYTES} bytes (the first of the "
                           "salted chain's root hash), or empty for an unsalted request")
    if tenant and tenant not in session.tenants:
        if len(session.tenants) >= MAX_TENANTS_PER_SESSION:
            return state.stats.tenants.other()
        session.tenants.add(tenant)
    return state.stats.tenants.row(tenant, salted)


def chunk_keys(state: CheckState, session: Session, ns: int, hashes: bytes) -> list[bytes]:
    """The block-pool keys of a request's chunk hashes, after validating them."""
    check_namespace(session, ns)
    check_hashes(hashes)
    return keys.chunk_keys(state.ns_registry.prefixes[ns], hashes)


def chunk_keys_per_namespace(state: CheckState, session: Session, namespaces: list[int],
                             hashes: bytes, parent: bytes = b"") -> list[list[bytes]]:
    """The block-pool keys of `hashes` in each listed namespace (LOOKUP, ACQUIRE),
    after validating them and the chain's `parent` hash (16 bytes, or empty)."""
    if len(parent) not in (0, HASH_BYTES):
        raise RequestError("bad_request", f"parent is {len(parent)} bytes: a chunk hash "
                           f"({HASH_BYTES} bytes), or empty for the chain's start")
    if not namespaces:
        raise RequestError("bad_request", "no namespace listed")
    if len(set(namespaces)) != len(namespaces):
        raise RequestError("bad_request", f"namespace listed twice in {namespaces}")
    for ns in namespaces:
        check_namespace(session, ns)
    check_hashes(hashes, len(namespaces))
    return [keys.chunk_keys(state.ns_registry.prefixes[ns], hashes) for ns in namespaces]


def string_key(session: Session, ns: int, key: str) -> bytes:
    """The block-pool key of a request's string key, after validating it."""
    check_namespace(session, ns)
    if not key:
        raise RequestError("bad_request", "empty key")
    return keys.string_key(ns, key)


def require_pool(state: CheckState) -> BlockPool:
    if state.pool is None:
        raise RequestError("no_layout", "no layout has attached yet: the arena has no blocks")
    return state.pool


def allocate_value(state: CheckState, session: Session, key: bytes, num_bytes: int, replace: bool,
                   device_pool: BlockPool | None = None, parent: bytes = b""):
    """Allocate WRITING blocks for one value of `num_bytes`: in `device_pool` when it
    has an empty block for a one-block value, else in the host arena (which may
    evict); None when nothing is evictable, or when the session would then hold
    more than its share of the host arena (`session_room`): nothing is evicted."""
    block_bytes = state.arena.block_bytes
    num_blocks = -(-num_bytes // block_bytes)
    blocks = None
    if device_pool is not None and num_blocks == 1:
        blocks = device_pool.allocate_empty(1)
    if blocks is None:
        if num_blocks > session_room(state, session):
            return None
        blocks = state.pool.allocate(num_blocks)
    if blocks is None:
        return None
    for block in blocks:
        block.num_bytes = block_bytes
    blocks[-1].num_bytes = num_bytes - (num_blocks - 1) * block_bytes
    session.add_pending(PendingValue(key, blocks, replace, session.last_request_at, parent))
    return blocks


def session_cap_blocks(state: CheckState) -> int:
    """Host arena blocks one session may hold, WRITING and pinned together:
    `--max-session-share` percent of them, at least one."""
    return max(1, int(state.pool.num_blocks * state.config.max_session_share / 100))


def session_room(state: CheckState, session: Session) -> int:
    """Host arena blocks `session` may still allocate or pin (its share, less what it
    holds), so that one session never keeps the rest of the arena from the others."""
    return session_cap_blocks(state) - session.num_host_blocks_held


def check_record_fits(state: CheckState, record_bytes: int) -> None:
    """Refuse (at HELLO) a layout whose full chunk record could never be stored: it
    needs more blocks than one session may hold (`session_cap_blocks`), or than the
    arena has.

    Args:
        record_bytes: the layout's full chunk record, bytes.

    Raises:
        RequestError: `too_large` (a permanent refusal for clients,
            protocol.PERMANENT_ERROR_CODES), naming the record, block, share and
            arena sizes and the options that make it fit.
    """
    block_bytes, num_blocks = state.arena.block_bytes, state.arena.num_blocks
    needed = -(-record_bytes // block_bytes)
    cap = session_cap_blocks(state)
    if needed <= cap:
        return
    share = state.config.max_session_share
    capacity_mib = -(-(math.ceil(needed * 100 / share) * block_bytes + HEADER_BYTES)
                     // (1 << 20))
    fixes = f"start the daemon with --capacity {capacity_mib}MiB or more"
    if needed <= num_blocks:
        fixes += f" or --max-session-share {math.ceil(needed * 100 / num_blocks)}"
    raise RequestError(
        "too_large", f"a chunk record of {record_bytes} bytes ({format_bytes(record_bytes)}) "
        f"needs {needed} blocks of {block_bytes} bytes, and one session may hold {cap} of "
        f"the arena's {num_blocks} (--max-session-share {share:g}% of "
        f"{format_bytes(num_blocks * block_bytes)}): {fixes}, or give the client a "
        "smaller chunk_size"
    )


def max_value_bytes(state: CheckState) -> int:
    """The largest value a PUT (or an ALLOC in a key-value namespace) may ask for:
    the blocks of one session's share."""
    return session_cap_blocks(state) * state.arena.block_bytes


def check_value_sizes(state: CheckState, session: Session, ns: int, num_bytes: list[int]) -> None:
    """Refuse an ALLOC's record sizes beyond the namespace's full chunk record (or, in
    a key-value namespace, beyond `max_value_bytes`), before anything is allocated
    or evicted.

    Raises:
        RequestError: `bad_request`, naming the size asked for and the limit.
    """
    limit = session.record_bytes.get(ns)
    largest = max(num_bytes)
    if limit is not None and largest > limit:
        raise RequestError(
            "bad_request", f"ALLOC of a {largest}-byte record in namespace {ns}, whose "
            f"layout's full chunk record is {limit} bytes: num_bytes is at most that"
        )
    if limit is None and largest > max_value_bytes(state):
        raise RequestError(
            "bad_request", f"ALLOC of a {largest}-byte value in key-value namespace "
            f"{ns}: a value is at most {max_value_bytes(state)} bytes "
            f"(--max-session-share {state.config.max_session_share:g}% of the arena)"
        )


def pinnable_prefix(state: CheckState, session: Session, namespaces: list[int],
                    per_namespace: list[list[bytes]], num_chunks: int) -> int:
    """How many of the first `num_chunks` chunks (in every namespace) `session` may
    pin without holding more than its share of the host arena (`session_room`);
    fewer where a chunk is not READY.

    A block the session already pins takes no more room. The chunks' spans are
    walked only when the room may be too small for them: a chunk takes at most the
    blocks of its namespace's full record (ALLOC refuses larger ones), a value of a
    key-value namespace at most a share.
    """
    room = session_room(state, session)
    block_bytes, cap = state.arena.block_bytes, session_cap_blocks(state)
    record_bytes = session.record_bytes
    most = sum(-(-record_bytes[ns] // block_bytes) if ns in record_bytes else cap
               for ns in namespaces)
    if num_chunks * most <= room:
        return num_chunks
    find, readable, pins = state.tiers.find, session.readable, session.pins
    taken: set[int] = set()  # host blocks the chunks so far would newly pin
    for i in range(num_chunks):
        for chunk_keys in per_namespace:
            span = find(chunk_keys[i], readable)
            if span is None:
                return i
            taken.update(b.ref for b in span if not tier_of(b.ref) and b.ref not in pins)
        if len(taken) > room:
            return i
    return num_chunks


def new_lease(state: CheckState, session: Session, spans: list[list[KVCacheBlock]]) -> int:
    """A new lease holding the pins of `spans` (0, and no lease, when empty)."""
    if not spans:
        return 0
    lease = state.next_lease
    state.next_lease += 1
    session.add_lease(lease, [block for span in spans for block in span])
    return lease


def blocks_reply(state: CheckState, lease: int, spans: list[list[KVCacheBlock]]) -> BlocksReply:
    """The reply to a pinning request; counts the bytes served."""
    if all(len(span) == 1 for span in spans):  # one block per value: the usual case
        num_bytes = [span[0].num_bytes for span in spans]
        state.stats.served_bytes += sum(num_bytes)
        return BlocksReply(lease, [span[0].ref for span in spans], [1] * len(spans),
                           num_bytes)
    block_ids, span_lengths, num_bytes = [], [], []
    for span in spans:
        block_ids.extend(b.ref for b in span)
        span_lengths.append(len(span))
        num_bytes.append(sum(b.num_bytes for b in span))
    state.stats.served_bytes += sum(num_bytes)
    return BlocksReply(lease, block_ids, span_lengths, num_bytes)
