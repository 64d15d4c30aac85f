"""The daemon's value requests: LOOKUP, ACQUIRE, RELEASE, ALLOC, COMMIT, ABORT, PUT, GET,
DELETE, INVALIDATE (docs/architecture.md's request table).

Why this file exists: these handlers are what the daemon decides about the cache's
values (pins, WRITING blocks, commits, L2 fetches on a miss), apart from the admin
requests (`admin_handlers.py`) and the namespaces (`namespaces.py`). Each handler is a
function `handler(state, session, request)` of the command table (`commands.py`) over
the daemon state it reads and changes (`ValueState`); the checks it shares with the
others are `request_checks.py`.
"""

import time
from typing import TYPE_CHECKING, Protocol

from lmcached.wire.protocol import (
    ALLOCATED,
    EXISTS,
    HASH_BYTES,
    NOSPACE,
    UNCHAINED_FORMATS,
    Abort,
    Acquire,
    Alloc,
    AllocReply,
    BlocksReply,
    Commit,
    CountReply,
    Delete,
    Get,
    Invalidate,
    Lookup,
    LookupReply,
    Ok,
    Put,
    Release,
    tier_of,
)
from lmcached.wire.record_format import ROOT_HASH
from lmcached.daemon.session import PendingValue, Session
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.replies import Deferred, RequestError
from lmcached.daemon.spill.tier import FetchRequest
from lmcached.daemon import request_checks as checks
from lmcached.daemon.request_checks import CheckState

if TYPE_CHECKING:  # named for the ValueState protocol only (no import at run time)
    from lmcached.daemon.demotion import Demoter
    from lmcached.daemon.events import EventFeed
    from lmcached.daemon.spill.tier import SpillTier
    from lmcached.wire.protocol import Layout

# Chunk formats a device tier may hold: records of one block whose KV a GPU reader uses
# in place (the key-value adapters' values and multi-block records stay on the host).
DEVICE_TIER_FORMATS = frozenset({"vllm", "huggingface"})


class ValueState(CheckState, Protocol):
    """The daemon state the value handlers read and change: the `CacheService`
    (service.py; see it for each attribute), the checks' state and these."""

    spill_tiers: "list[SpillTier]"
    demoter: "Demoter | None"
    events: "EventFeed"
    namespaces: "dict[Layout, int]"

    def host_committed(self, values: list) -> None:
        """Values just committed in the host arena: each spill tier's write-through."""


def _fetch_rest(state: ValueState, req: Lookup | Acquire, per_namespace: list[list[bytes]],
                num_chunks: int) -> Deferred | None:
    """Start (or join) a fetch of the chunks after the arena's `num_chunks`, from the
    disk tier when it holds the next one, else from L2; a Deferred when the request
    is to wait for it (docs/l2.md). A new fetch pins the arena's part of the chain
    until it ends, so that installing the rest never evicts it."""
    if not state.spill_tiers or num_chunks * HASH_BYTES >= len(req.hashes):
        return None
    cached = state.pool.cached
    # The host arena's part of the prefix is pinned while the rest is installed; a
    # part on a device tier cannot be evicted by host allocations, and is not pinned.
    prefixes = [state.ns_registry.prefixes[ns] for ns in req.namespaces]

    def prefix_blocks():
        return [b for chunk_keys in per_namespace for key in chunk_keys[:num_chunks]
                if key in cached for b in cached[key]]
    request = FetchRequest(state.pool, req.namespaces, prefixes, req.hashes, num_chunks,
                           req.parent or ROOT_HASH, prefix_blocks)
    for tier in state.spill_tiers:  # lookup order: arena, then each spill tier
        job = tier.start_fetch(request)
        if job is not None:
            if not tier.fetch_wait_s:
                return None
            return Deferred(req, job, time.monotonic() + tier.fetch_wait_s, tier.stats())
    return None


def lookup(state: ValueState, session: Session, req: Lookup,
           resumed: bool = False) -> LookupReply | Deferred:
    """LOOKUP: the length of the READY prefix in every namespace; a Deferred when the
    rest is to be fetched from the disk tier or L2 first. `resumed`: the answer to
    that Deferred (`CacheService.resume`): from the arena as it is now, counted once
    (when first asked), no fetch started."""
    per_namespace = checks.chunk_keys_per_namespace(state, session, req.namespaces,
                                                    req.hashes, req.parent)
    tenant = checks.tenant_row(state, session, req.tenant)
    checks.require_pool(state)
    if not resumed:
        state.stats.lookups += 1
        tenant.lookups += 1
    num_chunks = len(per_namespace[0])
    readable = session.readable
    for chunk_keys in per_namespace:
        num_chunks = state.tiers.ready_prefix(chunk_keys[:num_chunks], readable)
        if num_chunks == 0:
            break
    if resumed:
        return LookupReply(num_chunks)
    return _fetch_rest(state, req, per_namespace, num_chunks) or LookupReply(num_chunks)


def acquire(state: ValueState, session: Session, req: Acquire,
            resumed: bool = False) -> BlocksReply | Deferred:
    """ACQUIRE: pin the READY prefix in every namespace; a Deferred when the rest is
    to be fetched from the disk tier or L2 first. `resumed`: the answer to that
    Deferred (`CacheService.resume`): from the arena as it is now, no fetch started."""
    per_namespace = checks.chunk_keys_per_namespace(state, session, req.namespaces,
                                                    req.hashes, req.parent)
    tenant = checks.tenant_row(state, session, req.tenant, req.salted)
    pool = checks.require_pool(state)
    tiers, readable = state.tiers, session.readable
    num_chunks = len(per_namespace[0])
    if len(per_namespace) > 1 or state.spill_tiers:
        # the prefix READY everywhere
        for chunk_keys in per_namespace:
            num_chunks = tiers.ready_prefix(chunk_keys[:num_chunks], readable)
        deferred = None if resumed else _fetch_rest(state, req, per_namespace, num_chunks)
        if deferred is not None:
            return deferred
    num_chunks = checks.pinnable_prefix(state, session, req.namespaces, per_namespace,
                                        num_chunks)
    spans = []
    for ns, chunk_keys in zip(req.namespaces, per_namespace):
        found = tiers.acquire_prefix(chunk_keys[:num_chunks], readable)
        spans.extend(found)
        pool.stats.misses += len(chunk_keys) - num_chunks
        state.stats.ns_hits[ns] += len(found)
        state.stats.ns_misses[ns] += len(chunk_keys) - len(found)
        tenant.hits += len(found)
        tenant.misses += len(chunk_keys) - len(found)
    return checks.blocks_reply(state, checks.new_lease(state, session, spans), spans)


def release(state: ValueState, session: Session, req: Release) -> None:
    blocks = session.take_leases(req.leases)
    if blocks is None:
        raise RequestError("not_owner", f"RELEASE of leases this session does not hold "
                           f"({req.leases[:8]}{'...' if len(req.leases) > 8 else ''})")
    if blocks:
        state.tiers.free(blocks)
    return None


def alloc(state: ValueState, session: Session, req: Alloc) -> AllocReply:
    keys = checks.chunk_keys(state, session, req.ns, req.hashes)
    checks.require_pool(state)
    if len(req.num_bytes) != len(keys) or any(n < 1 for n in req.num_bytes):
        raise RequestError("bad_request", "ALLOC needs one positive num_bytes per hash")
    if len(req.parents) not in (0, HASH_BYTES * len(keys)):
        raise RequestError("bad_request", f"ALLOC parents is {len(req.parents)} bytes: "
                           f"one {HASH_BYTES}-byte parent hash per chunk "
                           f"({HASH_BYTES * len(keys)} bytes), or empty")
    if keys:
        checks.check_value_sizes(state, session, req.ns, req.num_bytes)
    device_pool = _device_pool(state, session, req) if req.tier else None
    tiers, readable = state.tiers, session.readable
    if readable == (0,):  # host only: the pool's own methods, no per-chunk dispatch
        find, touch, free = state.pool.cached.get, state.pool.touch, state.pool.free
    else:
        find, touch, free = (lambda key: tiers.find(key, readable)), tiers.touch, tiers.free
    status, block_ids, span_lengths = [], [], []
    held = []  # existing values pinned for the duration, so this ALLOC cannot evict them
    no_space = False
    # The chunk hash before `key` in its chain: the one `parents` names (ROOT_HASH for a
    # chain's first), or, when it names none, the chunk before `key` in this ALLOC; none
    # in a namespace whose chunks are no chain (UNCHAINED_FORMATS: SGLang's pages).
    parent, stated = b"", req.parents
    chained = state.ns_registry.layouts[req.ns].fmt not in UNCHAINED_FORMATS
    for i, (key, num_bytes) in enumerate(zip(keys, req.num_bytes)):
        if not chained:
            parent = b""
        elif stated:
            parent = stated[i * HASH_BYTES : (i + 1) * HASH_BYTES]
        span = find(key)
        if span is not None:
            touch(span)
            held.extend(span)
            status.append(EXISTS)
            parent = key[5:]
            continue
        blocks = None if no_space else checks.allocate_value(
            state, session, key, num_bytes, False, device_pool, parent)
        parent = key[5:]
        if blocks is None:
            no_space = True
            status.append(NOSPACE)
            continue
        status.append(ALLOCATED)
        block_ids.extend(b.ref for b in blocks)
        span_lengths.append(len(blocks))
    if held:
        free(held)
    if device_pool is not None:
        _make_room(state, device_pool, block_ids, span_lengths)
    return AllocReply(status, block_ids, span_lengths)


def _make_room(state: ValueState, device_pool: BlockPool, refs: list[int],
               span_lengths: list[int]) -> None:
    """After an ALLOC for a device tier: when some of its one-block chunks found no
    empty device block (and went to the host arena), demote enough for a store of
    this size, so that the tier keeps the newest chunks."""
    one_block, overflow, pos = 0, 0, 0
    for length in span_lengths:
        if length == 1:
            one_block += 1
            overflow += not tier_of(refs[pos])
        pos += length
    state.demoter.plan({device_pool.tier_id: one_block} if overflow else None)


def _device_pool(state: ValueState, session: Session, req: Alloc) -> BlockPool | None:
    """The pool of ALLOC's preferred device tier, or None when its chunks go to the
    host arena (a failed or unusable tier, or a format a device tier does not hold).

    Raises:
        RequestError: `bad_tier`, the tier is not one of the session's devices.
    """
    tier = state.tiers.device_tier(req.tier)
    if tier is None or tier.device not in session.devices:
        raise RequestError(
            "bad_tier", f"ALLOC for tier {req.tier}, which is not a device tier of this "
            f"session (HELLO devices {session.devices})"
        )
    layout = next(layout for layout, ns in state.namespaces.items() if ns == req.ns)
    if tier.failed or tier.pool is None or layout.fmt not in DEVICE_TIER_FORMATS:
        return None
    return tier.pool


def commit(state: ValueState, session: Session, req: Commit) -> Ok:
    values = session.take_pending(req.block_ids)
    if values is None:
        if _forget_expired(state, session, req.block_ids):
            raise RequestError(
                "expired", f"COMMIT of blocks allocated more than "
                f"{state.config.writing_timeout_s:g} s ago: the daemon aborted them "
                "(--writing-timeout); these chunks were not stored"
            )
        raise RequestError("not_owner", "COMMIT of blocks this session did not allocate")
    if len(state.tiers.tiers) > 1 and any(v.tier_id for v in values):
        _commit_device(state, [v for v in values if v.tier_id])
        values = [v for v in values if not v.tier_id]
    pool = state.pool
    for replace in (False, True):
        group = [v for v in values if v.replace == replace]
        if not group:
            continue
        indexed = pool.commit_many([v.blocks for v in group], [v.key for v in group], replace,
                                   parents=[v.parent for v in group])
        committed = []
        for value, ok in zip(group, indexed):
            if ok:
                committed.extend(value.blocks)
                state.stats.stored_bytes += sum(b.num_bytes for b in value.blocks)
            else:  # another session committed the same chunk first
                pool.abort(value.blocks)
        state.stats.stores += sum(indexed)
        if state.spill_tiers and not replace:
            state.host_committed([(v.key, v.blocks) for v, ok in zip(group, indexed) if ok])
        if committed:
            pool.free(committed)  # the writer's reference; tail first
    return Ok()


def _commit_device(state: ValueState, values: list[PendingValue]) -> None:
    """COMMIT of chunks written to device tiers (first writer wins per tier)."""
    pools = state.tiers.pools
    for value in values:
        pool = pools[value.tier_id]
        if pool.commit(value.blocks, value.key, parent=value.parent):
            state.stats.stores += 1
            state.stats.stored_bytes += sum(b.num_bytes for b in value.blocks)
            pool.free(value.blocks)
        else:
            pool.abort(value.blocks)
    state.demoter.plan()


def abort(state: ValueState, session: Session, req: Abort) -> Ok:
    values = session.take_pending(req.block_ids)
    if values is None:
        if _forget_expired(state, session, req.block_ids):
            return Ok()  # what the timeout left is aborted now: as asked
        raise RequestError("not_owner", "ABORT of blocks this session did not allocate")
    for value in values:
        state.tiers.abort(value.blocks)
    return Ok()


def _forget_expired(state: ValueState, session: Session, refs: list[int]) -> bool:
    """For a COMMIT or ABORT that names blocks `expire_writing` aborted: abort the
    values it names that are still WRITING (their writer gave them up with the
    rest), forget the expired refs, and return True. False (nothing changed) when it
    names no expired block and some block the session is not writing: `not_owner`."""
    expired = session.expired
    if not expired or not any(ref in expired for ref in refs):
        return False
    pending = [ref for ref in refs if ref in session.writing]
    for value in session.take_pending(pending) or ():
        state.tiers.abort(value.blocks)
    expired.difference_update(refs)
    return True


def put(state: ValueState, session: Session, req: Put) -> AllocReply:
    key = checks.string_key(session, req.ns, req.key)
    if req.num_bytes < 1:
        raise RequestError("bad_request", "PUT needs num_bytes >= 1")
    checks.require_pool(state)
    if req.num_bytes > checks.max_value_bytes(state):
        raise RequestError(
            "bad_request", f"PUT of a {req.num_bytes}-byte value: a value is at most "
            f"{checks.max_value_bytes(state)} bytes (--max-session-share "
            f"{state.config.max_session_share:g}% of the arena)"
        )
    blocks = checks.allocate_value(state, session, key, req.num_bytes, True)
    if blocks is None:
        return AllocReply([NOSPACE], [], [])
    return AllocReply([ALLOCATED], [b.ref for b in blocks], [len(blocks)])


def get(state: ValueState, session: Session, req: Get) -> BlocksReply:
    key = checks.string_key(session, req.ns, req.key)
    pool = checks.require_pool(state)
    span = pool.cached.get(key)
    if span is not None and session.num_new_host_blocks(span) > checks.session_room(state, session):
        pool.stats.misses += 1  # this session holds its share: a miss for it alone
        spans = []
    else:
        spans = pool.acquire_prefix([key])
    state.stats.ns_hits[req.ns] += len(spans)
    state.stats.ns_misses[req.ns] += 1 - len(spans)
    return checks.blocks_reply(state, checks.new_lease(state, session, spans), spans)


def invalidate(state: ValueState, session: Session, req: Invalidate) -> None:
    """Drop the chunks a reader found corrupt, each only while the index still maps
    it to the block the reader read (counted: INFO invalidated_chunks). Any session
    may: any session can already overwrite those bytes. Pinned blocks keep their
    bytes for their readers (detached) until released. The disk tier forgets and
    erases its copy too (it was written from the same bytes), so that neither a
    later fetch nor a restart brings the chunk back."""
    chunk_keys = checks.chunk_keys(state, session, req.ns, req.hashes)
    if len(req.block_ids) != len(chunk_keys):
        raise RequestError("bad_request", f"INVALIDATE of {len(chunk_keys)} hashes needs "
                           f"as many block ids, got {len(req.block_ids)}")
    checks.require_pool(state)
    pools = state.tiers.pools
    for key, ref in zip(chunk_keys, req.block_ids):
        tier_id = tier_of(ref)
        pool = pools[tier_id] if 0 <= tier_id < len(pools) else None
        span = pool.cached.get(key) if pool is not None else None
        if span is not None and span[0].ref == ref and pool.evict(key):
            state.stats.invalidated += 1
            for tier in state.spill_tiers:
                tier.evict(key)
    return None


def delete(state: ValueState, session: Session, req: Delete) -> CountReply:
    key = checks.string_key(session, req.ns, req.key)
    return CountReply(int(checks.require_pool(state).evict(key)))
