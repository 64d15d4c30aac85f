"""Snapshot SUBSCRIBEs against a storm (lmcached/daemon/events.py): SUBSCRIBEs while the
arena's index holds still share one copy of its keys (the work of each does not grow
with the cache), a page is priced by what it sends, and a peer uid has at most
MAX_SNAPSHOTS_PER_PEER snapshots being paged: beyond, `busy`, and the daemon serves on.
benchmarks/engine/bench_snapshot_storm.py measures what a storm costs another client."""

import os

from test_events_hostile import _store_record
from test_service import (  # noqa: F401 (make_service is a fixture)
    HEADER_BYTES,
    LAYOUT,
    error_code,
    greeted,
    layout,
    make_service,
    store,
)
from lmcached.daemon.events import (
    EVENTS_PER_UNIT,
    EVENTS_SENT_PER_UNIT,
    MAX_SNAPSHOTS_PER_PEER,
    TOKEN_BYTES_PER_UNIT,
)
from lmcached.wire.protocol import Events, Ok, Ping, Subscribe, SubscribeReply


def _page_all(service, session) -> list[bytes]:
    """Page `session`'s snapshot to its end; the chunk hashes, in order."""
    hashes = []
    while True:
        reply = service.handle(session, Events(1, 100, False))
        hashes += [e.chunk_hash for e in reply.events if e.seq == 0]
        if not reply.snapshot_left:
            return hashes


def test_snapshot_subscribes_share_one_copy_while_the_arena_holds_still(make_service):
    """However many chunks the arena holds, a snapshot SUBSCRIBE after the first one
    with no change of the index in between copies nothing and costs one unit; the
    next change makes the next one copy, and every snapshot pages exactly the index's
    keys in its order then."""
    for num_chunks in (300, 3000):
        service = make_service(HEADER_BYTES + (num_chunks + 64) * 4096, 4096)
        writer = greeted(service, LAYOUT)
        store(service, writer, 1, range(num_chunks))
        feed = service.events
        readers = [greeted(service, LAYOUT) for _ in range(4)]
        assert isinstance(service.handle(readers[0], Subscribe([1], 0, True)), SubscribeReply)
        assert feed.num_snapshot_copies == 1
        assert service.work_units == 1 + num_chunks // EVENTS_PER_UNIT
        for _ in range(50):  # a storm of re-SUBSCRIBEs: none copies, each costs 1
            for reader in readers:
                service.handle(reader, Subscribe([1], 0, True))
                assert service.work_units == 1
        assert feed.num_snapshot_copies == 1
        expected = [key[5:] for key in service.pool.cached]
        assert _page_all(service, readers[0]) == expected
        assert _page_all(service, readers[1]) == expected  # the shared list is intact
        store(service, writer, 1, [num_chunks + 1])
        service.handle(readers[2], Subscribe([1], 0, True))
        assert feed.num_snapshot_copies == 2
        assert service.work_units == 1 + (num_chunks + 1) // EVENTS_PER_UNIT
        assert _page_all(service, readers[2]) == [key[5:] for key in service.pool.cached]
        assert _page_all(service, readers[3]) == expected  # subscribed before the store


def test_a_snapshot_page_is_priced_by_the_events_and_token_ids_it_sends(make_service):
    """A page of token-id events costs what it sends (EVENTS_SENT_PER_UNIT events and
    TOKEN_BYTES_PER_UNIT bytes a unit), not only what it examined: a pipeline of
    snapshot pages cannot hold the loop for one unit each."""
    service = make_service(HEADER_BYTES + 600 * 4096, 4096)
    session = greeted(service, LAYOUT)
    for i in range(400):
        _store_record(service, session, 1, 100, 1000 * i)
    service.handle(session, Subscribe([1], 0, True))
    reply = service.handle(session, Events(1, 256, True))
    token_bytes = sum(len(e.token_ids) for e in reply.events)
    assert len(reply.events) == 256 and token_bytes == 256 * 800
    expected = 1 + 256 // EVENTS_PER_UNIT + 256 // EVENTS_SENT_PER_UNIT \
        + token_bytes // TOKEN_BYTES_PER_UNIT
    assert service.work_units == expected and expected > 32
    cursor = service.events.head - 300  # a ring poll of live events: the same price
    service.handle(session, Subscribe([1], cursor))
    reply = service.handle(session, Events(cursor, 256, True))
    assert len(reply.events) == 256 and service.work_units == expected


def test_a_peer_over_its_snapshot_cap_gets_busy_and_the_daemon_serves_on(make_service):
    """MAX_SNAPSHOTS_PER_PEER snapshots of one uid may be paged at once; the next one is
    `busy`, naming the limit, and everything else is served (a SUBSCRIBE without a
    snapshot, another uid's snapshot, PING). A snapshot read to its end, replaced or
    whose session ended frees its place."""
    service = make_service(HEADER_BYTES + 64 * 4096, 4096)
    writer = greeted(service, LAYOUT)
    store(service, writer, 1, range(20))
    holders = [greeted(service, LAYOUT) for _ in range(MAX_SNAPSHOTS_PER_PEER)]
    for holder in holders:
        assert isinstance(service.handle(holder, Subscribe([1], 0, True)), SubscribeReply)
    late = greeted(service, LAYOUT)
    reply = service.handle(late, Subscribe([1], 0, True))
    assert error_code(reply) == "busy"
    assert f"MAX_SNAPSHOTS_PER_PEER = {MAX_SNAPSHOTS_PER_PEER}" in reply.message
    assert f"uid {os.geteuid()}" in reply.message
    assert late.session_id not in service.events.subscribers  # nothing half-made
    assert service.handle(late, Ping()) == Ok()
    assert isinstance(service.handle(late, Subscribe([1])), SubscribeReply)  # no snapshot
    assert isinstance(service.handle(holders[0], Subscribe([1], 0, True)), SubscribeReply)
    other = greeted(service, layout(model_name="other"), uid=os.geteuid() + 1)
    assert isinstance(service.handle(other, Subscribe([], 0, True)), SubscribeReply)
    assert len(_page_all(service, holders[1])) == 20  # read to its end: a place frees
    assert isinstance(service.handle(late, Subscribe([1], 0, True)), SubscribeReply)
    assert error_code(service.handle(greeted(service, LAYOUT), Subscribe([1], 0, True))) \
        == "busy"
    service.close_session(holders[2])  # its session ended: a place frees
    assert isinstance(service.handle(greeted(service, LAYOUT), Subscribe([1], 0, True)),
                      SubscribeReply)
    assert service.events.snapshots_by_peer == {os.geteuid(): MAX_SNAPSHOTS_PER_PEER,
                                                os.geteuid() + 1: 1}
