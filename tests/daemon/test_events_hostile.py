"""The chunk event feed against hostile clients (lmcached/daemon/events.py): a record
that states more token ids than a frame holds, a poll that examines a whole ring of
filtered events, a SUBSCRIBE storm with snapshots, sessions cycling through made-up
layouts, and a peer outside the daemon's uid
asking for another user's namespaces. Every reply fits a frame, every request is priced
by its work in the per-pass budget, a peer outside the daemon's uid sees only the
namespaces its own HELLO registered, and a peer that cannot read the arena's segment
gets no token ids."""

import logging
import os

import numpy as np
import pytest

from test_service import (  # noqa: F401 (make_service and service are fixtures)
    HEADER_BYTES,
    LAYOUT,
    error_code,
    greeted,
    layout,
    make_service,
    service,
    store,
)
from lmcached.daemon.events import (
    EVENTS_PER_UNIT,
    MAX_REPLY_EVENTS,
    MAX_REPLY_TOKEN_BYTES,
    RING_SCAN_FACTOR,
)
from lmcached.shm.janitor import SHM_DIR
from lmcached.wire.frames import encode_frame
from lmcached.wire.protocol import (
    ALLOCATED,
    MAX_FRAME_BYTES,
    Alloc,
    Commit,
    Events,
    EventsReply,
    Subscribe,
    SubscribeReply,
)
from lmcached.wire.record_format import (
    RECORD_HEADER_BYTES,
    ROOT_HASH,
    hash_block_tokens,
    write_header,
)

BIG_BLOCK = 2 << 20  # a block of a large model's chunk (tens of MB on a 70B model)
OTHER_UID = 54321  # no user on the machine: its groups are its primary gid only


def _store_record(service, session, ns: int, num_tokens: int, first: int) -> bytes:
    """ALLOC a chunk, write a record header stating `num_tokens` token ids, COMMIT;
    returns its token id bytes."""
    tokens = np.arange(first, first + num_tokens, dtype=np.int64)
    chunk_hash = hash_block_tokens(ROOT_HASH, tokens)
    record_bytes = RECORD_HEADER_BYTES + 8 * num_tokens
    alloc = service.handle(session, Alloc(ns, chunk_hash, [record_bytes]))
    assert alloc.status == [ALLOCATED], alloc
    arena = service.arena
    write_header(arena.numpy_view(arena.block_offset(alloc.block_ids[0]), record_bytes),
                 1, chunk_hash, tokens)
    service.handle(session, Commit(alloc.block_ids))
    return tokens.tobytes()


def test_token_ids_never_make_an_events_reply_exceed_a_frame(make_service):
    """A writer of the namespace states the token count of its record: one stating a
    block's worth (2 MiB) is sent without token ids, and records of 400 KiB of token ids
    each come one per reply; every reply encodes within MAX_FRAME_BYTES (a reply above it
    would be refused `too_large` on every poll, and no subscriber could read past it)."""
    service = make_service(HEADER_BYTES + 8 * BIG_BLOCK, BIG_BLOCK)
    big = layout(record_bytes=BIG_BLOCK)
    session = greeted(service, big)
    cursor = service.handle(session, Subscribe([1])).cursor
    huge = (BIG_BLOCK - RECORD_HEADER_BYTES) // 8
    _store_record(service, session, 1, huge, 0)
    large = [_store_record(service, session, 1, 50_000, 10**6 * (i + 1)) for i in range(3)]
    events = []
    while True:
        reply = service.handle(session, Events(cursor, 0, True))
        assert isinstance(reply, EventsReply), reply
        assert len(encode_frame(reply)) <= MAX_FRAME_BYTES
        if not reply.events:
            break
        assert sum(len(e.token_ids) for e in reply.events) <= MAX_REPLY_TOKEN_BYTES
        events += reply.events
        cursor = reply.cursor
    assert [e.token_ids for e in events] == [b""] + large


def test_a_snapshot_page_fits_a_frame_too(make_service):
    service = make_service(HEADER_BYTES + 8 * BIG_BLOCK, BIG_BLOCK)
    session = greeted(service, layout(record_bytes=BIG_BLOCK))
    large = [_store_record(service, session, 1, 50_000, 10**6 * (i + 1)) for i in range(3)]
    service.handle(session, Subscribe([1], 0, True))
    events = []
    for _ in range(5):
        reply = service.handle(session, Events(0, 0, True))
        assert len(encode_frame(reply)) <= MAX_FRAME_BYTES
        events += reply.events
        if not reply.snapshot_left:
            break
    assert [e.token_ids for e in events] == large


def test_a_poll_examines_a_bounded_number_of_filtered_events_and_is_priced_by_them(service):
    """A subscriber of a quiet namespace that polls from the ring's oldest event examines
    at most MAX_REPLY_EVENTS * RING_SCAN_FACTOR events per EVENTS (the cursor moves
    on with no events), and pays for them in the per-pass budget (`work_units`): a
    pipeline of such polls cannot hold the loop for the others."""
    writer = greeted(service, LAYOUT)
    feed = service.events
    for i in range(3 * MAX_REPLY_EVENTS * RING_SCAN_FACTOR):  # published, not stored
        feed.stored(b"c" + (1).to_bytes(4, "little") + i.to_bytes(16, "little"), b"", 0)
    reader = greeted(service, layout(model_name="quiet"))
    assert service.handle(reader, Subscribe([2])).cursor == feed.head
    assert writer is not None
    reply = service.handle(reader, Events(1, 0, False))
    examined = MAX_REPLY_EVENTS * RING_SCAN_FACTOR
    assert reply.events == [] and reply.cursor == max(1, feed.head - feed.capacity) + examined
    assert service.work_units == 1 + examined // EVENTS_PER_UNIT
    service.handle(reader, Events(feed.head - 3, 0, False))
    assert service.work_units == 1


def test_a_snapshot_subscribe_is_priced_by_the_keys_it_copies(make_service):
    service = make_service(HEADER_BYTES + 4096 * 4096, 4096)
    session = greeted(service, LAYOUT)
    store(service, session, 1, range(3000))
    service.handle(session, Subscribe([1], 0, True))
    assert service.work_units == 1 + 3000 // EVENTS_PER_UNIT
    service.handle(session, Subscribe([1]))
    assert service.work_units == 1


def test_a_peer_of_another_uid_subscribes_to_its_own_namespaces_only(service):
    """As INFO `tenants`: a session outside the daemon's uid and root sees the events
    of the namespaces its HELLO registered; asking for another is `forbidden`, and
    "every namespace" means its own. The daemon's uid sees every namespace."""
    other_uid = os.geteuid() + 1
    owner = greeted(service, LAYOUT)  # namespace 1
    peer = greeted(service, layout(model_name="peer"), uid=other_uid)  # namespace 2
    assert error_code(service.handle(peer, Subscribe([1]))) == "forbidden"
    assert error_code(service.handle(peer, Subscribe([1, 2]))) == "forbidden"
    assert isinstance(service.handle(peer, Subscribe([])), SubscribeReply)
    assert service.events.subscribers[peer.session_id].namespaces == {2}
    cursor = service.events.head
    store(service, owner, 1, [1, 2])
    store(service, peer, 2, [3])
    reply = service.handle(peer, Events(cursor, 0, True))
    assert [(e.ns, e.chunk_hash[0]) for e in reply.events] == [(2, 3)]
    assert isinstance(service.handle(owner, Subscribe([])), SubscribeReply)
    reply = service.handle(owner, Events(cursor))
    assert [(e.ns, e.chunk_hash[0]) for e in reply.events] == [(1, 1), (1, 2), (2, 3)]
    # Without HELLO, a peer of another uid has no namespace of its own.
    stranger = service.open_session(os.getpid(), other_uid, 0)
    reply = service.handle(stranger, Subscribe([]))
    assert error_code(reply) == "forbidden" and "HELLO" in reply.message


def test_the_fingerprint_cache_holds_the_namespaces_alive_only(service):
    """Sessions that each HELLO new layouts, SUBSCRIBE and close leave the feed's
    fingerprint cache no larger than the namespaces alive: a client cycling through
    made-up layouts cannot grow the daemon's memory."""
    for i in range(50):
        session = greeted(service, *(layout(model_name=f"m{i}-{j}") for j in range(8)))
        assert isinstance(service.handle(session, Subscribe([])), SubscribeReply)
        service.handle(session, Events(0))
        service.close_session(session)
    assert len(service.ns_registry.layouts) == 0
    assert len(service.events.fingerprints) <= 8


def test_polling_again_from_an_overwritten_cursor_counts_its_loss_once(make_service):
    """Each reply tells the subscriber what it lost from the cursor it asked for, but
    INFO `events_lost` (an operator's alert) counts each lost event once per
    subscriber: a client rewinding to cursor 1 again and again does not inflate it."""
    service = make_service()
    feed = service.events = type(service.events)(8)
    session = greeted(service, LAYOUT)
    service.handle(session, Subscribe([], 1))
    for i in range(20):
        feed.stored(b"c" + (1).to_bytes(4, "little") + i.to_bytes(16, "little"), b"", 0)
    for _ in range(5):
        reply = service.handle(session, Events(1))
        assert reply.lost == 12 and len(reply.events) == 8
    assert feed.info()["events_lost"] == 12


def _poll_all(service, session, cursor: int) -> list:
    """Every event of `session`'s subscription (its snapshot, then the ring from
    `cursor`), with token ids asked for."""
    events = []
    while True:
        reply = service.handle(session, Events(cursor, 0, True))
        assert isinstance(reply, EventsReply), reply
        events += reply.events
        if not reply.events and not reply.snapshot_left and reply.cursor == cursor:
            return events
        cursor = reply.cursor


@pytest.mark.parametrize("mode, in_group, reads", [
    (0o600, True, False),  # --allow-group with --shm-mode 0600: cannot map the arena
    (0o660, True, True),
    (0o640, True, True),
    (0o660, False, False),  # outside the segment's group
], ids=["0600-member", "0660-member", "0640-member", "0660-outsider"])
def test_token_ids_go_only_to_peers_that_can_read_the_arena(service, caplog, mode,
                                                            in_group, reads):
    """The token ids of a chunk are prompt content only the arena holds: a peer of
    another uid that the segment's mode leaves out (a member of --allow-group with
    --shm-mode 0600) gets the events of its namespace, ring and snapshot, with no token
    id bytes, and the daemon logs why once per session; one the mode lets read the
    segment gets exactly each chunk's token ids, as the daemon's uid always does."""
    segment = os.path.join(SHM_DIR, service.arena.segment_name.lstrip("/"))
    os.chmod(segment, mode)
    segment_gid = os.stat(segment).st_gid
    owner = greeted(service, LAYOUT)
    peer = greeted(service, LAYOUT, uid=OTHER_UID)
    peer.gid = segment_gid if in_group else segment_gid + 1
    tokens = {}
    for first in (100, 200):  # before the SUBSCRIBE: in its snapshot and in the ring
        ids = _store_record(service, owner, 1, 16, first)
        tokens[hash_block_tokens(ROOT_HASH, np.frombuffer(ids, np.int64))] = ids
    with caplog.at_level(logging.INFO, logger="lmcached.daemon.event_handlers"):
        for session in (owner, peer):
            assert isinstance(service.handle(session, Subscribe([], 1, True)), SubscribeReply)
        assert isinstance(service.handle(peer, Subscribe([], 1, True)), SubscribeReply)
    ids = _store_record(service, peer, 1, 16, 300)  # after: in the ring only
    tokens[hash_block_tokens(ROOT_HASH, np.frombuffer(ids, np.int64))] = ids
    logged = [r.getMessage() for r in caplog.records if "no token ids" in r.getMessage()]
    assert logged == ([] if reads else [
        f"session {peer.session_id} (pid {os.getpid()} uid {OTHER_UID} gid {peer.gid}) "
        "cannot read the arena's segment (--shm-mode): its events carry no token ids"])
    for session, can_read in ((owner, True), (peer, reads)):
        events = _poll_all(service, session, 1)
        assert sorted((e.seq > 0, e.chunk_hash) for e in events) == sorted(
            [(False, h) for h in list(tokens)[:2]] + [(True, h) for h in tokens])
        got = [e.token_ids for e in events]
        assert got == ([tokens[e.chunk_hash] for e in events] if can_read
                       else [b""] * len(events))
