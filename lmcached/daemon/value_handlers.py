"""The daemon's value requests: LOOKUP, ACQUIRE, RELEASE, ALLOC, COMMIT, ABORT, PUT, GET,
DELETE, INVALIDATE (docs/architecture.md's request table).

Why this file exists: these handlers are what the daemon decides about the cache's
values (pins, WRITING blocks, commits, L2 fetches on a miss), apart from the admin
requests (`admin_handlers.py`) and the namespaces (`namespaces.py`). `ValueHandlers` is
a part of `CacheService`: its state is the service's.
"""

import time

from lmcached.wire.protocol import (
    ALLOCATED,
    EXISTS,
    HASH_BYTES,
    NOSPACE,
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

# Chunk formats a device tier may hold: records of one block whose KV a GPU reader uses
# in place (the key-value adapters' values and multi-block records stay on the host).
DEVICE_TIER_FORMATS = frozenset({"vllm", "huggingface"})


class ValueHandlers:
    """The value request handlers of `CacheService` (a part of it, no state of its own)."""

    def _fetch_rest(self, req: Lookup | Acquire, per_namespace: list[list[bytes]],
                    num_chunks: int) -> Deferred | None:
        """Start (or join) a fetch of the chunks after the arena's `num_chunks`, from the
        disk tier when it holds the next one, else from L2; a Deferred when the request
        is to wait for it (docs/l2.md). A new fetch pins the arena's part of the chain
        until it ends, so that installing the rest never evicts it."""
        if not self.spill_tiers or num_chunks * HASH_BYTES >= len(req.hashes):
            return None
        cached = self.pool.cached
        # The host arena's part of the prefix is pinned while the rest is installed; a
        # part on a device tier cannot be evicted by host allocations, and is not pinned.
        prefixes = [self._ns_prefix[ns] for ns in req.namespaces]

        def prefix_blocks():
            return [b for chunk_keys in per_namespace for key in chunk_keys[:num_chunks]
                    if key in cached for b in cached[key]]
        request = FetchRequest(self.pool, req.namespaces, prefixes, req.hashes, num_chunks,
                               req.parent or ROOT_HASH, prefix_blocks)
        for tier in self.spill_tiers:  # lookup order: arena, then each spill tier
            job = tier.start_fetch(request)
            if job is not None:
                if not tier.fetch_wait_s:
                    return None
                return Deferred(req, job, time.monotonic() + tier.fetch_wait_s, tier.stats())
        return None

    def _lookup(self, session: Session, req: Lookup,
                resumed: bool = False) -> LookupReply | Deferred:
        """LOOKUP: the length of the READY prefix in every namespace; a Deferred when the
        rest is to be fetched from the disk tier or L2 first. `resumed`: the answer to
        that Deferred (`CacheService.resume`): from the arena as it is now, counted once
        (when first asked), no fetch started."""
        per_namespace = self._chunk_keys_per_namespace(session, req.namespaces, req.hashes,
                                                       req.parent)
        tenant = self._tenant_row(session, req.tenant)
        self._require_pool()
        if not resumed:
            self.stats.lookups += 1
            tenant.lookups += 1
        num_chunks = len(per_namespace[0])
        readable = session.readable
        for chunk_keys in per_namespace:
            num_chunks = self.tiers.ready_prefix(chunk_keys[:num_chunks], readable)
            if num_chunks == 0:
                break
        if resumed:
            return LookupReply(num_chunks)
        return self._fetch_rest(req, per_namespace, num_chunks) or LookupReply(num_chunks)

    def _acquire(self, session: Session, req: Acquire,
                 resumed: bool = False) -> BlocksReply | Deferred:
        """ACQUIRE: pin the READY prefix in every namespace; a Deferred when the rest is
        to be fetched from the disk tier or L2 first. `resumed`: the answer to that
        Deferred (`CacheService.resume`): from the arena as it is now, no fetch started."""
        per_namespace = self._chunk_keys_per_namespace(session, req.namespaces, req.hashes,
                                                       req.parent)
        tenant = self._tenant_row(session, req.tenant, req.salted)
        pool = self._require_pool()
        tiers, readable = self.tiers, session.readable
        num_chunks = len(per_namespace[0])
        if len(per_namespace) > 1 or self.spill_tiers:
            # the prefix READY everywhere
            for chunk_keys in per_namespace:
                num_chunks = tiers.ready_prefix(chunk_keys[:num_chunks], readable)
            deferred = None if resumed else self._fetch_rest(req, per_namespace, num_chunks)
            if deferred is not None:
                return deferred
        num_chunks = self._pinnable_prefix(session, req.namespaces, per_namespace, num_chunks)
        spans = []
        for ns, chunk_keys in zip(req.namespaces, per_namespace):
            found = tiers.acquire_prefix(chunk_keys[:num_chunks], readable)
            spans.extend(found)
            pool.stats.misses += len(chunk_keys) - num_chunks
            self.stats.ns_hits[ns] += len(found)
            self.stats.ns_misses[ns] += len(chunk_keys) - len(found)
            tenant.hits += len(found)
            tenant.misses += len(chunk_keys) - len(found)
        return self._blocks_reply(self._lease(session, spans), spans)

    def _release(self, session: Session, req: Release) -> None:
        blocks = session.take_leases(req.leases)
        if blocks is None:
            raise RequestError("not_owner", f"RELEASE of leases this session does not hold "
                               f"({req.leases[:8]}{'...' if len(req.leases) > 8 else ''})")
        if blocks:
            self.tiers.free(blocks)
        return None

    def _alloc(self, session: Session, req: Alloc) -> AllocReply:
        keys = self._chunk_keys(session, req.ns, req.hashes)
        self._require_pool()
        if len(req.num_bytes) != len(keys) or any(n < 1 for n in req.num_bytes):
            raise RequestError("bad_request", "ALLOC needs one positive num_bytes per hash")
        if keys:
            self._check_value_sizes(session, req.ns, req.num_bytes)
        device_pool = self._device_pool(session, req) if req.tier else None
        tiers, readable = self.tiers, session.readable
        if readable == (0,):  # host only: the pool's own methods, no per-chunk dispatch
            find, touch, free = self.pool.cached.get, self.pool.touch, self.pool.free
        else:
            find, touch, free = (lambda key: tiers.find(key, readable)), tiers.touch, tiers.free
        status, block_ids, span_lengths = [], [], []
        held = []  # existing values pinned for the duration, so this ALLOC cannot evict them
        no_space = False
        parent = b""  # the chunk hash before `key` in this ALLOC's chain
        for key, num_bytes in zip(keys, req.num_bytes):
            span = find(key)
            if span is not None:
                touch(span)
                held.extend(span)
                status.append(EXISTS)
                parent = key[5:]
                continue
            blocks = None if no_space else self._allocate_value(
                session, key, num_bytes, False, device_pool, parent)
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
            self._make_room(device_pool, block_ids, span_lengths)
        return AllocReply(status, block_ids, span_lengths)

    def _make_room(self, device_pool: BlockPool, refs: list[int], span_lengths: list[int]) -> None:
        """After an ALLOC for a device tier: when some of its one-block chunks found no
        empty device block (and went to the host arena), demote enough for a store of
        this size, so that the tier keeps the newest chunks."""
        one_block, overflow, pos = 0, 0, 0
        for length in span_lengths:
            if length == 1:
                one_block += 1
                overflow += not tier_of(refs[pos])
            pos += length
        self.demoter.plan({device_pool.tier_id: one_block} if overflow else None)

    def _device_pool(self, session: Session, req: Alloc) -> BlockPool | None:
        """The pool of ALLOC's preferred device tier, or None when its chunks go to the
        host arena (a failed or unusable tier, or a format a device tier does not hold).

        Raises:
            RequestError: `bad_tier`, the tier is not one of the session's devices.
        """
        tier = self.tiers.device_tier(req.tier)
        if tier is None or tier.device not in session.devices:
            raise RequestError(
                "bad_tier", f"ALLOC for tier {req.tier}, which is not a device tier of this "
                f"session (HELLO devices {session.devices})"
            )
        layout = next(layout for layout, ns in self.namespaces.items() if ns == req.ns)
        if tier.failed or tier.pool is None or layout.fmt not in DEVICE_TIER_FORMATS:
            return None
        return tier.pool

    def _commit(self, session: Session, req: Commit) -> Ok:
        values = session.take_pending(req.block_ids)
        if values is None:
            if self._forget_expired(session, req.block_ids):
                raise RequestError(
                    "expired", f"COMMIT of blocks allocated more than "
                    f"{self.config.writing_timeout_s:g} s ago: the daemon aborted them "
                    "(--writing-timeout); these chunks were not stored"
                )
            raise RequestError("not_owner", "COMMIT of blocks this session did not allocate")
        if len(self.tiers.tiers) > 1 and any(v.tier_id for v in values):
            self._commit_device([v for v in values if v.tier_id])
            values = [v for v in values if not v.tier_id]
        pool = self.pool
        for replace in (False, True):
            group = [v for v in values if v.replace == replace]
            if not group:
                continue
            indexed = pool.commit_many([v.blocks for v in group], [v.key for v in group], replace)
            committed = []
            publish = pool.publish_stored
            for value, ok in zip(group, indexed):
                if ok:
                    publish(value.key, value.parent, value.blocks[0].block_id)
                    committed.extend(value.blocks)
                    self.stats.stored_bytes += sum(b.num_bytes for b in value.blocks)
                else:  # another session committed the same chunk first
                    pool.abort(value.blocks)
            self.stats.stores += sum(indexed)
            if self.spill_tiers and not replace:
                self._host_committed([(v.key, v.blocks) for v, ok in zip(group, indexed) if ok])
            if committed:
                pool.free(committed)  # the writer's reference; tail first
        return Ok()

    def _commit_device(self, values: list[PendingValue]) -> None:
        """COMMIT of chunks written to device tiers (first writer wins per tier)."""
        pools = self.tiers.pools
        for value in values:
            pool = pools[value.tier_id]
            if pool.commit_many([value.blocks], [value.key])[0]:
                pool.publish_stored(value.key, value.parent, value.blocks[0].block_id)
                self.stats.stores += 1
                self.stats.stored_bytes += sum(b.num_bytes for b in value.blocks)
                pool.free(value.blocks)
            else:
                pool.abort(value.blocks)
        self.demoter.plan()

    def _abort(self, session: Session, req: Abort) -> Ok:
        values = session.take_pending(req.block_ids)
        if values is None:
            if self._forget_expired(session, req.block_ids):
                return Ok()  # what the timeout left is aborted now: as asked
            raise RequestError("not_owner", "ABORT of blocks this session did not allocate")
        for value in values:
            self.tiers.abort(value.blocks)
        return Ok()

    def _forget_expired(self, session: Session, refs: list[int]) -> bool:
        """For a COMMIT or ABORT that names blocks `expire_writing` aborted: abort the
        values it names that are still WRITING (their writer gave them up with the
        rest), forget the expired refs, and return True. False (nothing changed) when it
        names no expired block and some block the session is not writing: `not_owner`."""
        expired = session.expired
        if not expired or not any(ref in expired for ref in refs):
            return False
        pending = [ref for ref in refs if ref in session.writing]
        for value in session.take_pending(pending) or ():
            self.tiers.abort(value.blocks)
        expired.difference_update(refs)
        return True

    def _put(self, session: Session, req: Put) -> AllocReply:
        key = self._string_key(session, req.ns, req.key)
        if req.num_bytes < 1:
            raise RequestError("bad_request", "PUT needs num_bytes >= 1")
        self._require_pool()
        if req.num_bytes > self._max_value_bytes():
            raise RequestError(
                "bad_request", f"PUT of a {req.num_bytes}-byte value: a value is at most "
                f"{self._max_value_bytes()} bytes (--max-session-share "
                f"{self.config.max_session_share:g}% of the arena)"
            )
        blocks = self._allocate_value(session, key, req.num_bytes, True)
        if blocks is None:
            return AllocReply([NOSPACE], [], [])
        return AllocReply([ALLOCATED], [b.ref for b in blocks], [len(blocks)])

    def _get(self, session: Session, req: Get) -> BlocksReply:
        key = self._string_key(session, req.ns, req.key)
        pool = self._require_pool()
        span = pool.cached.get(key)
        if span is not None and session.num_new_host_blocks(span) > self._session_room(session):
            pool.stats.misses += 1  # this session holds its share: a miss for it alone
            spans = []
        else:
            spans = pool.acquire_prefix([key])
        self.stats.ns_hits[req.ns] += len(spans)
        self.stats.ns_misses[req.ns] += 1 - len(spans)
        return self._blocks_reply(self._lease(session, spans), spans)

    def _invalidate(self, session: Session, req: Invalidate) -> None:
        """Drop the chunks a reader found corrupt, each only while the index still maps
        it to the block the reader read (counted: INFO invalidated_chunks). Any session
        may: any session can already overwrite those bytes. Pinned blocks keep their
        bytes for their readers (detached) until released. The disk tier forgets and
        erases its copy too (it was written from the same bytes), so that neither a
        later fetch nor a restart brings the chunk back."""
        chunk_keys = self._chunk_keys(session, req.ns, req.hashes)
        if len(req.block_ids) != len(chunk_keys):
            raise RequestError("bad_request", f"INVALIDATE of {len(chunk_keys)} hashes needs "
                               f"as many block ids, got {len(req.block_ids)}")
        self._require_pool()
        pools = self.tiers.pools
        for key, ref in zip(chunk_keys, req.block_ids):
            tier_id = tier_of(ref)
            pool = pools[tier_id] if 0 <= tier_id < len(pools) else None
            span = pool.cached.get(key) if pool is not None else None
            if span is not None and span[0].ref == ref and pool.evict(key):
                self.stats.invalidated += 1
                for tier in self.spill_tiers:
                    tier.evict(key)
        return None

    def _delete(self, session: Session, req: Delete) -> CountReply:
        key = self._string_key(session, req.ns, req.key)
        return CountReply(int(self._require_pool().evict(key)))
