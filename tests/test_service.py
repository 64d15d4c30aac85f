"""Request semantics of `CacheService` in process (no sockets): exact pool state after each."""

import pytest

from lmcached.config import ServerConfig
from lmcached.protocol import (
    ALLOCATED,
    EXISTS,
    PROTOCOL_VERSION,
    Acquire,
    Alloc,
    Commit,
    Error,
    Hello,
    HelloReply,
    Layout,
)
from lmcached.service import MIN_DERIVED_BLOCKS, CacheService
from lmcached.shm.arena import Arena

LAYOUT = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)


def chunk_hashes(ids) -> bytes:
    return b"".join(i.to_bytes(16, "little") for i in ids)


@pytest.fixture
def make_service(unique_name):
    arenas = []

    def make(capacity_bytes: int = 8 << 20, block_bytes: int = 0, config_block_bytes: int = 0):
        arena = Arena.create(f"{unique_name}-{len(arenas)}", capacity_bytes, block_bytes,
                             prefault=False)
        arenas.append(arena)
        config = ServerConfig(name=arena.name, socket="/nonexistent",
                              block_bytes=config_block_bytes)
        return CacheService(config, arena)

    yield make
    for arena in arenas:
        arena.close()


def greet(service: CacheService, layout: Layout = LAYOUT):
    session = service.open_session(1, 0, 0)
    reply = service.handle(session, Hello(PROTOCOL_VERSION, 1, "t", layout))
    return session, reply


def test_restore_of_cached_chunks_leaves_no_pins(make_service):
    service = make_service(block_bytes=64 << 10)
    session, _ = greet(service)
    first = service.handle(session, Alloc(1, chunk_hashes(range(4)), [1000] * 4))
    service.handle(session, Commit(first.block_ids))
    again = service.handle(session, Alloc(1, chunk_hashes(range(6)), [1000] * 6))
    assert again.status == [EXISTS] * 4 + [ALLOCATED] * 2
    service.handle(session, Commit(again.block_ids))
    assert service.pool.num_pinned_blocks == 0
    assert service.pool.num_cached_blocks == 6
    service.pool.check_invariants()


def test_session_end_releases_pins_and_aborts_writes(make_service):
    service = make_service(block_bytes=64 << 10)
    session, _ = greet(service)
    stored = service.handle(session, Alloc(1, chunk_hashes(range(3)), [1000] * 3))
    service.handle(session, Commit(stored.block_ids))
    service.handle(session, Acquire(1, chunk_hashes(range(3))))
    service.handle(session, Alloc(1, chunk_hashes(range(10, 12)), [1000] * 2))
    assert service.pool.num_pinned_blocks == 3 and service.pool.num_writing_blocks == 2
    service.close_session(session)
    assert service.pool.num_pinned_blocks == 0 and service.pool.num_writing_blocks == 0
    assert service.pool.num_cached_blocks == 3
    service.pool.check_invariants()


def test_a_huge_first_layout_cannot_shrink_the_arena(make_service):
    """Without --block-size, one HELLO with a 64 MiB chunk on a 64 MiB arena used to make
    the arena one block; now the arena keeps MIN_DERIVED_BLOCKS blocks."""
    service = make_service(capacity_bytes=64 << 20)
    _, reply = greet(service, Layout("huge", 1, 0, "vllm", "bfloat16", 1, 1, 1, 16, 64 << 20))
    assert isinstance(reply, Error) and reply.code == "too_large"  # it does not fit at all
    assert service.arena.num_blocks >= MIN_DERIVED_BLOCKS
    _, reply = greet(service)  # a real model still gets a useful arena
    assert isinstance(reply, HelloReply) and reply.num_blocks >= MIN_DERIVED_BLOCKS


def test_a_record_larger_than_the_derived_block_spans_several_blocks(make_service):
    service = make_service(capacity_bytes=8 << 20)
    big = Layout("big", 1, 0, "vllm", "bfloat16", 1, 1, 1, 16, 300_000)
    session, reply = greet(service, big)
    assert reply.block_bytes == 124 << 10  # (8 MiB - 4 KiB header) / 64, in whole pages
    assert reply.num_blocks >= MIN_DERIVED_BLOCKS
    alloc = service.handle(session, Alloc(1, chunk_hashes([1]), [300_000]))
    assert alloc.num_blocks == [3]


def test_operator_block_size_wins_over_the_layout(make_service):
    service = make_service(capacity_bytes=8 << 20, config_block_bytes=1 << 20)
    _, reply = greet(service)
    assert reply.block_bytes == 1 << 20
