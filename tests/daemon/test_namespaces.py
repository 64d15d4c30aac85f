"""HELLO and the namespace registry of `CacheService` in process: layouts registered,
bounded, freed, and the block size a first layout may set (lmcached/daemon/namespaces.py).
Its helpers and fixtures live in test_service.py.
"""

import logging
import os

import pytest

from lmcached.daemon.namespaces import (
    MAX_DERIVED_BLOCKS,
    MAX_LAYOUTS_PER_SESSION,
    MAX_NAMESPACES,
    MIN_DERIVED_BLOCKS,
    NamespaceRegistry,
)
from lmcached.shm.arena import HEADER_BYTES
from lmcached.wire.protocol import (
    ALLOCATED,
    PROTOCOL_VERSION,
    Acquire,
    Alloc,
    CountReply,
    Evict,
    Hello,
    HelloReply,
    Info,
    Layout,
    Lookup,
    Ok,
    Ping,
    TierInfo,
)
from test_service import (  # noqa: F401 (make_service and service are fixtures)
    BLOCK_BYTES,
    LAYOUT,
    NUM_BLOCKS,
    SMALL_ARENA_BYTES,
    TP2,
    assert_everything_returned,
    chunk_hashes,
    error_code,
    greet,
    greeted,
    layout,
    lookup,
    make_service,
    put,
    service,
    store,
)


# ------------------------------------------------------------------------ HELLO
def test_the_registry_gives_freed_ids_again_smallest_first_once_no_session_uses_them():
    """The registry alone, no service: ids, prefixes and session counts."""
    registry = NamespaceRegistry()
    a, b, c = layout(model_name="a"), layout(model_name="b"), layout(model_name="c")
    assert [registry.add(x) for x in (a, b, c)] == [1, 2, 3]
    assert registry.ids == {a: 1, b: 2, c: 3} and registry.layouts[2] == b
    assert registry.prefixes[3] == b"c" + (3).to_bytes(4, "little")
    registry.open_session([1, 2])
    registry.open_session([2])
    assert registry.close_session([1, 2]) == [1]  # 2 is still another session's
    assert registry.close_session([2]) == [2] and registry.num_sessions == {}
    assert registry.remove(2) == b and registry.remove(1) == a
    assert registry.ids == {c: 3} and list(registry.prefixes) == [3]
    assert registry.add(layout(model_name="d")) == 1  # the smallest freed id first
    assert registry.add(layout(model_name="e")) == 2
    assert registry.add(layout(model_name="f")) == 4


def test_hello_without_layouts_opens_an_admin_session(make_service):
    service = make_service(capacity_bytes=8 << 20, block_bytes=0)
    session, reply = greet(service)
    assert reply == HelloReply(session.session_id, service.config.name,
                               service.arena.generation, 0, 0, 8 << 20, [], os.getpid(),
                               [TierInfo(0, "host", "", 8 << 20, 0, 0)])
    assert session.greeted and session.namespaces == []
    assert service.pool is None  # no layout yet: the arena is not cut into blocks
    assert error_code(service.handle(session, Lookup([1], chunk_hashes([0])))) == "bad_namespace"
    assert service.handle(session, Ping()) == Ok()


def test_hello_with_one_layout_registers_namespace_1(service):
    session, reply = greet(service, LAYOUT)
    assert reply.namespaces == [1] and session.namespaces == [1]
    assert (reply.block_bytes, reply.num_blocks) == (BLOCK_BYTES, NUM_BLOCKS)
    assert reply.capacity_bytes == SMALL_ARENA_BYTES
    assert reply.arena_name == service.arena.name
    assert reply.generation == service.arena.generation
    assert reply.server_pid == os.getpid()


def test_hello_with_several_layouts_registers_one_namespace_each(service):
    session, reply = greet(service, *TP2, layout(model_name="other"))
    assert reply.namespaces == [1, 2, 3] and session.namespaces == [1, 2, 3]
    # An equal layout in another session is the same namespace: their chunks are shared.
    _, reply = greet(service, TP2[1], layout(model_name="third"))
    assert reply.namespaces == [2, 4]
    assert service.handle(session, Info("clients")).sections["clients"]["namespaces"] == 4


@pytest.mark.parametrize("version", [1, PROTOCOL_VERSION + 1])
def test_hello_of_another_protocol_version_is_refused(service, version):
    session = service.open_session(1, os.geteuid(), 0)
    reply = service.handle(session, Hello(version, 1, "old", [LAYOUT]))
    assert error_code(reply) == "version"
    assert f"protocol version {version}" in reply.message
    assert not session.greeted and service.namespaces == {}
    assert error_code(service.handle(session, Lookup([1], b""))) == "no_session"
    reply = service.handle(session, Hello(PROTOCOL_VERSION, 1, "new", [LAYOUT]))
    assert isinstance(reply, HelloReply) and reply.namespaces == [1]


def test_a_second_hello_is_refused_and_changes_nothing(service):
    session = greeted(service, LAYOUT)
    reply = service.handle(session, Hello(PROTOCOL_VERSION, 1, "again", TP2))
    assert error_code(reply) == "bad_request" and "already" in reply.message
    assert session.namespaces == [1] and session.name == "test"
    assert len(service.namespaces) == 1


def test_hello_with_too_many_layouts_is_refused(service):
    many = [layout(rank, MAX_LAYOUTS_PER_SESSION + 1)
            for rank in range(MAX_LAYOUTS_PER_SESSION + 1)]
    session, reply = greet(service, *many)
    assert error_code(reply) == "bad_request"
    assert f"at most {MAX_LAYOUTS_PER_SESSION}" in reply.message
    assert not session.greeted and service.namespaces == {}
    reply = service.handle(session, Hello(PROTOCOL_VERSION, 1, "t", many[:-1]))
    assert reply.namespaces == list(range(1, MAX_LAYOUTS_PER_SESSION + 1))


def test_a_namespace_nothing_uses_is_freed_when_its_last_session_ends(service):
    first = greeted(service, *TP2)
    second = greeted(service, TP2[0])
    service.close_session(first)
    assert service.namespaces == {TP2[0]: 1}  # rank 1 had no other session, no value
    service.close_session(second)
    assert service.namespaces == {} and service.stats.freed_namespaces["namespaces"] == 2
    fields = service.handle(greeted(service), Info("clients")).sections["clients"]
    assert (fields["namespaces"], fields["namespaces_freed"]) == (0, 2)
    assert greeted(service, layout(model_name="next")).namespaces == [1]  # ids given again


def test_a_namespace_outlives_its_sessions_while_a_value_is_cached(service):
    """The chunk keeps its namespace (and id) for the next session of the layout; its
    eviction frees the namespace; a freed id given to another layout finds nothing of
    the old one."""
    writer = greeted(service, LAYOUT, layout(fmt="kv"))
    store(service, writer, 1, [7])
    put(service, writer, 2, "key")
    assert service.handle(writer, Acquire([1], chunk_hashes([7]))).lease  # a hit
    service.close_session(writer)
    other = greeted(service, layout(model_name="other"))
    assert other.namespaces == [3]  # 1 and 2 still name the writer's layouts
    reader = greeted(service, LAYOUT)
    assert reader.namespaces == [1] and lookup(service, reader, [1], [7]) == 1
    service.close_session(reader)
    assert service.handle(greeted(service), Evict(key="key")) == CountReply(1)
    assert LAYOUT in service.namespaces and layout(fmt="kv") not in service.namespaces
    assert service.handle(greeted(service), Evict(lru=1)) == CountReply(1)  # chunk 7
    assert LAYOUT not in service.namespaces  # freed with its last value
    assert service.stats.freed_namespaces == {"namespaces": 2, "hit_chunks": 1,
                                             "miss_chunks": 0, "hit_tokens": 16,
                                             "miss_tokens": 0}
    assert service.pool.stats.hits == 1 + sum(service.stats.ns_hits.values())
    reused = greeted(service, layout(model_name="reuses-id-1"))
    assert reused.namespaces == [1] and lookup(service, reused, [1], [7]) == 0
    assert_everything_returned(service)


def test_a_value_evicted_by_pressure_frees_its_namespace(make_service):
    service = make_service(HEADER_BYTES + 2 * BLOCK_BYTES)
    old = greeted(service, layout(model_name="old"))
    store(service, old, 1, [1, 2])
    service.close_session(old)
    new = greeted(service, layout(model_name="new"))
    assert new.namespaces == [2]
    store(service, new, 2, [3])
    assert 1 in service.ns_registry.layouts  # one of its chunks is still cached
    store(service, new, 2, [4])  # evicts the old layout's last chunk
    assert 1 not in service.ns_registry.layouts and service.namespaces == {layout(model_name="new"): 2}
    assert_everything_returned(service)


def test_hellos_beyond_max_namespaces_are_refused_until_one_is_freed(service):
    sessions = [greeted(service, *(layout(rank, MAX_LAYOUTS_PER_SESSION, f"m{i}")
                                   for rank in range(MAX_LAYOUTS_PER_SESSION)))
                for i in range(MAX_NAMESPACES // MAX_LAYOUTS_PER_SESSION)]
    assert len(service.namespaces) == MAX_NAMESPACES
    session, reply = greet(service, layout(model_name="one-more"), LAYOUT)
    assert error_code(reply) == "max_namespaces" and not session.greeted
    assert f"over {MAX_NAMESPACES} namespaces" in reply.message
    assert "close the sessions" in reply.message
    assert len(service.namespaces) == MAX_NAMESPACES  # nothing registered
    assert greeted(service, layout(0, MAX_LAYOUTS_PER_SESSION, "m0")).namespaces == [1]
    service.close_session(sessions[-1])
    assert greeted(service, layout(model_name="one-more"), LAYOUT).namespaces == [
        MAX_NAMESPACES - MAX_LAYOUTS_PER_SESSION + 1, MAX_NAMESPACES - MAX_LAYOUTS_PER_SESSION + 2]


def test_a_hello_refused_half_way_leaves_no_namespace(service):
    _, reply = greet(service, LAYOUT, layout(model_name="huge", record_bytes=1 << 30))
    assert error_code(reply) == "too_large"
    assert service.namespaces == {}
    assert greeted(service, layout(model_name="next")).namespaces == [1]


def test_a_huge_first_layout_cannot_shrink_the_arena(make_service):
    """Without --block-size, one HELLO with a 64 MiB chunk on a 64 MiB arena used to make
    the arena one block, then 64 blocks of a 1 MiB: now it is refused before it sets the
    block size, and the next layout sets it from its own record."""
    service = make_service(capacity_bytes=64 << 20, block_bytes=0)
    _, reply = greet(service, layout(model_name="huge", record_bytes=64 << 20))
    assert error_code(reply) == "too_large"  # it does not fit at all
    assert "--capacity 65MiB or more" in reply.message  # the sizes and the fix
    assert (service.arena.block_bytes, service.arena.num_blocks, service.pool) == (0, 0, None)
    _, reply = greet(service, LAYOUT)  # a real model still gets a useful arena
    assert isinstance(reply, HelloReply) and reply.num_blocks >= MIN_DERIVED_BLOCKS
    assert reply.block_bytes == 4096  # its own 1,000-byte record, in one page


def test_a_record_larger_than_the_derived_block_spans_several_equal_blocks(make_service):
    """A record too large for MIN_DERIVED_BLOCKS blocks is cut into the fewest equal
    page-rounded pieces (it used to take 3 blocks of (8 MiB - 4 KiB) / 64)."""
    service = make_service(capacity_bytes=8 << 20, block_bytes=0)
    session, reply = greet(service, layout(model_name="big", record_bytes=1_000_000))
    assert reply.block_bytes == 123 * 4096  # half the record, in whole pages
    assert reply.num_blocks == 16 == MIN_DERIVED_BLOCKS
    alloc = service.handle(session, Alloc(1, chunk_hashes([1]), [1_000_000]))
    assert alloc.status == [ALLOCATED] and alloc.span_lengths == [2]
    assert_everything_returned(service)


@pytest.mark.parametrize("capacity_bytes, record_bytes", [(8 << 10, 3000), (40 << 10, 5000)])
def test_an_arena_of_fewer_than_16_pages_derives_page_blocks(make_service, capacity_bytes,
                                                            record_bytes):
    """The smallest arenas (--capacity 8KiB holds the header and one page) cannot keep 16
    blocks: their derived block is one page, whatever the record."""
    service = make_service(capacity_bytes=capacity_bytes, block_bytes=0)
    session, reply = greet(service, layout(model_name="small", record_bytes=record_bytes))
    assert isinstance(reply, HelloReply), reply
    assert reply.block_bytes == 4096
    assert reply.num_blocks == (capacity_bytes - HEADER_BYTES) // 4096


LLAMA_3_8B = Layout("meta-llama/Meta-Llama-3-8B", 1, 0, "vllm", "bfloat16", 32, 8, 128, 256,
                    (32 << 20) + 2112)  # README's layout: a 32 MiB + 2,112-byte record


@pytest.mark.parametrize("capacity_bytes, num_blocks", [(1 << 30, 31), (3 << 29, 47)])
def test_the_derived_block_holds_a_whole_llama_3_8b_chunk_from_1_gib(make_service,
                                                                     capacity_bytes, num_blocks):
    """The rule keeps a typical model's chunk in one block for a capacity >= 1 GiB (it
    used to derive 16 MiB / 24 MiB blocks, 3 / 2 per chunk: fill ratio 0.67 / 0.67)."""
    service = make_service(capacity_bytes=capacity_bytes, block_bytes=0)
    session, reply = greet(service, LLAMA_3_8B)
    assert reply.block_bytes == 33558528  # the record rounded up to 4 KiB
    assert reply.num_blocks == num_blocks
    alloc = service.handle(session, Alloc(1, chunk_hashes([1, 2]), [LLAMA_3_8B.record_bytes] * 2))
    assert alloc.status == [ALLOCATED] * 2 and alloc.span_lengths == [1, 1]
    assert_everything_returned(service)


def test_a_derived_block_size_is_warned_with_its_fill_ratio_and_the_flag(make_service, caplog):
    service = make_service(capacity_bytes=1 << 30, block_bytes=0)
    greet(service, LLAMA_3_8B)
    assert ("--block-size is unset: the first layout (meta-llama/Meta-Llama-3-8B, chunk record "
            "33556544 bytes) set block_bytes=33558528 for the daemon's life: 31 blocks, 1 "
            "block(s) per chunk, fill ratio 0.9999; start the daemon with --block-size "
            "33558528 so that the block size does not depend on which client comes first"
            ) in caplog.text
    assert [r.levelname for r in caplog.records if "--block-size" in r.message] == ["WARNING"]


def test_the_warning_of_a_tiny_record_names_a_block_that_it_fills_better(make_service, caplog):
    """A 1,000-byte record in a 1 GiB arena gets the 16 KiB floor (fill ratio 0.06); an
    operator may go down to 4 KiB blocks (capacity / 262144), and the warning says so."""
    service = make_service(capacity_bytes=1 << 30, block_bytes=0)
    greet(service, layout(model_name="tiny", record_bytes=1000))
    assert "block_bytes=16384" in caplog.text and "fill ratio 0.0610" in caplog.text
    assert "start the daemon with --block-size 4096 " in caplog.text


def test_an_operator_block_size_is_not_warned(make_service, caplog):
    caplog.set_level(logging.INFO, logger="lmcached.daemon.namespaces")
    service = make_service(capacity_bytes=8 << 20, block_bytes=0, config_block_bytes=1 << 20)
    greet(service, LAYOUT)
    assert "block_bytes=1048576 (--block-size): 7 blocks" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("record_bytes", [1, 1000, 4096])
def test_a_tiny_first_layout_cannot_cut_a_large_arena_into_tiny_blocks(make_service,
                                                                        record_bytes):
    """Without --block-size, a first HELLO with a tiny record used to cut a 1 GiB arena
    into 262,143 blocks of 4 KiB (every walk over the cached values that long); now the
    arena has at most MAX_DERIVED_BLOCKS blocks (sparse: the arena is not prefaulted)."""
    service = make_service(capacity_bytes=1 << 30, block_bytes=0)
    session, reply = greet(service, layout(model_name="tiny", record_bytes=record_bytes))
    assert isinstance(reply, HelloReply), reply
    assert reply.block_bytes == 16 << 10  # (1 GiB - 4 KiB header) / 2**16, in whole pages
    assert reply.num_blocks == len(service.pool.blocks) <= MAX_DERIVED_BLOCKS
    assert reply.num_blocks >= MIN_DERIVED_BLOCKS


def test_operator_block_size_wins_over_the_layout(make_service):
    service = make_service(capacity_bytes=8 << 20, block_bytes=0, config_block_bytes=1 << 20)
    _, reply = greet(service, LAYOUT)
    assert reply.block_bytes == 1 << 20 and reply.num_blocks == 7


def test_a_record_over_one_sessions_share_is_refused_at_hello_with_fixes_that_work(
        make_service):
    """A chunk record needing more blocks than --max-session-share lets one session hold
    could never be stored (every ALLOC would answer NOSPACE): HELLO refuses it with
    `too_large`, naming the sizes, and each option value it names makes it fit."""
    service = make_service(max_session_share=50.0)  # 8 of the 16 blocks of 64 KiB
    record_bytes = 8 * BLOCK_BYTES + 1  # 9 blocks
    assert isinstance(greet(service, layout(model_name="fits", record_bytes=8 * BLOCK_BYTES))[1],
                      HelloReply)
    _, reply = greet(service, layout(model_name="over", record_bytes=record_bytes))
    assert error_code(reply) == "too_large"
    assert (f"a chunk record of {record_bytes} bytes (512.00K) needs 9 blocks of "
            f"{BLOCK_BYTES} bytes, and one session may hold 8 of the arena's 16 "
            "(--max-session-share 50% of 1.00M)") in reply.message
    assert ("start the daemon with --capacity 2MiB or more or --max-session-share 57, or "
            "give the client a smaller chunk_size") in reply.message
    bigger = make_service(capacity_bytes=2 << 20, max_session_share=50.0)
    wider = make_service(max_session_share=57.0)
    for fixed in (bigger, wider):
        assert isinstance(greet(fixed, layout(model_name="over", record_bytes=record_bytes))[1],
                          HelloReply)


def test_a_record_over_the_whole_arena_names_the_capacity_it_needs(make_service):
    service = make_service()  # 16 blocks of 64 KiB, a session may hold them all
    _, reply = greet(service, layout(model_name="huge", record_bytes=20 * BLOCK_BYTES))
    assert error_code(reply) == "too_large"
    assert "needs 20 blocks" in reply.message
    assert "max-session-share 100% of 1.00M" in reply.message
    assert "--capacity 2MiB or more, or give the client a smaller chunk_size" in reply.message
    assert isinstance(greet(make_service(capacity_bytes=2 << 20),
                            layout(model_name="huge", record_bytes=20 * BLOCK_BYTES))[1],
                      HelloReply)
