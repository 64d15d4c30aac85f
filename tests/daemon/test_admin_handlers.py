"""The admin requests of `CacheService` in process: SCAN, INFO, CLIENTS, EVICT, CLEAR,
PING, CONFIG GET, SHUTDOWN, and who may send them (lmcached/daemon/admin_handlers.py).
Its helpers and fixtures live in test_service.py.
"""

import itertools
import os

import msgspec
import pytest

from lmcached.daemon.admin_handlers import (
    CLIENT_ROW_UNITS,
    MAX_CLIENTS_PER_PAGE,
    MAX_SCAN_COUNT,
    MAX_SCAN_KEYS,
    SCAN_BLOCKS_PER_UNIT,
    SCAN_DEFAULT_COUNT,
)
from lmcached.daemon.connection import answer_frame
from lmcached.daemon.info import INFO_SECTIONS
from lmcached.shm.arena import HEADER_BYTES
from lmcached.wire.frames import reply_decoder, request_decoder
from lmcached.wire.protocol import (
    HASH_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Acquire,
    Alloc,
    BlocksReply,
    Clear,
    Clients,
    ClientsReply,
    Commit,
    ConfigGet,
    CountReply,
    Delete,
    Evict,
    Get,
    Info,
    InfoReply,
    KeysReply,
    Lookup,
    Ok,
    Ping,
    Put,
    Release,
    Scan,
    Shutdown,
)
from test_service import (  # noqa: F401 (make_service and service are fixtures)
    BLOCK_BYTES,
    LAYOUT,
    NUM_BLOCKS,
    OTHER_UID,
    RECORD_BYTES,
    SMALL_ARENA_BYTES,
    TP2,
    assert_everything_returned,
    chunk_hashes,
    error_code,
    greeted,
    layout,
    lookup,
    make_service,
    put,
    service,
    store,
)


def test_scan_lists_string_keys_of_one_namespace_by_prefix_up_to_limit(service):
    session = greeted(service, *TP2)
    for key in ("a/1", "a/2", "b/1"):
        put(service, session, 1, key)
    put(service, session, 2, "a/3")
    store(service, session, 1, [0])  # a chunk is not a string key
    service.handle(session, Put(1, "a/writing", 10))  # not committed: not listed

    def scan(ns, prefix, limit=100):
        reply = service.handle(session, Scan(ns, prefix, limit))
        assert isinstance(reply, KeysReply), reply
        return reply.keys

    assert sorted(scan(1, "a/")) == ["a/1", "a/2"]
    assert sorted(scan(1, "")) == ["a/1", "a/2", "b/1"]
    assert scan(2, "") == ["a/3"]
    assert scan(1, "c") == []
    limited = scan(1, "", 2)
    assert len(limited) == 2 and set(limited) <= {"a/1", "a/2", "b/1"}
    assert scan(1, "", 0) == [] and scan(1, "", -1) == []
    other = greeted(service, TP2[0])
    assert error_code(service.handle(other, Scan(2, "", 10))) == "bad_namespace"
    assert_everything_returned(service)


def test_scan_pages_through_blocks_with_a_cursor_and_lists_each_value_once(make_service):
    """SCAN after Redis's: each page walks at most `count` blocks from `cursor`, is
    priced by them, and a key cached for the whole scan comes exactly once, whatever
    is stored or evicted meanwhile; the pre-cursor request shape gets the first page."""
    num_blocks = MAX_SCAN_COUNT + SCAN_DEFAULT_COUNT
    service = make_service(HEADER_BYTES + num_blocks * 4096, 4096)
    session = greeted(service, layout(fmt="kv"))
    stay = {f"k/{i}" for i in range(0, num_blocks, 7)}
    for i in range(num_blocks - 1):
        if f"k/{i}" in stay:
            put(service, session, 1, f"k/{i}", 5000 if i == 700 else 100)  # 700: 2 blocks
        else:
            put(service, session, 1, f"x/{i}", 100)  # fills the rest: no free block left

    def page(cursor, count=0, limit=MAX_SCAN_KEYS, prefix="k/"):
        reply = service.handle(session, Scan(1, prefix, limit, cursor, count))
        assert isinstance(reply, KeysReply), reply
        return reply

    first = page(0, 100)
    assert first.cursor == 100 and service.work_units == 1 + 100 // SCAN_BLOCKS_PER_UNIT
    listed, cursor, pages = [], 0, 0
    churn = iter(i for i in range(num_blocks) if f"k/{i}" not in stay)
    while True:
        reply = page(cursor, 500)
        listed += reply.keys
        pages += 1
        assert service.work_units <= 1 + 500 // SCAN_BLOCKS_PER_UNIT
        for i in itertools.islice(churn, 3):  # values come and go between pages
            assert service.handle(session, Delete(1, f"x/{i}")) == CountReply(1)
            put(service, session, 1, f"new/{i}", 100)  # in the block just emptied
        if not reply.cursor:
            break
        cursor = reply.cursor
    assert pages == -(-num_blocks // 500)
    assert sorted(listed) == sorted(stay)  # each once: no duplicate, none missing
    legacy = request_decoder.decode(msgspec.msgpack.encode(["scan", 1, "", MAX_SCAN_KEYS]))
    reply = service.handle(session, legacy)  # three fields: the first default page
    assert reply.cursor == SCAN_DEFAULT_COUNT
    assert service.work_units == 1 + SCAN_DEFAULT_COUNT // SCAN_BLOCKS_PER_UNIT
    assert page(0, 10**9).cursor == MAX_SCAN_COUNT  # a larger count is capped
    limited = page(0, limit=3)
    assert len(limited.keys) == 3 and limited.cursor == 15  # stops at the third key
    assert page(limited.cursor, limit=1).keys == ["k/21"]
    assert page(num_blocks) == KeysReply([], 0) and page(10**12) == KeysReply([], 0)
    assert_everything_returned(service)


def test_scan_refuses_a_negative_cursor_or_count(service):
    session = greeted(service, LAYOUT)
    for bad in (["scan", 1, "", 10, -1, 0], ["scan", 1, "", 10, 0, -5]):
        reply = answer_frame(service, session, msgspec.msgpack.encode(bad))[0]
        assert error_code(reply_decoder.decode(reply[4:])) == "bad_request"


# ------------------------------------------------------------------- INFO, CLIENTS
def test_info_reports_every_section_from_the_service_state(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, [0, 1])
    service.handle(session, Acquire([1], chunk_hashes([0, 5])))
    service.handle(session, Alloc(1, chunk_hashes([2]), [RECORD_BYTES]))
    service.handle(session, Alloc(1, chunk_hashes([3]), [0]))  # refused: bad_request
    lookup(service, session, [1], [0])
    reply = service.handle(session, Info())
    assert isinstance(reply, InfoReply) and list(reply.sections) == list(INFO_SECTIONS)
    server, memory, blocks, clients, stats, l2, disk, tenants = (
        reply.sections[name] for name in INFO_SECTIONS)
    assert l2 == {"l2_enabled": 0} and disk == {"disk_enabled": 0}  # no --l2, --disk-path
    assert server["protocol_version"] == PROTOCOL_VERSION
    assert (server["name"], server["socket"]) == (service.arena.name, "/nonexistent")
    assert (server["generation"], server["pid"]) == (service.arena.generation, os.getpid())
    assert server["shm_segment"] == service.arena.segment_name
    assert memory["capacity_bytes"] == SMALL_ARENA_BYTES
    assert memory["block_bytes"] == BLOCK_BYTES and memory["block_human"] == "64.00K"
    assert memory["used_bytes"] == 3 * BLOCK_BYTES  # 2 cached + 1 writing
    assert memory["stored_bytes"] == 2 * RECORD_BYTES
    assert blocks == {"num_blocks": NUM_BLOCKS, "free_blocks": 13, "cached_blocks": 2,
                      "pinned_blocks": 1, "writing_blocks": 1, "detached_blocks": 0,
                      "evictable_blocks": 1, "cached_values": 2}
    assert clients == {"connected_clients": 1, "namespaces": 1, "namespaces_sglang": 0,
                       "namespaces_freed": 0}
    assert stats["requests"] == service.stats.requests == 8  # HELLO .. this INFO
    assert (stats["lookups"], stats["stores"], stats["hits"], stats["misses"]) == (1, 2, 1, 1)
    assert (stats["errors"], stats["errors_bad_request"]) == (1, 1)
    assert tenants == {"tenants_tracked": 0, "tenants_max": 64, "tenant_unsalted_hits": 1,
                       "tenant_unsalted_misses": 1, "tenant_unsalted_lookups": 1,
                       "tenant_other_hits": 0, "tenant_other_misses": 0,
                       "tenant_other_lookups": 0}
    assert service.handle(session, Info("BLOCKS")).sections == {"blocks": blocks}
    assert_everything_returned(service)


def test_info_of_an_unknown_section_lists_the_sections(service):
    session = greeted(service)
    reply = service.handle(session, Info("keyspace"))
    assert error_code(reply) == "bad_request" and "'keyspace'" in reply.message
    assert all(name in reply.message for name in INFO_SECTIONS)


def test_clients_lists_one_row_per_session(service):
    admin = greeted(service)
    worker = greeted(service, *TP2)
    store(service, worker, 1, [0, 1])
    service.handle(worker, Acquire([1, 2], chunk_hashes([0])))  # ns 2 misses: no pin
    service.handle(worker, Get(1, "none"))
    service.handle(worker, Alloc(2, chunk_hashes([0]), [RECORD_BYTES]))
    reply = service.handle(admin, Clients())
    assert isinstance(reply, ClientsReply)
    rows = {row["id"]: row for row in reply.clients}
    assert set(rows) == {admin.session_id, worker.session_id}
    assert rows[admin.session_id]["ns"] == "-" and rows[worker.session_id]["ns"] == "1,2"
    assert {k: rows[worker.session_id][k] for k in ("pid", "uid", "name", "pinned_blocks",
                                                   "writing_blocks", "requests")} == {
        "pid": os.getpid(), "uid": os.geteuid(), "name": "test", "pinned_blocks": 0,
        "writing_blocks": 1, "requests": 6}
    assert rows[admin.session_id]["requests"] == 2
    assert_everything_returned(service)


def test_clients_pages_through_sessions_by_id_priced_per_row(service):
    sessions = [greeted(service) for _ in range(2 * MAX_CLIENTS_PER_PAGE + 3)]
    admin = sessions[0]
    first = service.handle(admin, Clients())  # no cursor (before the cursor): first page
    assert [row["id"] for row in first.clients] == [
        s.session_id for s in sessions[:MAX_CLIENTS_PER_PAGE]]
    assert first.cursor == sessions[MAX_CLIENTS_PER_PAGE - 1].session_id + 1
    assert service.work_units == CLIENT_ROW_UNITS * MAX_CLIENTS_PER_PAGE
    for ended in sessions[MAX_CLIENTS_PER_PAGE : MAX_CLIENTS_PER_PAGE + 2]:
        service.close_session(ended)  # gone between two pages: the cursor still works
    later = greeted(service)  # opened during the listing: listed at the end
    rows, cursor = list(first.clients), first.cursor
    while cursor:
        reply = service.handle(admin, Clients(cursor, 5))
        assert len(reply.clients) <= 5 and service.work_units <= 5 * CLIENT_ROW_UNITS
        rows += reply.clients
        cursor = reply.cursor
    assert [row["id"] for row in rows] == [s.session_id for s in sessions if s.session_id
                                           in service.sessions] + [later.session_id]
    assert service.handle(admin, Clients(10**9)) == ClientsReply([], 0)
    assert service.work_units == 1
    assert len(service.handle(admin, Clients(0, 10**6)).clients) == MAX_CLIENTS_PER_PAGE


# ---------------------------------------------------------------- EVICT, CLEAR, admin
def test_evict_lru_removes_the_least_recently_used_unpinned_values(service):
    session = greeted(service, LAYOUT)
    for i in range(4):
        store(service, session, 1, [i])
    service.handle(session, Acquire([1], chunk_hashes([0])))  # pinned: never evicted
    assert service.handle(session, Evict(lru=2)) == CountReply(2)
    assert [lookup(service, session, [1], [i]) for i in range(4)] == [1, 0, 0, 1]
    assert service.handle(session, Evict(lru=5)) == CountReply(1)
    assert [lookup(service, session, [1], [i]) for i in range(4)] == [1, 0, 0, 0]
    assert service.handle(session, Evict(lru=0)) == CountReply(0)
    assert error_code(service.handle(session, Evict(lru=-1))) == "bad_request"
    assert service.pool.stats.evictions == 3
    assert_everything_returned(service)


def test_evict_key_removes_a_string_key_or_a_chunk_in_every_namespace(service):
    session = greeted(service, *TP2)
    store(service, session, 1, [7, 8])
    store(service, session, 2, [7])
    put(service, session, 1, "key")
    assert service.handle(session, Evict(key=chunk_hashes([7]).hex())) == CountReply(2)
    assert lookup(service, session, [1], [8]) == 1  # other chunks stay
    assert lookup(service, session, [1], [7]) == lookup(service, session, [2], [7]) == 0
    assert service.handle(session, Evict(key="key")) == CountReply(1)
    assert service.handle(session, Get(1, "key")) == BlocksReply(0, [], [], [])
    assert service.handle(session, Evict(key="missing")) == CountReply(0)
    assert service.handle(session, Evict(key="zz" * HASH_BYTES)) == CountReply(0)
    assert service.pool.num_cached_blocks == 1
    assert_everything_returned(service)


def test_clear_evicts_every_value_and_a_pinned_one_stays_with_its_reader(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, range(3))
    put(service, session, 1, "key")
    lease = service.handle(session, Acquire([1], chunk_hashes([1]))).lease
    assert service.handle(session, Clear()) == CountReply(4)
    pool = service.pool
    assert pool.num_cached_blocks == 0 and lookup(service, session, [1], [1]) == 0
    assert pool.num_detached_blocks == 1  # its reader keeps its bytes until it releases
    service.handle(session, Release([lease]))
    assert service.handle(session, Clear()) == CountReply(0)
    assert pool.num_cached_blocks == 0 and pool.num_empty_blocks == NUM_BLOCKS
    assert_everything_returned(service)


def test_evict_and_clear_before_any_layout_remove_nothing(make_service):
    service = make_service(capacity_bytes=8 << 20, block_bytes=0)
    session = greeted(service)
    assert service.handle(session, Evict(lru=3)) == CountReply(0)
    assert service.handle(session, Evict(key="key")) == CountReply(0)
    assert service.handle(session, Clear()) == CountReply(0)


def test_ping_config_get_and_shutdown(make_service):
    service = make_service(config_block_bytes=BLOCK_BYTES)
    session = service.open_session(1, os.geteuid(), 0)  # admin requests need no HELLO
    assert service.handle(session, Ping()) == Ok()
    config = service.handle(session, ConfigGet())
    assert isinstance(config, InfoReply) and list(config.sections) == ["config"]
    assert config.sections["config"]["name"] == service.arena.name
    assert config.sections["config"]["socket"] == "/nonexistent"
    assert config.sections["config"]["block_bytes"] == BLOCK_BYTES
    assert not service.stop_requested
    assert service.handle(session, Shutdown()) == Ok()
    assert service.stop_requested


@pytest.mark.parametrize(("request_", "num_cached_after"), [
    (Evict(lru=10), 0), (Evict(key="key"), 1), (Clear(), 0), (Shutdown(), 2),
], ids=["evict_lru", "evict_key", "clear", "shutdown"])
def test_privileged_requests_of_another_uid_are_forbidden(service, request_, num_cached_after):
    owner = greeted(service, LAYOUT)
    put(service, owner, 1, "key")
    store(service, owner, 1, [0])
    stranger = greeted(service, LAYOUT, uid=OTHER_UID)
    reply = service.handle(stranger, request_)
    assert error_code(reply) == "forbidden" and f"not to uid {OTHER_UID}" in reply.message
    assert service.pool.num_cached_blocks == 2 and not service.stop_requested
    assert service.stats.errors == {"forbidden": 1}
    for allowed in (Info("clients"), Clients(), Ping(), ConfigGet()):
        assert error_code(service.handle(stranger, allowed)) is None
    root = greeted(service, uid=0)
    assert error_code(service.handle(root, request_)) is None
    assert service.pool.num_cached_blocks == num_cached_after
    assert service.stop_requested == isinstance(request_, Shutdown)
    assert error_code(service.handle(owner, request_)) is None  # the daemon's own uid
    assert_everything_returned(service)


DATA_REQUESTS = [
    Lookup([1], chunk_hashes([0])), Acquire([1], chunk_hashes([0])),
    Alloc(1, chunk_hashes([0]), [1]), Commit([0]), Abort([0]), Put(1, "k", 1),
    Get(1, "k"), Delete(1, "k"), Scan(1, "", 10),
]


@pytest.mark.parametrize("request_", DATA_REQUESTS, ids=lambda r: type(r).__name__)
def test_data_requests_before_hello_get_no_session(service, request_):
    greeted(service, LAYOUT)  # namespace 1 exists, but not for this session
    session = service.open_session(1, os.geteuid(), 0)
    reply = service.handle(session, request_)
    assert error_code(reply) == "no_session" and "HELLO" in reply.message
    assert service.stats.errors == {"no_session": 1}
    assert service.pool.num_writing_blocks == 0 and session.leases == {}


def test_release_before_hello_is_counted_without_a_reply(service):
    session = service.open_session(1, os.geteuid(), 0)
    assert service.handle(session, Release([1])) is None
    assert service.stats.errors == {"no_session": 1}
