"""The SUBSCRIBE and EVENTS request handlers: a session's subscription to the daemon's
KV event feed (lmcached/daemon/events.py) and the pages it reads from it.

Why this file exists: the feed (events.py) is the ring, the subscribers' cursors and the
snapshots, told of every chunk by the pool and the tiers; these are the requests a
client sends to read it, in the command table (commands.py) beside the other handlers:
which namespaces a session may subscribe to, the token ids of a page's chunks (from the
arena, or from a spill tier for a snapshot's disk chunks; to a peer that can read the
arena only), and each page's price.
"""

import os

from lmcached.daemon.events import (
    DISK_READS_PER_UNIT,
    EVENTS_PER_UNIT,
    EVENTS_SENT_PER_UNIT,
    MAX_SNAPSHOTS_PER_PEER,
    MEDIUM_ARENA,
    MEDIUM_DISK,
    STORED,
    TOKEN_BYTES_PER_UNIT,
    EventFeed,
    read_token_ids,
)
from lmcached.daemon.keys import CHUNK_TAG
from lmcached.daemon.peers import can_read_arena
from lmcached.daemon.replies import RequestError
from lmcached.daemon.spill.envelope import namespace_fingerprint
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import ChunkEvent, Events, EventsReply, Subscribe, SubscribeReply

logger = init_logger(__name__)


def _fingerprints(service) -> dict[int, bytes]:
    """Namespace id -> its fingerprint, of every namespace alive. Cached per namespace id
    with the layout it was computed for: ids are given again once free, so the cache
    holds at most one entry per id the registry ever gave (MAX_NAMESPACES), however many
    layouts sessions register and leave."""
    cache = service.events.fingerprints
    out = {}
    for ns, layout in service.ns_registry.layouts.items():
        entry = cache.get(ns)
        if entry is None or entry[0] is not layout:
            entry = cache[ns] = (layout, namespace_fingerprint(layout))
        out[ns] = entry[1]
    return out


def subscribed_namespaces(session, namespaces: list[int]) -> list[int]:
    """The namespaces a SUBSCRIBE of `namespaces` (empty: every one) gets: any for the
    daemon's uid and root; for another peer (a member of --allow-group), only those its
    own HELLO registered (empty: all of those), as INFO `tenants` shows such a peer its
    own rows only: one user's engines do not watch another user's models.

    Raises:
        RequestError: `forbidden`, another peer asked for a namespace it did not
            register, or for every namespace without a HELLO.
    """
    if session.uid in (0, os.geteuid()):
        return namespaces
    own = session.namespaces
    wanted = namespaces or own
    outside = sorted(set(wanted) - set(own))
    if outside or not wanted:
        raise RequestError(
            "forbidden", f"SUBSCRIBE to namespace(s) {outside or 'all'}: a client outside "
            "the daemon's user (uid %d) and root sees the events of the namespaces its own "
            "HELLO registered only (%s); HELLO with the layout first, or run as the "
            "daemon's user" % (os.geteuid(), own or "none"))
    return list(wanted)


def subscribe(service, session, req: Subscribe) -> SubscribeReply:
    """SUBSCRIBE: (re)subscribe the session to the feed, for `req.namespaces`
    (`subscribed_namespaces`); priced by the snapshot's keys copied (none when the
    arena's index did not change since the last snapshot: `EventFeed.arena_keys`).
    A peer that cannot read the arena (peers.py `can_read_arena`: a member of
    --allow-group the segment's mode leaves out) gets its events without token ids,
    which only the arena holds; SubscribeReply has no field to say so: it is logged,
    at info, at the session's first SUBSCRIBE.

    Raises:
        RequestError: as `subscribed_namespaces`; `bad_namespace`; `busy`, a snapshot
            asked for while MAX_SNAPSHOTS_PER_PEER others of the same uid are paged.
    """
    fps = _fingerprints(service)
    unknown = [ns for ns in req.namespaces if ns not in fps]
    if unknown:
        raise RequestError("bad_namespace", f"SUBSCRIBE to namespace(s) {unknown}, which "
                           "this daemon does not have (see `lmcached info clients`)")
    namespaces = subscribed_namespaces(session, req.namespaces)
    feed = service.events
    snapshot = disk_snapshot = None
    copied = 0
    if req.snapshot and service.pool is not None:
        held = feed.snapshots_of(session.uid, session.session_id)
        if held >= MAX_SNAPSHOTS_PER_PEER:
            raise RequestError(
                "busy", f"SUBSCRIBE with a snapshot: uid {session.uid} has {held} snapshots "
                f"being paged by other sessions, the limit (MAX_SNAPSHOTS_PER_PEER = "
                f"{MAX_SNAPSHOTS_PER_PEER}); page them to their end with EVENTS or close "
                "those sessions, retry later, or SUBSCRIBE without a snapshot")
        snapshot, fresh = feed.arena_keys(service.pool.cached)
        copied = len(snapshot) if fresh else 0
        disk_snapshot = [key for tier in service.spill_tiers  # filtered as it is paged
                         for key in tier.snapshot_keys()] or None
        copied += len(disk_snapshot or ())
    token_ids = can_read_arena(session.uid, session.gid, service.arena)
    if not token_ids and session.session_id not in feed.subscribers:
        logger.info("session %d (pid %d uid %d gid %d) cannot read the arena's segment "
                    "(--shm-mode): its events carry no token ids", session.session_id,
                    session.pid, session.uid, session.gid)
    cursor = feed.subscribe(session.session_id, namespaces,
                            [fps[ns] for ns in namespaces if ns in fps], req.cursor, snapshot,
                            disk_snapshot, session.uid, token_ids)
    service.work_units = 1 + copied // EVENTS_PER_UNIT
    return SubscribeReply(cursor, service.arena.generation, feed.capacity)


def _page_price(feed: EventFeed, num_events: int) -> int:
    """What the last EVENTS page costs in the per-pass budget: the ring slots or
    snapshot keys it examined, the events it sent and their token ids, its reads from
    disk (EVENTS_PER_UNIT, EVENTS_SENT_PER_UNIT, TOKEN_BYTES_PER_UNIT,
    DISK_READS_PER_UNIT)."""
    return (1 + feed.examined // EVENTS_PER_UNIT + num_events // EVENTS_SENT_PER_UNIT
            + feed.sent_token_bytes // TOKEN_BYTES_PER_UNIT
            + feed.disk_reads // DISK_READS_PER_UNIT)


def events(service, session, req: Events) -> EventsReply:
    """EVENTS: a page of the session's subscribed events from `req.cursor` on."""
    feed = service.events
    sub = feed.subscribers.get(session.session_id)
    if sub is None:
        raise RequestError("no_subscription", "EVENTS before SUBSCRIBE: send SUBSCRIBE "
                           "first (a new connection, or a restarted daemon, needs it again)")
    fps = _fingerprints(service)
    ns_of_fp = {fp: ns for ns, fp in fps.items()}
    pool, arena, tiers = service.pool, service.arena, service.spill_tiers

    def holder(key):
        """(the first spill tier holding `key`, its parent), or None."""
        for tier in tiers:
            parent = tier.chunk_parent(key)
            if parent is not None:
                return tier, parent
        return None

    def resolve(event, with_tokens, sub):
        seq, kind, medium, key, parent, block_id = event
        if medium == MEDIUM_ARENA:
            ns = int.from_bytes(key[1:5], "little")
            if sub.namespaces and ns not in sub.namespaces:
                return None
            chunk_hash = key[5:]
            fp = fps.get(ns, b"")
        else:
            fp, chunk_hash = key
            if sub.fingerprints and fp not in sub.fingerprints:
                return None
            ns = ns_of_fp.get(fp, 0)
        tokens = b""
        if with_tokens and sub.token_ids and kind == STORED and pool is not None:
            if medium == MEDIUM_DISK:  # still in the arena: read it there
                span = pool.cached.get(CHUNK_TAG + ns.to_bytes(4, "little") + chunk_hash)
                block_id = span[0].block_id if span is not None else -1
            if block_id >= 0:
                tokens = read_token_ids(arena, block_id, chunk_hash)
            elif seq == 0 and medium == MEDIUM_DISK:  # a snapshot's chunk not in the arena
                held = holder(key)
                tokens = (held[0].token_ids(key) or b"") if held is not None else b""
        return ChunkEvent(seq, kind, medium, ns, fp, chunk_hash, parent, tokens)

    if sub.snapshot is not None or sub.disk_snapshot is not None:
        cached, parents = pool.cached, pool.ledger.parents

        def arena_entry(key):
            span = cached.get(key)
            return None if span is None else (span[0].block_id, parents.get(key, b""))

        def disk_entry(key):
            held = holder(key)
            if held is None:
                return None
            ns = ns_of_fp.get(key[0])
            in_arena = ns is not None and CHUNK_TAG + ns.to_bytes(4, "little") + key[1] in cached
            return held[1], not in_arena

        out = feed.read_snapshot(sub, req.max_events, arena_entry, disk_entry, resolve)
        service.work_units = _page_price(feed, len(out))
        return EventsReply(out, sub.cursor, 0, sub.snapshot_left)
    out, cursor, lost = feed.read(sub, req.cursor, req.max_events, req.token_ids, resolve)
    service.work_units = _page_price(feed, len(out))
    return EventsReply(out, cursor, lost)
