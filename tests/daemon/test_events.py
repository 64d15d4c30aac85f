"""The chunk event feed (lmcached/daemon/events.py): the ring alone, then inside one
CacheService (SUBSCRIBE / EVENTS driven by hand, no socket), with and without the disk
tier. A subscriber that never reads costs a store nothing; one that lags is told how many
events it lost; sequence numbers show every gap."""

import msgspec
import numpy as np
import pytest

from test_disk_tier import (  # noqa: F401 (disk_service is a fixture)
    BLOCK_BYTES,
    LAYOUT as DISK_LAYOUT,
    PROMPT_A,
    PROMPT_B,
    close_disk_service,
    disk_service,
    full_blocks,
    lookup as disk_lookup,
    settle,
    stored_and_settled,
    written_then_restarted,
)
from test_service import (  # noqa: F401 (make_service and service are fixtures)
    LAYOUT,
    chunk_hashes,
    error_code,
    greeted,
    layout,
    make_service,
    service,
    store,
)
from lmcached.daemon.events import EventFeed, Subscriber
from lmcached.daemon.spill.envelope import namespace_fingerprint
from lmcached.wire.protocol import (
    Alloc,
    ChunkEvent,
    Clear,
    Commit,
    Events,
    EventsReply,
    Evict,
    Info,
    Subscribe,
    SubscribeReply,
)
from lmcached.wire.record_format import ROOT_HASH, hash_block_tokens, write_header


def _key(ns: int, i: int) -> bytes:
    return b"c" + ns.to_bytes(4, "little") + i.to_bytes(16, "little")


def _resolve(event, with_tokens, sub):
    """A stand-in for the service's resolve, for arena events."""
    seq, kind, medium, key, parent, _block = event
    ns = int.from_bytes(key[1:5], "little")
    if sub.namespaces and ns not in sub.namespaces:
        return None
    return ChunkEvent(seq, kind, medium, ns, b"", key[5:], parent)


def _read(feed: EventFeed, sub: Subscriber, cursor: int, max_events: int = 0):
    """(events as (seq, kind, ns), next cursor, lost)."""
    events, cursor, lost = feed.read(sub, cursor, max_events, False, _resolve)
    return [(e.seq, e.kind, e.ns) for e in events], cursor, lost


# ------------------------------------------------------------------ the ring alone
def test_events_come_in_publication_order_with_consecutive_sequence_numbers():
    feed = EventFeed(8)
    cursor = feed.subscribe(1, [], [], 0)
    assert cursor == 1
    feed.stored(_key(1, 0), b"", 0)
    feed.removed(_key(1, 0))
    feed.stored(_key(1, 1), b"", 1)
    events, cursor, lost = _read(feed, feed.subscribers[1], cursor)
    assert events == [(1, "stored", 1), (2, "removed", 1), (3, "stored", 1)]
    assert (cursor, lost) == (4, 0)
    assert _read(feed, feed.subscribers[1], cursor) == ([], 4, 0)


def test_string_keys_are_not_published():
    feed = EventFeed(8)
    feed.stored(b"s" + (1).to_bytes(4, "little") + b"key", b"", 0)
    feed.removed(b"s" + (1).to_bytes(4, "little") + b"key")
    assert feed.head == 1 and feed.num_published == 0


def test_a_subscriber_that_lags_loses_the_oldest_and_is_told_how_many():
    """The ring keeps the last `capacity` events: a cursor behind them loses the
    difference, counted once, and reads on from the oldest kept."""
    feed = EventFeed(4)
    cursor = feed.subscribe(7, [], [], 0)
    for i in range(10):
        feed.stored(_key(1, i), b"", i)
    assert feed.info()["events_subscribers_lagging"] == 1
    events, cursor, lost = _read(feed, feed.subscribers[7], cursor)
    assert lost == 6  # events 1..6 were overwritten; 7..10 kept
    assert [seq for seq, _, _ in events] == [7, 8, 9, 10]
    assert cursor == 11
    info = feed.info()
    assert info["events_lost"] == 6 and info["events_subscribers_lagging"] == 0
    assert info["events_published"] == 10 and feed.subscribers[7].lost == 6


def test_filtered_events_leave_a_gap_in_the_sequence_numbers():
    feed = EventFeed(16)
    cursor = feed.subscribe(1, [2], [], 0)
    for ns in (1, 2, 1, 2):
        feed.stored(_key(ns, 0), b"", 0)
    events, cursor, lost = _read(feed, feed.subscribers[1], cursor)
    assert events == [(2, "stored", 2), (4, "stored", 2)] and (cursor, lost) == (5, 0)


def test_a_page_stops_at_max_events_and_the_cursor_goes_on_from_there():
    feed = EventFeed(16)
    cursor = feed.subscribe(1, [], [], 0)
    for i in range(5):
        feed.stored(_key(1, i), b"", i)
    first, cursor, _ = _read(feed, feed.subscribers[1], cursor, max_events=3)
    rest, cursor, _ = _read(feed, feed.subscribers[1], cursor, max_events=3)
    assert [e[0] for e in first] == [1, 2, 3] and [e[0] for e in rest] == [4, 5]


def test_subscribing_from_a_past_cursor_replays_what_the_ring_still_holds():
    feed = EventFeed(16)
    for i in range(3):
        feed.stored(_key(1, i), b"", i)
    cursor = feed.subscribe(1, [], [], 2)
    events, _, lost = _read(feed, feed.subscribers[1], cursor)
    assert [e[0] for e in events] == [2, 3] and lost == 0
    assert feed.subscribe(2, [], [], 0) == 4  # 0: from now on


def test_publishing_is_one_slot_whatever_the_number_of_subscribers():
    """Subscribers hold cursors only: nothing per subscriber is done on publication."""
    feed = EventFeed(4)
    for session_id in range(1000):
        feed.subscribe(session_id, [], [], 0)
    feed.stored(_key(1, 0), b"", 0)
    assert feed.head == 2 and all(s.cursor == 1 for s in feed.subscribers.values())


def test_a_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        EventFeed(0)


# --------------------------------------------------------------- in the service
def _subscribed(service, *layouts, namespaces=()):
    session = greeted(service, *layouts)
    reply = service.handle(session, Subscribe(list(namespaces)))
    assert isinstance(reply, SubscribeReply), reply
    assert reply.generation == service.arena.generation
    return session, reply.cursor


def _poll(service, session, cursor, token_ids=False) -> EventsReply:
    reply = service.handle(session, Events(cursor, 0, token_ids))
    assert isinstance(reply, EventsReply), reply
    return reply


def test_stored_chunks_are_announced_with_their_namespace_and_chain(service):
    session, cursor = _subscribed(service, LAYOUT)
    store(service, session, 1, [10, 11, 12])
    reply = _poll(service, session, cursor)
    fp = namespace_fingerprint(LAYOUT)
    hashes = [i.to_bytes(16, "little") for i in (10, 11, 12)]
    assert [(e.kind, e.medium, e.ns, e.ns_fp, e.chunk_hash, e.parent) for e in reply.events] == [
        ("stored", "cpu", 1, fp, hashes[0], b""),
        ("stored", "cpu", 1, fp, hashes[1], hashes[0]),
        ("stored", "cpu", 1, fp, hashes[2], hashes[1]),
    ]
    assert [e.seq for e in reply.events] == [cursor, cursor + 1, cursor + 2]
    assert reply.lost == 0 and all(e.token_ids == b"" for e in reply.events)


def test_a_chunk_after_cached_ones_names_the_cached_one_as_its_parent(service):
    session, cursor = _subscribed(service, LAYOUT)
    store(service, session, 1, [10])
    alloc = service.handle(session, Alloc(1, chunk_hashes([10, 11]), [1000, 1000]))
    service.handle(session, Commit(alloc.block_ids))
    events = _poll(service, session, cursor).events
    assert [(e.chunk_hash[0], e.parent[:1]) for e in events] == [(10, b""), (11, bytes([10]))]


def test_alloc_parents_name_each_chunks_parent_across_allocs_and_chains(service):
    """An ALLOC that names its chunks' parents: its first chunk continues a chain stored
    by an earlier ALLOC (a later step of a chunked prefill), its second starts another
    chain (ROOT_HASH: announced with no parent), its third follows that one. The pool
    keeps those parents (the disk tier and a snapshot read them there)."""
    session, cursor = _subscribed(service, LAYOUT)
    store(service, session, 1, [10])
    parents = chunk_hashes([10]) + ROOT_HASH + chunk_hashes([20])
    alloc = service.handle(session, Alloc(1, chunk_hashes([11, 20, 21]), [1000] * 3, 0, parents))
    service.handle(session, Commit(alloc.block_ids))
    events = _poll(service, session, cursor).events
    assert [(e.chunk_hash[0], e.parent[:1]) for e in events] == [
        (10, b""), (11, bytes([10])), (20, b""), (21, bytes([20]))]
    assert sorted((k[5], p[:1]) for k, p in service.pool.ledger.parents.items()) == [
        (11, bytes([10])), (21, bytes([20]))]


def test_chunks_of_an_unchained_format_are_published_with_no_parent(service):
    """SGLang's pages are no chain (UNCHAINED_FORMATS): an ALLOC of several, which
    names no parents, gives none of them the page before it as its parent."""
    sglang = msgspec.structs.replace(LAYOUT, fmt="sglang")
    session, cursor = _subscribed(service, sglang)
    alloc = service.handle(session, Alloc(1, chunk_hashes([30, 31, 32]), [1000] * 3))
    service.handle(session, Commit(alloc.block_ids))
    events = _poll(service, session, cursor).events
    assert [(e.chunk_hash[0], e.parent) for e in events] == [(30, b""), (31, b""), (32, b"")]
    assert service.pool.ledger.parents == {}


def test_token_ids_are_read_from_the_record_only_when_asked(service):
    """Lazily, at EVENTS: the header the writer wrote names the chunk, so its token ids
    come back as int64 bytes; a record replaced since (another hash) gives none."""
    session = greeted(service, LAYOUT)
    cursor = service.handle(session, Subscribe([])).cursor
    tokens = np.arange(16, dtype=np.int64)
    chunk_hash = hash_block_tokens(ROOT_HASH, tokens)
    alloc = service.handle(session, Alloc(1, chunk_hash, [1000]))
    arena = service.arena
    header = arena.numpy_view(arena.block_offset(alloc.block_ids[0]), 1000)
    write_header(header, 123, chunk_hash, tokens)
    service.handle(session, Commit(alloc.block_ids))
    assert _poll(service, session, cursor).events[0].token_ids == b""
    event = _poll(service, session, cursor, token_ids=True).events[0]
    assert event.token_ids == tokens.tobytes()
    header[8:24] = 0  # the record no longer names the chunk
    assert _poll(service, session, cursor, token_ids=True).events[0].token_ids == b""


def test_evict_and_clear_announce_removals(service):
    session, cursor = _subscribed(service, LAYOUT)
    store(service, session, 1, [1, 2, 3])
    cursor = _poll(service, session, cursor).cursor
    service.handle(session, Evict(key=(2).to_bytes(16, "little").hex()))
    service.handle(session, Clear())
    events = _poll(service, session, cursor).events
    assert [(e.kind, e.chunk_hash[0]) for e in events] == [
        ("removed", 2), ("removed", 1), ("removed", 3)]


def test_pressure_evictions_announce_removals(service):
    """16 blocks: storing 20 chunks evicts the 4 least recently used."""
    session, cursor = _subscribed(service, LAYOUT)
    store(service, session, 1, range(16))
    store(service, session, 1, range(16, 20))
    events = _poll(service, session, cursor).events
    removed = [e.chunk_hash[0] for e in events if e.kind == "removed"]
    assert sorted(removed) == [12, 13, 14, 15]  # committed last, freed tail first: LRU
    assert sum(e.kind == "stored" for e in events) == 20


def test_a_subscription_filters_by_namespace(service):
    other = layout(model_name="other-llama")
    session, cursor = _subscribed(service, LAYOUT, other, namespaces=[2])
    store(service, session, 1, [1])
    store(service, session, 2, [2])
    events = _poll(service, session, cursor).events
    assert [(e.ns, e.chunk_hash[0]) for e in events] == [(2, 2)]
    assert events[0].seq == cursor + 1  # the gap is the filtered event


def test_subscribe_to_an_unknown_namespace_and_events_before_subscribe_are_refused(service):
    session = greeted(service, LAYOUT)
    assert error_code(service.handle(session, Events(1))) == "no_subscription"
    assert error_code(service.handle(session, Subscribe([9]))) == "bad_namespace"


def test_a_subscriber_that_never_reads_changes_no_store(make_service):
    """The same stores with and without a subscriber that never reads leave the same
    pool: the same blocks, the same LRU order; only the feed's counters say it lags."""
    def run(subscribed: bool):
        service = make_service()
        session = greeted(service, LAYOUT)
        if subscribed:
            idle = greeted(service, LAYOUT)
            service.handle(idle, Subscribe([]))
        for start in range(0, 64, 4):
            store(service, session, 1, range(start, start + 4))
        pool = service.pool
        return sorted(pool.cached), [b.block_id for b in pool.free_block_queue.get_all_free_blocks()], service
    plain, plain_queue, _ = run(False)
    watched, watched_queue, service = run(True)
    assert (plain, plain_queue) == (watched, watched_queue)
    info = service.handle(greeted(service), Info("stats")).sections["stats"]
    assert info["events_subscribers"] == 1 and info["events_published"] == 64 + 48


def test_a_lagging_subscriber_is_counted_in_info_and_told_on_its_next_poll(make_service):
    service = make_service()
    service.events = service.pool.ledger.events = EventFeed(8)
    session, cursor = _subscribed(service, LAYOUT)
    store(service, session, 1, range(12))
    info = service.handle(session, Info("stats")).sections["stats"]
    assert info["events_subscribers_lagging"] == 1 and info["events_lost"] == 0
    reply = _poll(service, session, cursor)
    assert reply.lost == 4 and [e.chunk_hash[0] for e in reply.events] == list(range(4, 12))
    info = service.handle(session, Info("stats")).sections["stats"]
    assert info["events_subscribers_lagging"] == 0 and info["events_lost"] == 4


def test_a_closed_session_is_unsubscribed(service):
    session, _ = _subscribed(service, LAYOUT)
    assert service.events.info()["events_subscribers"] == 1
    service.close_session(session)
    assert service.events.info()["events_subscribers"] == 0


# ------------------------------------------------------------------- disk tier
def test_the_disk_tier_announces_chunks_it_commits_and_forgets(disk_service):
    service = disk_service
    watcher = greeted(service, DISK_LAYOUT)
    cursor = service.handle(watcher, Subscribe([])).cursor
    stored_and_settled(service)
    events = _poll(service, watcher, cursor).events
    disk_stored = [e for e in events if e.medium == "disk" and e.kind == "stored"]
    assert disk_stored and all(e.ns == 1 and e.ns_fp == namespace_fingerprint(DISK_LAYOUT)
                               for e in disk_stored)
    assert {e.chunk_hash for e in disk_stored} <= {h for _, h, _ in PROMPT_A} | {
        e.chunk_hash for e in events if e.kind == "stored"}
    cursor = events[-1].seq + 1
    service.handle(watcher, Clear())
    removed = _poll(service, watcher, cursor).events
    assert {e.chunk_hash for e in removed if e.medium == "disk"} == {
        e.chunk_hash for e in disk_stored}
    assert all(e.kind == "removed" for e in removed)


def test_a_snapshot_pages_the_cached_chunks_before_the_live_events(service):
    """SUBSCRIBE with a snapshot: the namespace's cached chunks come first as stored
    events of sequence number 0, with their parents, `max_events` a page; one evicted
    before its page is skipped (its removal is live), one stored after the SUBSCRIBE
    is live; the parents the feed keeps go with the chunks."""
    other = layout(model_name="other-llama")
    session = greeted(service, LAYOUT, other)
    store(service, session, 1, [1, 2, 3, 4])
    store(service, session, 2, [9])
    reply = service.handle(session, Subscribe([1], 0, True))
    cursor = reply.cursor
    service.handle(session, Evict(key=(3).to_bytes(16, "little").hex()))
    store(service, session, 1, [5])  # its parent: chunk 4
    first = service.handle(session, Events(cursor, 2, True))
    assert [(e.seq, e.kind, e.chunk_hash[0], e.parent[:1]) for e in first.events] == [
        (0, "stored", 1, b""), (0, "stored", 2, bytes([1]))]
    assert first.cursor == cursor and first.lost == 0 and first.snapshot_left == 3
    second = service.handle(session, Events(cursor, 2, True))
    assert [(e.seq, e.chunk_hash[0], e.parent[:1]) for e in second.events] == [
        (0, 4, bytes([3]))]  # 3 left before its page; 9 is another namespace's
    assert second.snapshot_left == 0
    live = _poll(service, session, cursor)
    assert [(e.kind, e.chunk_hash[0]) for e in live.events] == [("removed", 3), ("stored", 5)]
    assert live.events[0].seq == cursor
    assert service.events.num_snapshot_events == 3
    assert service.handle(session, Info("stats")).sections["stats"]["events_snapshot_sent"] == 3
    service.handle(session, Clear())
    assert service.pool.ledger.parents == {}


def test_chunks_a_disk_fetch_installs_are_announced_with_their_parents(disk_service):
    """A LOOKUP reads evicted chunks back from disk into the arena (those missing, and
    any the fetch's room evicted meanwhile): each is a stored "cpu" event naming its
    chain parent (none for the first), with its token ids."""
    service = disk_service
    session = stored_and_settled(service)
    prefix = b"c" + (1).to_bytes(4, "little")
    missing = [(parent, h) for parent, h, _ in PROMPT_A if prefix + h not in service.pool.cached]
    assert missing
    watcher = greeted(service, DISK_LAYOUT)
    cursor = service.handle(watcher, Subscribe([1])).cursor
    assert disk_lookup(service, session) == 4
    events = [e for e in _poll(service, watcher, cursor, token_ids=True).events
              if e.kind == "stored" and e.medium == "cpu"]
    parents = {h: b"" if parent == ROOT_HASH else parent for parent, h, _ in PROMPT_A}
    assert {h for _, h in missing} <= {e.chunk_hash for e in events} <= set(parents)
    assert all(e.parent == parents[e.chunk_hash] for e in events)
    for event in events:
        tokens = np.frombuffer(event.token_ids, dtype="<i8")
        assert len(tokens) == 16 and hash_block_tokens(
            event.parent or ROOT_HASH, tokens) == event.chunk_hash


def test_chunks_the_prewarm_installs_are_announced(unique_name, tmp_path):
    layout_, chunks = full_blocks(BLOCK_BYTES)
    service = written_then_restarted(unique_name, str(tmp_path / "disk"), BLOCK_BYTES, chunks,
                                     layout_)
    try:
        tier = service.spill_tier("disk")
        watcher = greeted(service, layout_)  # plans the prewarm
        cursor = service.handle(watcher, Subscribe([])).cursor

        def done() -> bool:
            tier.prewarm_pump()
            return tier.prewarm_info()["disk_prewarm_state"] == "done"
        settle(service, done)
        assert tier.prewarm_info()["disk_prewarm_chunks"] == len(chunks)
        events = _poll(service, watcher, cursor, token_ids=True).events
        assert sorted(e.chunk_hash for e in events if (e.kind, e.medium) == ("stored", "cpu")) \
            == sorted(h for _, h, _ in chunks)
        first = next(e for e in events if e.chunk_hash == chunks[0][1])
        assert first.parent == b"" and hash_block_tokens(
            ROOT_HASH, np.frombuffer(first.token_ids, dtype="<i8")) == first.chunk_hash
    finally:
        close_disk_service(service)


def _stored_chain(service, session, chunks, ns: int = 1) -> None:
    """ALLOC `chunks` ((parent, hash, record) of one chain) in one request, fill, COMMIT:
    the daemon knows each chunk's parent."""
    arena = service.arena
    alloc = service.handle(session, Alloc(ns, b"".join(h for _, h, _ in chunks),
                                          [len(r) for _, _, r in chunks]))
    for block_id, (_, _, record) in zip(alloc.block_ids, chunks):
        arena.numpy_view(arena.block_offset(block_id), len(record))[:] = \
            np.frombuffer(record, np.uint8)
    service.handle(session, Commit(alloc.block_ids))


def test_a_snapshot_pages_the_disk_tiers_chunks_after_the_arenas_parents_first(
        unique_name, tmp_path, monkeypatch):
    """A restarted daemon whose chunks are on disk only: SUBSCRIBE's snapshot pages them
    as "disk" stored events, parents first although the disk index holds them in the
    disk index's order (most recently used first: the chain's last), each
    with its parent and its token ids read from its slot, at most SNAPSHOT_DISK_READS
    disk reads a page; one forgotten before its page is skipped (its removal is live).
    Another namespace's chunks on disk (the most recent) cost a page no read."""
    from lmcached.daemon import events as events_module
    from test_disk_tier import close_disk_service, open_disk_service
    directory = str(tmp_path / "disk")
    chunks = PROMPT_A
    first = open_disk_service(unique_name, directory, policy="write-through", num_blocks=32)
    try:
        other = msgspec.structs.replace(DISK_LAYOUT, model_name="other-llama")
        session = greeted(first, DISK_LAYOUT, other)
        _stored_chain(first, session, chunks)
        settle(first, lambda: not first.spill_tier("disk")._writing)
        _stored_chain(first, session, PROMPT_B, ns=2)
        settle(first, lambda: not first.spill_tier("disk")._writing)
        assert {h: e.parent for (_, h), e in first.spill_tier("disk").index.entries.items()} == {
            h: b"" if p == ROOT_HASH else p for p, h, _ in chunks + PROMPT_B}
    finally:
        close_disk_service(first)
    service = open_disk_service(f"{unique_name}-2", directory, num_blocks=32)
    try:
        monkeypatch.setattr(events_module, "SNAPSHOT_DISK_READS", 3)
        session = greeted(service, DISK_LAYOUT)
        index, fp = service.spill_tier("disk").index, namespace_fingerprint(DISK_LAYOUT)
        assert not service.pool.cached and len(index.entries) == 8
        for _, chunk_hash, _ in chunks:  # the chain's last the most recently used
            index.touch((fp, chunk_hash))
        for key in [key for key in index.entries if key[0] != fp]:  # then the other's
            index.touch(key)
        cursor = service.handle(session, Subscribe([1], 0, True)).cursor
        page = service.handle(session, Events(cursor, 0, True))
        assert page.snapshot_left > 0 and len(page.events) == 3  # 3 disk reads a page
        service.handle(session, Evict(key=chunks[3][1].hex()))  # before its page
        rest = service.handle(session, Events(cursor, 0, True))
        assert rest.snapshot_left == 0 and rest.events == []
        events = page.events
        assert [(e.seq, e.kind, e.medium, e.ns, e.chunk_hash) for e in events] == [
            (0, "stored", "disk", 1, h) for _, h, _ in chunks[:3]]
        for event, (parent, chunk_hash, _) in zip(events, chunks):
            assert event.parent == (b"" if parent == ROOT_HASH else parent)
            assert hash_block_tokens(parent, np.frombuffer(event.token_ids, "<i8")) == chunk_hash
        live = _poll(service, session, cursor).events
        assert [(e.kind, e.medium, e.chunk_hash) for e in live] == [
            ("removed", "disk", chunks[3][1])]
        assert service.events.num_snapshot_events == 3
    finally:
        close_disk_service(service)
