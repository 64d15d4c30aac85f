"""No session can empty or hold the arena for the others, and a corrupt chunk is repaired.

In process (`CacheService.handle`, as tests/daemon/test_service.py): ALLOC sizes bounded by the
layout's record, the per-session share of the arena (`--max-session-share`) for WRITING
and pinned blocks, WRITING blocks aborted after `--writing-timeout`, and INVALIDATE. Then
real daemon processes: a giant ALLOC evicts nothing, a hog session does not make another
session's store NOSPACE, an uncommitted allocation expires and its late COMMIT is a
skipped store.
"""

import logging
import time

import msgspec
import pytest
import torch

from engine_worker import prompt_kv, small_layout
from lmcached.client import CacheEngine, hash_request_tokens
from lmcached.client.chain import fill_and_commit
from lmcached.client.daemon_link import DaemonLink
from lmcached.wire.connection import Connection, DaemonError, hello
from lmcached.wire.protocol import (
    ALLOCATED,
    EXISTS,
    NOSPACE,
    Abort,
    Acquire,
    Alloc,
    AllocReply,
    BlocksReply,
    Commit,
    Get,
    Invalidate,
    Layout,
    Lookup,
    Ok,
    Put,
    Release,
)
from lmcached.daemon.free_queue import BlockState
from test_service import (  # noqa: F401 (make_service and service are fixtures)
    BLOCK_BYTES,
    LAYOUT,
    NUM_BLOCKS,
    RECORD_BYTES,
    answer,
    assert_everything_returned,
    chunk_hashes,
    error_code,
    greeted,
    layout,
    lookup,
    make_service,
    service,
    store,
)

SHARE_BLOCKS = NUM_BLOCKS // 2  # --max-session-share 50 of the 16-block arena


@pytest.fixture
def half(make_service):
    """A 16-block service whose sessions may hold 8 blocks each (the default 50%)."""
    return make_service(max_session_share=50.0)


def stats(service) -> tuple[int, int, int]:
    """(evictions, cached values, WRITING blocks) of the host pool."""
    pool = service.pool
    return pool.stats.evictions, len(pool.cached), pool.num_writing_blocks


# ------------------------------------------------------------ ALLOC and PUT sizes
def test_an_alloc_larger_than_the_layouts_record_is_refused_and_evicts_nothing(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, range(16))  # the whole arena cached
    before = stats(service)
    for num_bytes in (RECORD_BYTES + 1, service.arena.capacity_bytes):
        reply = service.handle(session, Alloc(1, chunk_hashes([100, 101]),
                                              [RECORD_BYTES, num_bytes]))
        assert error_code(reply) == "bad_request"
        assert f"{num_bytes}-byte record" in reply.message
        assert f"full chunk record is {RECORD_BYTES} bytes" in reply.message
    assert stats(service) == before
    assert lookup(service, session, [1], range(16)) == 16
    assert service.handle(session, Alloc(1, chunk_hashes([100]), [RECORD_BYTES])).status == \
        [ALLOCATED]  # a full record: allowed (evicts one LRU chunk, as ever)
    assert_everything_returned(service)


def test_kv_namespaces_bound_allocs_and_puts_by_the_session_share(half):
    session = greeted(half, layout(model_name="kv", fmt="kv", record_bytes=1))
    largest = SHARE_BLOCKS * BLOCK_BYTES
    for request in (Put(1, "k", largest + 1), Alloc(1, chunk_hashes([1]), [largest + 1])):
        reply = half.handle(session, request)
        assert error_code(reply) == "bad_request"
        assert f"at most {largest} bytes (--max-session-share 50% of the arena)" in reply.message
    reply = half.handle(session, Put(1, "k", largest))
    assert reply.status == [ALLOCATED] and reply.span_lengths == [SHARE_BLOCKS]
    assert half.handle(session, Put(1, "j", 1)) == AllocReply([NOSPACE], [], [])
    assert half.handle(session, Abort(reply.block_ids)) == Ok()
    assert_everything_returned(half)


# ------------------------------------------------------------------ session share
def test_a_session_writing_its_share_gets_nospace_and_the_others_do_not(half):
    hog, other = greeted(half, LAYOUT), greeted(half, LAYOUT)
    store(half, other, 1, range(4))  # 4 cached chunks nobody pins
    before = stats(half)
    reply = half.handle(hog, Alloc(1, chunk_hashes(range(100, 116)), [RECORD_BYTES] * 16))
    assert reply.status == [ALLOCATED] * SHARE_BLOCKS + [NOSPACE] * 8
    assert hog.num_host_blocks_held == SHARE_BLOCKS
    # The hog took the 8 empty blocks of 12: the 4 cached chunks are still there.
    assert stats(half) == (before[0], 4, SHARE_BLOCKS)
    assert half.handle(hog, Alloc(1, chunk_hashes([200]), [RECORD_BYTES])).status == [NOSPACE]
    # The other session stores the 8 blocks left (4 empty, then 4 evicted).
    stored = half.handle(other, Alloc(1, chunk_hashes(range(300, 308)), [RECORD_BYTES] * 8))
    assert stored.status == [ALLOCATED] * 8
    assert half.handle(other, Commit(stored.block_ids)) == Ok()
    # Committing gives the share back.
    assert half.handle(hog, Commit(reply.block_ids)) == Ok()
    assert hog.num_host_blocks_held == 0
    again = half.handle(hog, Alloc(1, chunk_hashes([400]), [RECORD_BYTES]))
    assert again.status == [ALLOCATED]
    assert_everything_returned(half)


def test_a_session_pinning_its_share_gets_a_shorter_prefix_and_the_others_do_not(half):
    writer = greeted(half, LAYOUT)
    store(half, writer, 1, range(8))  # at most its share at once
    store(half, writer, 1, range(8, 12))
    hog, reader = greeted(half, LAYOUT), greeted(half, LAYOUT)
    held = half.handle(hog, Acquire([1], chunk_hashes(range(12))))
    assert len(held.block_ids) == SHARE_BLOCKS  # a prefix: its share
    assert hog.num_host_pinned == SHARE_BLOCKS
    # Pinning again what it pins takes no room (a scheduler's requests that share a
    # prefix); nothing beyond it.
    again = half.handle(hog, Acquire([1], chunk_hashes(range(12))))
    assert again.block_ids == held.block_ids and hog.num_host_pinned == SHARE_BLOCKS
    beyond = half.handle(hog, Acquire([1], chunk_hashes(range(8, 12))))
    assert beyond == BlocksReply(0, [], [], [])  # no room left: a miss, nothing pinned
    assert half.handle(hog, Get(1, "absent")) == BlocksReply(0, [], [], [])
    assert lookup(half, hog, [1], range(12)) == 12  # LOOKUP pins nothing: not bounded
    # Another session reads the whole prefix, and stores 8 new chunks (evicting the 4
    # chunks nobody pins, and its own once released).
    full = half.handle(reader, Acquire([1], chunk_hashes(range(8, 12))))
    assert len(full.block_ids) == 4
    half.handle(reader, Release([full.lease]))
    stored = half.handle(reader, Alloc(1, chunk_hashes(range(100, 108)), [RECORD_BYTES] * 8))
    assert stored.status == [ALLOCATED] * 8
    half.handle(reader, Commit(stored.block_ids))
    half.handle(hog, Release([held.lease]))
    assert hog.num_host_pinned == SHARE_BLOCKS  # still pinned by the other lease
    half.handle(hog, Release([again.lease]))
    assert hog.num_host_pinned == 0 and hog.pins == {}
    assert_everything_returned(half)


def test_a_tp_sessions_share_counts_the_blocks_of_every_rank(half):
    tp2 = [layout(0, 2), layout(1, 2)]
    writer = greeted(half, *tp2)
    for ns in (1, 2):
        store(half, writer, ns, range(6))
    scheduler = greeted(half, *tp2)
    reply = half.handle(scheduler, Acquire([1, 2], chunk_hashes(range(6))))
    assert reply.span_lengths == [1] * 8  # 4 chunks in each of 2 ranks: 8 blocks
    half.handle(scheduler, Release([reply.lease]))
    assert_everything_returned(half)


# ---------------------------------------------------------------- WRITING timeout
def test_values_writing_too_long_are_aborted_counted_and_their_commit_expires(half):
    session = greeted(half, LAYOUT)
    old = half.handle(session, Alloc(1, chunk_hashes([1, 2]), [RECORD_BYTES] * 2))
    for value in session.writing.values():
        value.allocated_at -= 100  # allocated 100 s ago
    young = half.handle(session, Alloc(1, chunk_hashes([3]), [RECORD_BYTES]))
    other = greeted(half, LAYOUT)
    cutoff = time.monotonic() - 60
    assert half.expire_writing(cutoff) == 2
    assert half.stats.writing_expired == 2
    assert half.pool.num_writing_blocks == 1 and session.num_host_writing == 1
    assert [half.pool.blocks[b].state for b in old.block_ids] == [BlockState.FREE] * 2
    assert half.expire_writing(cutoff) == 0  # the young one stays
    reply = half.handle(session, Commit(old.block_ids + young.block_ids))
    assert error_code(reply) == "expired"
    assert "aborted them (--writing-timeout); these chunks were not stored" in reply.message
    # The COMMIT's other value was given up with them; nothing was stored.
    assert half.pool.num_writing_blocks == 0 and lookup(half, session, [1], [1, 2, 3]) == 0
    assert error_code(half.handle(session, Commit(old.block_ids))) == "not_owner"  # once
    assert error_code(half.handle(other, Commit(young.block_ids))) == "not_owner"
    # An ABORT of expired blocks is what happened anyway: Ok.
    late = half.handle(session, Alloc(1, chunk_hashes([4]), [RECORD_BYTES]))
    assert half.expire_writing(session.last_request_at + 1) == 1
    assert half.handle(session, Abort(late.block_ids)) == Ok()
    assert half.stats.errors["expired"] == 1
    assert_everything_returned(half)


def test_a_block_expired_then_allocated_again_commits(half):
    session = greeted(half, LAYOUT)
    first = half.handle(session, Alloc(1, chunk_hashes([1]), [RECORD_BYTES]))
    half.expire_writing(session.last_request_at + 1)
    second = half.handle(session, Alloc(1, chunk_hashes([1]), [RECORD_BYTES]))
    assert second.block_ids == first.block_ids  # the same empty block, handed out again
    assert half.handle(session, Commit(second.block_ids)) == Ok()
    assert lookup(half, session, [1], [1]) == 1
    assert_everything_returned(half)


def test_housekeeping_expires_only_with_a_writing_timeout(make_service):
    service = make_service()
    service.config.writing_timeout_s = 0.0
    session = greeted(service, LAYOUT)
    service.handle(session, Alloc(1, chunk_hashes([1]), [RECORD_BYTES]))
    session.writing[next(iter(session.writing))].allocated_at -= 1e6
    service.housekeeping()
    assert service.pool.num_writing_blocks == 1
    service.config.writing_timeout_s = 60.0
    service.housekeeping()
    assert service.pool.num_writing_blocks == 0 and service.stats.writing_expired == 1
    assert_everything_returned(service)


# -------------------------------------------------------------------- INVALIDATE
def test_invalidate_drops_the_chunk_still_at_the_block_read_and_counts_it(service):
    writer, reader = greeted(service, LAYOUT), greeted(service, LAYOUT)
    blocks = store(service, writer, 1, range(3))
    # A stale report (another block than the one indexed) and an unknown tier: ignored.
    assert service.handle(reader, Invalidate(1, chunk_hashes([1, 2]),
                                             [blocks[2], (7 << 32) | blocks[2]])) is None
    assert lookup(service, reader, [1], range(3)) == 3 and service.stats.invalidated == 0
    assert service.handle(reader, Invalidate(1, chunk_hashes([1]), [blocks[1]])) is None
    assert lookup(service, reader, [1], range(3)) == 1 and service.stats.invalidated == 1
    # Dropped once; a repeat changes nothing. The next store writes the chunk again.
    service.handle(reader, Invalidate(1, chunk_hashes([1]), [blocks[1]]))
    assert service.stats.invalidated == 1
    reply = service.handle(writer, Alloc(1, chunk_hashes(range(3)), [RECORD_BYTES] * 3))
    assert reply.status == [EXISTS, ALLOCATED, EXISTS]
    service.handle(writer, Commit(reply.block_ids))
    assert lookup(service, reader, [1], range(3)) == 3
    assert_everything_returned(service)


def test_an_invalidated_chunk_stays_readable_to_its_pin_holders_until_released(service):
    writer, holder = greeted(service, LAYOUT), greeted(service, LAYOUT)
    (block,) = store(service, writer, 1, [0])
    pinned = service.handle(holder, Acquire([1], chunk_hashes([0])))
    service.handle(writer, Invalidate(1, chunk_hashes([0]), [block]))
    assert lookup(service, writer, [1], [0]) == 0  # out of the index
    assert service.pool.blocks[block].state == BlockState.READY  # detached, bytes kept
    assert service.pool.num_detached_blocks == 1
    # Every other block can be allocated, never the pinned one.
    reply = service.handle(writer, Alloc(1, chunk_hashes(range(100, 116)), [RECORD_BYTES] * 16))
    assert reply.status == [ALLOCATED] * 15 + [NOSPACE] and block not in reply.block_ids
    service.handle(writer, Abort(reply.block_ids))
    service.handle(holder, Release([pinned.lease]))
    assert service.pool.blocks[block].state == BlockState.FREE
    assert_everything_returned(service)


def test_invalidate_is_validated_and_unanswered(service):
    session = greeted(service, LAYOUT)
    blocks = store(service, session, 1, [0])
    for request in (Invalidate(1, chunk_hashes([0]), []), Invalidate(2, chunk_hashes([0]), blocks),
                    Invalidate(1, b"short", blocks)):
        assert service.handle(session, request) is None  # counted, never answered
    assert service.stats.errors == {"bad_request": 2, "bad_namespace": 1}
    # A frame tagged INVALIDATE that does not decode gets no reply either: its sender
    # reads none.
    assert answer(service, session, msgspec.msgpack.encode(["invalidate", "x"])) == (None, 1)
    assert service.stats.errors["bad_request"] == 3
    assert lookup(service, session, [1], [0]) == 1
    assert_everything_returned(service)


# ------------------------------------------------------------ real daemon processes
ENGINE_LAYOUT = small_layout()  # chunk_size 16, a 4,288-byte record: one 8 KiB block
RECORD = ENGINE_LAYOUT.record_bytes(ENGINE_LAYOUT.chunk_size)


def small_daemon(daemon_factory, *args: str):
    """127 blocks of 8 KiB; a session may hold 63 of them (--max-session-share 50)."""
    return daemon_factory("--capacity", "1MiB", "--block-size", "8KiB", *args)


def raw_session(daemon, layout: Layout = ENGINE_LAYOUT.to_wire()) -> tuple[Connection, int]:
    conn = Connection(daemon.socket)
    (ns,) = hello(conn, "hostile", [layout]).namespaces
    return conn, ns


def prompt(first: int, num_chunks: int) -> list[int]:
    return list(range(first, first + 16 * num_chunks))


def keys_of(tokens: list[int]) -> bytes:
    """The chunk hashes of `tokens`, as one bytes (ACQUIRE's field)."""
    return b"".join(hash_request_tokens(ENGINE_LAYOUT.chunk_size, tokens))


def assert_cached(engine: CacheEngine, tokens: list[int]) -> None:
    got, ret_mask = engine.retrieve(tokens, return_tuple=False)
    assert bool(ret_mask.all()) and torch.equal(got, prompt_kv(ENGINE_LAYOUT, tokens))


def test_a_giant_alloc_is_refused_and_evicts_nothing(daemon_factory):
    daemon = small_daemon(daemon_factory)
    prompts = [prompt(0, 40), prompt(10_000, 40)]
    with CacheEngine.connect(ENGINE_LAYOUT, socket=daemon.socket, strict=True) as engine:
        for tokens in prompts:
            assert engine.store(tokens, prompt_kv(ENGINE_LAYOUT, tokens)) == 40
        before = daemon.info()
        assert before["cached_values"] == 80 and before["evictions"] == 0
        conn, ns = raw_session(daemon)  # an --allow-group member may do this much
        with pytest.raises(DaemonError, match=rf"bad_request: ALLOC of a "
                           rf"{before['capacity_bytes']}-byte record .* {RECORD} bytes"):
            conn.request(Alloc(ns, chunk_hashes([1]), [before["capacity_bytes"]]))
        # A layout that claims a record as large as the arena fits no session's share:
        # refused at HELLO, before any ALLOC.
        arena_bytes = before["num_blocks"] * before["block_bytes"]
        liar = Layout("liar", 1, 0, "vllm", "uint8", 1, 1, 1, 1, arena_bytes)
        with pytest.raises(DaemonError, match=r"too_large: .* one session may hold 63 of "):
            raw_session(daemon, liar)
        after = daemon.info()
        for field in ("evictions", "cached_values", "cached_blocks", "stores"):
            assert after[field] == before[field], field
        assert after["writing_blocks"] == 0 and after["errors_bad_request"] == 1
        for tokens in prompts:  # every cached chunk still there, bytes equal
            assert_cached(engine, tokens)
        conn.close()
    assert daemon.info()["pinned_blocks"] == 0


@pytest.mark.parametrize("hog_does", ["write", "pin"])
def test_a_session_holding_all_it_can_does_not_make_another_store_nospace(daemon_factory,
                                                                          hog_does):
    daemon = small_daemon(daemon_factory)
    hog, ns = raw_session(daemon)
    with CacheEngine.connect(ENGINE_LAYOUT, socket=daemon.socket, strict=True) as engine:
        num_blocks = daemon.info()["num_blocks"]
        if hog_does == "write":  # every block, never committed
            reply = hog.request(Alloc(ns, chunk_hashes(range(num_blocks)), [RECORD] * num_blocks))
            assert reply.status.count(ALLOCATED) == 63
            assert daemon.info()["writing_blocks"] == 63
        else:  # pin every cached chunk: 120 of the 127 blocks
            for first in (0, 10_000):
                tokens = prompt(first, 60)
                assert engine.store(tokens, prompt_kv(ENGINE_LAYOUT, tokens)) == 60
            hashes = b"".join(keys_of(tokens) for tokens in (prompt(0, 60), prompt(10_000, 60)))
            pinned = [hog.request(Acquire([ns], hashes[i : i + 60 * 16]))
                      for i in (0, 60 * 16)]
            assert sum(len(p.block_ids) for p in pinned) == 63
            assert daemon.pins_held() == 63
        tokens = prompt(50_000, 60)  # 60 new chunks: more than half the arena
        assert engine.store(tokens, prompt_kv(ENGINE_LAYOUT, tokens)) == 60
        assert engine.num_nospace_chunks == 0
        assert_cached(engine, tokens)
    hog.close()
    fields = daemon.info()
    assert fields["pinned_blocks"] == 0 and fields["writing_blocks"] == 0


def test_an_uncommitted_allocation_expires_and_its_late_commit_is_a_skipped_store(
        daemon_factory, caplog):
    daemon = small_daemon(daemon_factory, "--writing-timeout", "1")
    link = DaemonLink(daemon.socket, layouts=[ENGINE_LAYOUT.to_wire()], client_name="slow")
    link.connect()
    try:
        ns, generation = link.hello_reply.namespaces[0], link.generation
        reply = link.request(Alloc(ns, chunk_hashes([1, 2]), [RECORD] * 2))
        assert reply.status == [ALLOCATED] * 2

        def slow_fill() -> None:  # a writer stalled past --writing-timeout
            deadline = time.monotonic() + 30
            while daemon.info()["writing_expired"] < 2:
                assert time.monotonic() < deadline, "the allocation never expired"
                time.sleep(0.1)

        with caplog.at_level(logging.WARNING, logger="lmcached"):
            assert fill_and_commit(link, reply.block_ids, generation, slow_fill) is False
        assert any("COMMIT refused, chunks not stored: expired" in r.getMessage()
                   for r in caplog.records)
        fields = daemon.info()
        assert fields["writing_blocks"] == 0 and fields["errors_expired"] == 1
        assert fields["stores"] == 0 and fields["writing_expired"] == 2
        assert link.request(Lookup([ns], chunk_hashes([1, 2]))).num_chunks == 0
        assert link.hello_reply is not None  # a refusal, not an outage: the session stays
    finally:
        link.close()
    assert "aborted 2 values left WRITING for more than 1 s (--writing-timeout)" in daemon.log()
