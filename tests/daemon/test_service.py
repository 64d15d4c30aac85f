"""Request semantics of `CacheService` in process: every request type, no daemon, no socket.

Each test drives `CacheService.handle(session, request)` (and `connection.answer_frame`
for what only a frame shows) against a real, small arena and asserts the replies and the
block pool's exact state. Every test that pins or allocates ends with
`assert_everything_returned`: the pool's invariants hold and closing the sessions leaves
no pinned and no WRITING block (docs/architecture.md, "Crash = EOF").
"""

import os

import msgspec
import pytest

from lmcached.daemon.server_config import ServerConfig
from lmcached.daemon.connection import answer_frame
from lmcached.wire.frames import encode_frame, reply_decoder
from lmcached.wire.protocol import (
    ALLOCATED,
    EXISTS,
    HASH_BYTES,
    MAX_CHUNKS_PER_REQUEST,
    NOSPACE,
    PROTOCOL_VERSION,
    Abort,
    Acquire,
    Alloc,
    AllocReply,
    BlocksReply,
    Commit,
    CountReply,
    Delete,
    Error,
    Get,
    Hello,
    HelloReply,
    Info,
    Layout,
    Lookup,
    LookupReply,
    Ok,
    Put,
    Release,
)
from lmcached.daemon.service import CacheService
from lmcached.shm.arena import HEADER_BYTES, Arena
from lmcached.daemon.free_queue import BlockState

BLOCK_BYTES = 64 << 10
NUM_BLOCKS = 16
SMALL_ARENA_BYTES = HEADER_BYTES + NUM_BLOCKS * BLOCK_BYTES
RECORD_BYTES = 1000
OTHER_UID = 4_000_000_000 if os.geteuid() != 4_000_000_000 else 4_000_000_001


def layout(worker_id: int = 0, world_size: int = 1, model_name: str = "tiny-llama",
           record_bytes: int = RECORD_BYTES, fmt: str = "vllm") -> Layout:
    return Layout(model_name, world_size, worker_id, fmt, "bfloat16", 2, 2, 4, 16,
                  record_bytes)


LAYOUT = layout()
TP2 = [layout(0, 2), layout(1, 2)]


def chunk_hashes(ids) -> bytes:
    return b"".join(i.to_bytes(HASH_BYTES, "little") for i in ids)


@pytest.fixture
def make_service(unique_name):
    """`make(capacity_bytes, block_bytes, config_block_bytes, max_session_share)` -> a
    CacheService on a new arena (not prefaulted); every arena is closed (unlinked) after
    the test. Sessions may hold the whole arena unless `max_session_share` says less:
    most tests fill the 16 blocks from one session; the share has tests of its own."""
    arenas = []

    def make(capacity_bytes: int = SMALL_ARENA_BYTES, block_bytes: int = BLOCK_BYTES,
             config_block_bytes: int = 0, max_session_share: float = 100.0) -> CacheService:
        arena = Arena.create(f"{unique_name}-{len(arenas)}", capacity_bytes, block_bytes,
                             prefault=False)
        arenas.append(arena)
        config = ServerConfig(name=arena.name, socket="/nonexistent",
                              block_bytes=config_block_bytes,
                              max_session_share=max_session_share)
        return CacheService(config, arena)

    yield make
    for arena in arenas:
        arena.close()


@pytest.fixture
def service(make_service) -> CacheService:
    """A service on a 16-block arena of 64 KiB blocks."""
    return make_service()


def greet(service: CacheService, *layouts: Layout, uid: int | None = None):
    """Open a session and HELLO with `layouts`; returns (session, reply)."""
    session = service.open_session(os.getpid(), os.geteuid() if uid is None else uid, 0)
    reply = service.handle(session, Hello(PROTOCOL_VERSION, os.getpid(), "test",
                                          list(layouts)))
    return session, reply


def greeted(service: CacheService, *layouts: Layout, uid: int | None = None):
    """`greet` that must succeed; returns the session."""
    session, reply = greet(service, *layouts, uid=uid)
    assert isinstance(reply, HelloReply), reply
    return session


def store(service, session, ns: int, ids, num_bytes: int = RECORD_BYTES) -> list[int]:
    """ALLOC + COMMIT of new chunks `ids`; returns their block ids (one each)."""
    alloc = service.handle(session, Alloc(ns, chunk_hashes(ids), [num_bytes] * len(ids)))
    assert alloc.status == [ALLOCATED] * len(ids), alloc
    assert service.handle(session, Commit(alloc.block_ids)) == Ok()
    return alloc.block_ids


def put(service, session, ns: int, key: str, num_bytes: int = RECORD_BYTES) -> list[int]:
    """PUT + COMMIT of a string key; returns its block ids."""
    reply = service.handle(session, Put(ns, key, num_bytes))
    assert reply.status == [ALLOCATED], reply
    assert service.handle(session, Commit(reply.block_ids)) == Ok()
    return reply.block_ids


def lookup(service, session, namespaces, ids) -> int:
    reply = service.handle(session, Lookup(list(namespaces), chunk_hashes(ids)))
    assert isinstance(reply, LookupReply), reply
    return reply.num_chunks


def error_code(reply) -> str | None:
    return reply.code if isinstance(reply, Error) else None


def queue_ids(service) -> list[int]:
    return [b.block_id for b in service.pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(service, block_ids) -> list[int]:
    return [service.pool.blocks[i].ref_cnt for i in block_ids]


def assert_everything_returned(service: CacheService) -> None:
    """Invariants hold, and closing every session leaves no pin and no WRITING block."""
    pool = service.pool
    pool.check_invariants()
    for session in list(service.sessions.values()):
        service.close_session(session)
    assert pool.num_pinned_blocks == 0
    assert pool.num_writing_blocks == 0
    assert [b.ref_cnt for b in pool.blocks] == [0] * pool.num_blocks
    pool.check_invariants()


# ------------------------------------------------------------ frames (answer_frame)
class V1Layout(msgspec.Struct, frozen=True):
    """Layout as protocol version 1 encoded it (a map; `chunk_bytes`)."""

    model_name: str
    world_size: int
    worker_id: int
    fmt: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    chunk_size: int
    chunk_bytes: int


class V1Hello(msgspec.Struct, tag="hello", array_like=True):
    """HELLO as protocol version 1 encoded it (one optional layout)."""

    version: int
    pid: int
    name: str
    layout: V1Layout | None = None


def answer(service, session, message_or_payload):
    """(decoded reply or None, cost) of one frame's payload through answer_frame."""
    payload = (message_or_payload if isinstance(message_or_payload, bytes)
               else encode_frame(message_or_payload)[4:])
    frame, cost = answer_frame(service, session, memoryview(payload))
    return (None if frame is None else reply_decoder.decode(frame[4:])), cost


@pytest.mark.parametrize("v1_layout", [
    V1Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000), None
], ids=["with_layout", "admin"])
def test_a_version_1_hello_frame_gets_a_version_error(service, v1_layout):
    session = service.open_session(1, os.geteuid(), 0)
    reply, _ = answer(service, session,
                      msgspec.msgpack.encode(V1Hello(1, 1, "old client", v1_layout)))
    assert error_code(reply) == "version"
    assert "protocol version 1" in reply.message and f"speaks {PROTOCOL_VERSION}" in reply.message
    assert service.stats.errors == {"version": 1}
    assert not session.greeted


@pytest.mark.parametrize("bad_field", [
    {"num_layers": 0}, {"fmt": "onnx"}, {"worker_id": 2}, {"model_name": ""},
    {"record_bytes": -1}, {"unknown_field": 1},
], ids=lambda field: next(iter(field)))
def test_a_layout_out_of_its_schema_is_refused_by_the_decoder(service, bad_field):
    fields = msgspec.to_builtins(layout(0, 2)) | bad_field
    payload = msgspec.msgpack.encode(["hello", PROTOCOL_VERSION, 1, "t", [fields]])
    session = service.open_session(1, os.geteuid(), 0)
    reply, _ = answer(service, session, payload)
    assert error_code(reply) == "bad_request"
    assert not session.greeted and service.namespaces == {}


def test_a_release_frame_gets_no_reply(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, [0, 1])
    acquired, cost = answer(service, session, Acquire([1], chunk_hashes([0, 1])))
    assert isinstance(acquired, BlocksReply) and service.pool.num_pinned_blocks == 2
    assert answer(service, session, Release([acquired.lease])) == (None, cost)
    assert service.pool.num_pinned_blocks == 0
    assert answer(service, session, Release([acquired.lease]))[0] is None  # refused: silent
    assert service.stats.errors == {"not_owner": 1}
    assert_everything_returned(service)


@pytest.mark.parametrize("payload", [["release", ["x"]], ["release"], ["release", "x"]],
                         ids=["bad_lease", "no_field", "not_a_list"])
def test_an_undecodable_release_frame_gets_no_reply_either(service, payload):
    # its sender (Connection.send) reads no reply: an Error frame would answer its next
    # request
    session = greeted(service, LAYOUT)
    assert answer(service, session, msgspec.msgpack.encode(payload))[0] is None
    assert service.stats.errors == {"bad_request": 1}


def test_the_same_layout_twice_in_one_hello_is_refused(service):
    session = service.open_session(1, os.geteuid(), 0)
    reply = service.handle(session, Hello(PROTOCOL_VERSION, 1, "t", [LAYOUT, LAYOUT]))
    assert error_code(reply) == "bad_request" and not session.greeted


# ------------------------------------------------------------------------ LOOKUP
def test_lookup_counts_the_ready_prefix_without_pinning_or_touching(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, [0, 1])
    store(service, session, 1, [2, 3])
    order = queue_ids(service)
    assert lookup(service, session, [1], range(6)) == 4
    assert lookup(service, session, [1], [0, 1, 9, 3]) == 2
    assert lookup(service, session, [1], [9, 0]) == 0
    assert lookup(service, session, [1], []) == 0
    assert queue_ids(service) == order  # no LRU change
    assert service.pool.num_pinned_blocks == 0
    assert (service.pool.stats.hits, service.pool.stats.misses) == (0, 0)
    assert service.stats.lookups == 4


def test_lookup_of_several_namespaces_is_the_prefix_ready_in_all(service):
    session = greeted(service, *TP2)
    store(service, session, 1, range(5))
    store(service, session, 2, range(3))
    assert lookup(service, session, [1], range(5)) == 5
    assert lookup(service, session, [2], range(5)) == 3
    assert lookup(service, session, [1, 2], range(5)) == 3
    assert lookup(service, session, [2, 1], range(5)) == 3
    store(service, session, 2, [10])  # ns 2 holds 10 but not 11: the common prefix ends
    store(service, session, 1, [10, 11])
    assert lookup(service, session, [1, 2], [10, 11]) == 1
    assert lookup(service, session, [2, 1], [10, 11]) == 1


def test_lookup_refuses_a_namespace_that_is_not_this_sessions(service):
    session = greeted(service, TP2[0])
    greeted(service, TP2[1])  # namespace 2 exists, but belongs to another session
    for namespaces in ([2], [1, 2], [99]):
        reply = service.handle(session, Lookup(namespaces, chunk_hashes([0])))
        assert error_code(reply) == "bad_namespace" and "HELLO gave [1]" in reply.message
    assert error_code(service.handle(session, Lookup([], chunk_hashes([0])))) == "bad_request"
    reply = service.handle(session, Lookup([1, 1], chunk_hashes([0])))
    assert error_code(reply) == "bad_request" and "twice" in reply.message
    assert service.stats.errors == {"bad_namespace": 3, "bad_request": 2}


@pytest.mark.parametrize("request_type", [Lookup, Acquire])
@pytest.mark.parametrize("num_bytes", [1, 15, 17, 33])
def test_hashes_that_are_not_whole_digests_are_refused(service, request_type, num_bytes):
    session = greeted(service, LAYOUT)
    reply = service.handle(session, request_type([1], b"\x01" * num_bytes))
    assert error_code(reply) == "bad_request"
    assert f"{num_bytes} bytes, not a multiple of {HASH_BYTES}" in reply.message
    reply = service.handle(session, Alloc(1, b"\x01" * num_bytes, [RECORD_BYTES]))
    assert error_code(reply) == "bad_request" and service.pool.num_writing_blocks == 0


@pytest.mark.parametrize("request_type", [Lookup, Acquire])
def test_more_chunks_than_the_limit_over_all_namespaces_are_refused(service, request_type):
    session = greeted(service, *TP2)

    def ask(namespaces, num_chunks):
        return service.handle(session, request_type(namespaces, bytes(HASH_BYTES * num_chunks)))

    assert error_code(ask([1], MAX_CHUNKS_PER_REQUEST + 1)) == "bad_request"
    reply = ask([1, 2], MAX_CHUNKS_PER_REQUEST // 2 + 1)
    assert error_code(reply) == "bad_request" and "split it" in reply.message
    assert error_code(ask([1], MAX_CHUNKS_PER_REQUEST)) is None  # at the limit: answered
    assert error_code(ask([1, 2], MAX_CHUNKS_PER_REQUEST // 2)) is None
    reply = service.handle(session, Alloc(1, bytes(HASH_BYTES * (MAX_CHUNKS_PER_REQUEST + 1)),
                                          [1] * (MAX_CHUNKS_PER_REQUEST + 1)))
    assert error_code(reply) == "bad_request" and service.pool.num_writing_blocks == 0


# ----------------------------------------------------------------------- ACQUIRE
def test_acquire_pins_the_ready_prefix_under_one_lease(service):
    session = greeted(service, LAYOUT)
    blocks = store(service, session, 1, range(3))
    reply = service.handle(session, Acquire([1], chunk_hashes(range(5))))
    assert reply.lease >= 1
    assert (reply.block_ids, reply.span_lengths, reply.num_bytes) == (
        blocks, [1, 1, 1], [RECORD_BYTES] * 3)
    assert list(session.leases) == [reply.lease]
    assert ref_cnts(service, blocks) == [1, 1, 1]
    assert not set(blocks) & set(queue_ids(service))  # pinned blocks are not evictable
    assert (service.pool.stats.hits, service.pool.stats.misses) == (3, 2)
    stats = service.handle(session, Info("stats")).sections["stats"]
    assert (stats["hits"], stats["misses"], stats["hit_rate"]) == (3, 2, 0.6)
    assert_everything_returned(service)


def test_acquire_of_a_miss_takes_no_lease(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, [0])
    reply = service.handle(session, Acquire([1], chunk_hashes([7, 0])))
    assert reply == BlocksReply(0, [], [], [])
    assert session.leases == {} and service.pool.num_pinned_blocks == 0
    assert (service.pool.stats.hits, service.pool.stats.misses) == (0, 2)
    assert service.handle(session, Acquire([1], b"")) == BlocksReply(0, [], [], [])
    assert_everything_returned(service)


def test_acquire_moves_its_values_to_the_most_recently_used_end(service):
    session = greeted(service, LAYOUT)
    (a,) = store(service, session, 1, [0])
    (b,) = store(service, session, 1, [1])
    (c,) = store(service, session, 1, [2])
    assert queue_ids(service)[-3:] == [a, b, c]  # least recently used first
    lease = service.handle(session, Acquire([1], chunk_hashes([0]))).lease
    assert a not in queue_ids(service)
    # While pinned, no allocation can take it: 13 empty blocks and b, c are all there is.
    alloc = service.handle(session, Alloc(1, chunk_hashes(range(100, 116)), [1] * 16))
    assert alloc.status == [ALLOCATED] * 15 + [NOSPACE]
    assert lookup(service, session, [1], [0]) == 1
    assert lookup(service, session, [1], [1]) == lookup(service, session, [1], [2]) == 0
    assert service.handle(session, Abort(alloc.block_ids)) == Ok()
    store(service, session, 1, [1])
    (c,) = store(service, session, 1, [2])
    service.handle(session, Release([lease]))
    assert queue_ids(service)[-2:] == [c, a]  # the acquired value is now the most recent
    assert_everything_returned(service)


def test_acquire_of_several_namespaces_returns_values_namespace_major(service):
    session = greeted(service, *TP2)
    a = store(service, session, 1, range(3))
    b = store(service, session, 2, range(2))
    reply = service.handle(session, Acquire([1, 2], chunk_hashes(range(3))))
    assert reply.block_ids == a[:2] + b  # the common prefix (2 chunks) of ns 1, then ns 2
    assert reply.span_lengths == [1] * 4 and reply.num_bytes == [RECORD_BYTES] * 4
    assert reply.spans() == [[block] for block in a[:2] + b]
    reversed_order = service.handle(session, Acquire([2, 1], chunk_hashes(range(3))))
    assert reversed_order.block_ids == b + a[:2]
    assert ref_cnts(service, a + b) == [2, 2, 0, 2, 2]
    assert (service.pool.stats.hits, service.pool.stats.misses) == (8, 4)  # 1 miss per ns
    service.handle(session, Release([reply.lease, reversed_order.lease]))
    assert ref_cnts(service, a + b) == [0] * 5 and session.leases == {}
    assert_everything_returned(service)


def test_lease_ids_are_unique_across_sessions_and_die_with_their_session(service):
    one, two = greeted(service, LAYOUT), greeted(service, LAYOUT)
    blocks = store(service, one, 1, [0, 1])
    first = service.handle(one, Acquire([1], chunk_hashes([0]))).lease
    second = service.handle(two, Acquire([1], chunk_hashes([0, 1]))).lease
    third = service.handle(one, Acquire([1], chunk_hashes([0, 1]))).lease
    assert len({first, second, third}) == 3 and 0 not in {first, second, third}
    service.close_session(one)
    assert ref_cnts(service, blocks) == [1, 1]  # only session two's pins are left
    three = greeted(service, LAYOUT)
    fourth = service.handle(three, Acquire([1], chunk_hashes([1]))).lease
    assert fourth not in {first, second, third}
    for session in (two, three):  # a lease of an ended session is valid nowhere
        assert service.handle(session, Release([first])) is None
        assert service.handle(session, Release([third])) is None
    assert service.stats.errors == {"not_owner": 4}
    assert ref_cnts(service, blocks) == [1, 2]
    assert_everything_returned(service)


def test_an_acquire_whose_reply_exceeds_the_frame_limit_keeps_no_pins(make_service):
    # answer_frame withdraws the lease of a reply it cannot send: the client never
    # learns its id, so its pins would otherwise last until the session ends.
    service = make_service(capacity_bytes=HEADER_BYTES + 32 * 4096, block_bytes=4096)
    session = greeted(service, layout(record_bytes=16 * 4096))
    alloc = service.handle(session, Alloc(1, chunk_hashes([1]), [16 * 4096]))
    service.handle(session, Commit(alloc.block_ids))
    # 60,000 times one 16-block value: a legal request frame, a reply of ~1.3 MB. The
    # session's share counts those 16 blocks once, however often it pins them.
    reply, _ = answer(service, session, Acquire([1], chunk_hashes([1]) * 60_000))
    assert isinstance(reply, Error)  # too_large
    assert service.pool.num_pinned_blocks == 0  # scalars only: a repr of the pins is huge
    assert len(session.leases) == 0


# ----------------------------------------------------------------------- RELEASE
def test_release_unpins_tail_first_and_answers_nothing(service):
    session = greeted(service, LAYOUT)
    chain = store(service, session, 1, range(3))
    (other,) = store(service, session, 1, [10])
    assert queue_ids(service)[-4:] == chain[::-1] + [other]
    lease = service.handle(session, Acquire([1], chunk_hashes(range(3)))).lease
    assert service.handle(session, Release([lease])) is None
    assert session.leases == {} and ref_cnts(service, chain) == [0, 0, 0]
    # the end of the chain is evicted before its beginning, both after `other`
    assert queue_ids(service)[-4:] == [other] + chain[::-1]
    assert service.pool.num_pinned_blocks == 0 and service.stats.errors == {}
    assert service.handle(session, Release([])) is None and service.stats.errors == {}
    assert_everything_returned(service)


def test_release_of_a_lease_not_held_is_counted_and_changes_nothing(service):
    one, two = greeted(service, LAYOUT), greeted(service, LAYOUT)
    blocks = store(service, one, 1, [0])
    mine = service.handle(one, Acquire([1], chunk_hashes([0]))).lease
    theirs = service.handle(two, Acquire([1], chunk_hashes([0]))).lease
    refused = [[theirs], [mine + theirs + 100], [mine, mine], [mine, theirs], [0]]
    for leases in refused:
        assert service.handle(one, Release(leases)) is None
        assert ref_cnts(service, blocks) == [2], leases  # all or nothing
    assert service.stats.errors == {"not_owner": len(refused)}
    stats = service.handle(one, Info("stats")).sections["stats"]
    assert stats["errors_not_owner"] == len(refused)
    assert service.handle(one, Release([mine])) is None
    assert service.handle(one, Release([mine])) is None  # repeated: refused
    assert service.stats.errors == {"not_owner": len(refused) + 1}
    assert ref_cnts(service, blocks) == [1] and list(two.leases) == [theirs]
    assert_everything_returned(service)


# ------------------------------------------------------------------------- ALLOC
def test_alloc_answers_allocated_exists_and_nospace(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, [0])
    store(service, session, 1, [1])  # chunk 0 is now the least recently used
    new = list(range(100, 116))
    alloc = service.handle(session, Alloc(1, chunk_hashes([0] + new), [RECORD_BYTES] * 17))
    # 14 empty blocks, then the LRU value that is not part of this ALLOC (chunk 1): an
    # ALLOC never evicts a chunk it reports EXISTS.
    assert alloc.status == [EXISTS] + [ALLOCATED] * 15 + [NOSPACE]
    assert alloc.span_lengths == [1] * 15 and len(set(alloc.block_ids)) == 15
    assert alloc.spans()[0] is None and alloc.spans()[-1] is None
    assert lookup(service, session, [1], [0]) == 1 and lookup(service, session, [1], [1]) == 0
    assert service.pool.stats.evictions == 1
    assert service.pool.num_writing_blocks == 15 and session.num_writing_blocks == 15
    assert all(service.pool.blocks[i].state == BlockState.WRITING for i in alloc.block_ids)
    assert lookup(service, session, [1], new) == 0  # WRITING is invisible to readers
    assert_everything_returned(service)


def test_alloc_answers_nospace_while_every_block_is_pinned(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, range(NUM_BLOCKS))
    service.handle(session, Acquire([1], chunk_hashes(range(NUM_BLOCKS))))
    alloc = service.handle(session, Alloc(1, chunk_hashes([99, 3, 98]), [1, 1, 1]))
    assert alloc == AllocReply([NOSPACE, EXISTS, NOSPACE], [], [])
    assert service.pool.num_writing_blocks == 0 and service.pool.stats.evictions == 0
    assert_everything_returned(service)


def test_alloc_of_records_larger_than_a_block_reports_span_lengths(service):
    session = greeted(service, layout(record_bytes=150_000))
    sizes = [150_000, RECORD_BYTES, BLOCK_BYTES]
    alloc = service.handle(session, Alloc(1, chunk_hashes(range(3)), sizes))
    assert alloc.status == [ALLOCATED] * 3 and alloc.span_lengths == [3, 1, 1]
    spans = alloc.spans()
    assert [len(span) for span in spans] == [3, 1, 1] and len(set(alloc.block_ids)) == 5
    # COMMIT of one block of a value commits all of its blocks.
    assert service.handle(session, Commit([span[0] for span in spans])) == Ok()
    assert service.pool.num_writing_blocks == 0 and service.pool.num_cached_blocks == 5
    reply = service.handle(session, Acquire([1], chunk_hashes(range(3))))
    assert (reply.block_ids, reply.span_lengths, reply.num_bytes) == (
        alloc.block_ids, [3, 1, 1], sizes)
    assert reply.spans() == spans
    assert_everything_returned(service)


@pytest.mark.parametrize("num_bytes", [[0, 1], [1, -5], [1], [1, 1, 1]])
def test_alloc_refuses_num_bytes_that_are_not_one_positive_size_per_hash(service, num_bytes):
    session = greeted(service, LAYOUT)
    reply = service.handle(session, Alloc(1, chunk_hashes([0, 1]), num_bytes))
    assert error_code(reply) == "bad_request" and "num_bytes" in reply.message
    assert service.pool.num_writing_blocks == 0 and session.writing == {}


@pytest.mark.parametrize("num_parents", [1, 3])
def test_alloc_refuses_parents_that_are_not_one_hash_per_chunk(service, num_parents):
    """`parents` is one HASH_BYTES hash per chunk or empty: any other length is refused
    before anything is allocated or evicted, and the refusal names the sizes."""
    session = greeted(service, LAYOUT)
    store(service, session, 1, range(NUM_BLOCKS))  # full: an ALLOC would evict
    for parents in (chunk_hashes(range(num_parents)), chunk_hashes([0, 1])[:-1]):
        reply = service.handle(session, Alloc(1, chunk_hashes([50, 51]), [1, 1], 0, parents))
        assert error_code(reply) == "bad_request"
        assert f"parents is {len(parents)} bytes" in reply.message, reply.message
        assert f"({2 * HASH_BYTES} bytes)" in reply.message, reply.message
    assert service.pool.num_writing_blocks == 0 and session.writing == {}
    assert service.pool.stats.evictions == 0
    assert lookup(service, session, [1], range(NUM_BLOCKS)) == NUM_BLOCKS
    assert_everything_returned(service)


def test_alloc_refuses_a_namespace_that_is_not_this_sessions(service):
    session = greeted(service, TP2[0])
    greeted(service, TP2[1])
    assert error_code(service.handle(session, Alloc(2, chunk_hashes([0]), [1]))) == "bad_namespace"
    assert service.pool.num_writing_blocks == 0


# ---------------------------------------------------------------- COMMIT / ABORT
def test_commit_and_abort_only_what_this_session_allocated(service):
    one, two = greeted(service, LAYOUT), greeted(service, LAYOUT)
    mine = service.handle(one, Alloc(1, chunk_hashes([0]), [RECORD_BYTES])).block_ids
    theirs = service.handle(two, Alloc(1, chunk_hashes([1]), [RECORD_BYTES])).block_ids
    for request in (Commit(theirs), Abort(theirs), Commit(mine + theirs), Commit([10_000])):
        assert error_code(service.handle(one, request)) == "not_owner"
    assert service.stats.errors == {"not_owner": 4}
    assert service.pool.num_writing_blocks == 2  # all or nothing: nothing changed
    assert service.handle(one, Commit(mine)) == Ok()
    assert lookup(service, one, [1], [0]) == 1 and service.stats.stores == 1
    assert error_code(service.handle(one, Commit(mine))) == "not_owner"  # already done
    assert error_code(service.handle(one, Abort(mine))) == "not_owner"
    assert service.handle(two, Abort(theirs)) == Ok()
    assert service.pool.blocks[theirs[0]].state == BlockState.FREE
    assert queue_ids(service)[0] == theirs[0]  # an aborted block is the first reused
    assert lookup(service, two, [1], [1]) == 0
    assert error_code(service.handle(two, Commit(theirs))) == "not_owner"
    assert_everything_returned(service)


def test_the_same_chunk_committed_by_two_sessions_is_stored_once(service):
    one, two = greeted(service, LAYOUT), greeted(service, LAYOUT)
    first = service.handle(one, Alloc(1, chunk_hashes([0]), [RECORD_BYTES]))
    second = service.handle(two, Alloc(1, chunk_hashes([0]), [RECORD_BYTES]))
    assert first.status == second.status == [ALLOCATED]  # neither is READY yet
    assert first.block_ids != second.block_ids
    assert service.handle(two, Commit(second.block_ids)) == Ok()
    assert service.handle(one, Commit(first.block_ids)) == Ok()  # loses: its blocks freed
    assert service.stats.stores == 1 and service.pool.num_cached_blocks == 1
    assert service.pool.blocks[first.block_ids[0]].state == BlockState.FREE
    assert service.pool.num_writing_blocks == 0
    assert service.handle(one, Acquire([1], chunk_hashes([0]))).block_ids == second.block_ids
    assert_everything_returned(service)


def test_session_end_releases_pins_and_aborts_writes(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, range(3))
    service.handle(session, Acquire([1], chunk_hashes(range(3))))
    service.handle(session, Get(1, "missing"))
    service.handle(session, Alloc(1, chunk_hashes(range(10, 12)), [RECORD_BYTES] * 2))
    service.handle(session, Put(1, "key", 150_000))
    assert service.pool.num_pinned_blocks == 3 and service.pool.num_writing_blocks == 5
    service.close_session(session)
    assert service.pool.num_pinned_blocks == 0 and service.pool.num_writing_blocks == 0
    assert service.pool.num_cached_blocks == 3 and service.sessions == {}
    assert_everything_returned(service)


def test_restore_of_cached_chunks_leaves_no_pins(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, range(4))
    again = service.handle(session, Alloc(1, chunk_hashes(range(6)), [RECORD_BYTES] * 6))
    assert again.status == [EXISTS] * 4 + [ALLOCATED] * 2
    service.handle(session, Commit(again.block_ids))
    assert service.pool.num_pinned_blocks == 0
    assert service.pool.num_cached_blocks == 6
    assert_everything_returned(service)


# ------------------------------------------------------- PUT / GET / DELETE / SCAN
def test_put_then_get_returns_the_value_under_a_lease(service):
    session = greeted(service, layout(fmt="kv"))
    reply = service.handle(session, Put(1, "key", 1234))
    assert reply.status == [ALLOCATED] and reply.span_lengths == [1]
    assert service.handle(session, Get(1, "key")) == BlocksReply(0, [], [], [])  # WRITING
    assert service.handle(session, Commit(reply.block_ids)) == Ok()
    got = service.handle(session, Get(1, "key"))
    assert got.lease >= 1 and (got.block_ids, got.num_bytes) == (reply.block_ids, [1234])
    assert ref_cnts(service, reply.block_ids) == [1] and list(session.leases) == [got.lease]
    assert service.handle(session, Release([got.lease])) is None
    assert ref_cnts(service, reply.block_ids) == [0]
    assert service.handle(session, Get(1, "other")) == BlocksReply(0, [], [], [])
    assert_everything_returned(service)


def test_put_replaces_on_commit_and_old_readers_keep_their_blocks(service):
    session = greeted(service, LAYOUT)
    old = put(service, session, 1, "key", 1000)
    reader = service.handle(session, Get(1, "key"))
    new = put(service, session, 1, "key", 150_000)
    got = service.handle(session, Get(1, "key"))
    assert (got.block_ids, got.span_lengths, got.num_bytes) == (new, [3], [150_000])
    assert ref_cnts(service, old) == [1]  # the old value's reader still holds its bytes
    assert service.pool.num_detached_blocks == 1 and service.pool.num_cached_blocks == 3
    service.handle(session, Release([reader.lease]))
    assert service.pool.blocks[old[0]].state == BlockState.FREE
    assert service.pool.num_detached_blocks == 0
    assert_everything_returned(service)


def test_put_refuses_bad_values_and_answers_nospace(service):
    session = greeted(service, LAYOUT)
    assert error_code(service.handle(session, Put(1, "", 10))) == "bad_request"
    reply = service.handle(session, Put(1, "key", 0))
    assert error_code(reply) == "bad_request" and "num_bytes" in reply.message
    assert error_code(service.handle(session, Put(2, "key", 10))) == "bad_namespace"
    too_big = service.handle(session, Put(1, "key", NUM_BLOCKS * BLOCK_BYTES + 1))
    assert error_code(too_big) == "bad_request"
    assert f"{NUM_BLOCKS * BLOCK_BYTES + 1}-byte value" in too_big.message
    assert f"at most {NUM_BLOCKS * BLOCK_BYTES} bytes" in too_big.message
    held = service.handle(session, Put(1, "held", NUM_BLOCKS * BLOCK_BYTES - 1))
    assert held.status == [ALLOCATED]  # every block WRITING: nothing left for another
    assert service.handle(session, Put(1, "key", 1)) == AllocReply([NOSPACE], [], [])
    assert service.handle(session, Abort(held.block_ids)) == Ok()
    assert service.pool.num_writing_blocks == 0


def test_delete_removes_a_key_now_and_its_readers_keep_their_bytes(service):
    session = greeted(service, LAYOUT)
    blocks = put(service, session, 1, "key")
    reader = service.handle(session, Get(1, "key"))
    assert service.handle(session, Delete(1, "key")) == CountReply(1)
    assert service.handle(session, Get(1, "key")) == BlocksReply(0, [], [], [])
    assert service.handle(session, Delete(1, "key")) == CountReply(0)
    assert ref_cnts(service, blocks) == [1] and service.pool.num_detached_blocks == 1
    service.handle(session, Release([reader.lease]))
    assert service.pool.blocks[blocks[0]].state == BlockState.FREE
    assert error_code(service.handle(session, Delete(1, ""))) == "bad_request"
    assert_everything_returned(service)
