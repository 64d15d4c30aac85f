"""The disk tier inside one CacheService (lmcached/daemon/disk/tier.py): no socket.

The service's requests are driven by hand and the tier's job completions applied as the
loop would (`JobRunner.process_completions`). Chunks the arena evicts are spilled and
read back bit-exact; every I/O fault (a full disk, EIO, a read-only filesystem) is a
counted miss or a dropped write, never an error reply, and leaves no block pinned or
WRITING behind.
"""

import errno
import os
import threading
import time

import numpy as np
import pytest

from test_disk_slots import chain
from test_service import BLOCK_BYTES, greeted
from lmcached.daemon.disk.directory import DirectoryLock, prepare_disk_directory
from lmcached.daemon.disk.slots import SlotFile
from lmcached.daemon.disk.tier import DiskTier
from lmcached.daemon.replies import Deferred
from lmcached.daemon.server_config import ServerConfig
from lmcached.daemon.service import CacheService
from lmcached.shm.arena import HEADER_BYTES, Arena
from lmcached.wire.protocol import Acquire, Alloc, BlocksReply, Clear, Commit, Evict, Layout, \
    Lookup, LookupReply, Ok, Release

NUM_BLOCKS = 6
KV_BYTES = 5000
PROMPT_A = chain(4, KV_BYTES)  # (parent, chunk hash, record) of a prompt's 4 chunks
PROMPT_B = chain(4, KV_BYTES, first_token=1000)
RECORD_BYTES = len(PROMPT_A[0][2])
LAYOUT = Layout("disk-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, RECORD_BYTES)
HASHES_A = b"".join(h for _, h, _ in PROMPT_A)


@pytest.fixture
def disk_service(unique_name, tmp_path):
    """A service on a 4-block arena with an on-evict disk tier of 16 slots."""
    arena = Arena.create(unique_name, HEADER_BYTES + NUM_BLOCKS * BLOCK_BYTES, BLOCK_BYTES,
                         prefault=False)
    service = CacheService(ServerConfig(name=arena.name, socket="/nonexistent",
                                        max_session_share=100.0), arena)
    directory = prepare_disk_directory(str(tmp_path / "disk"))
    tier = DiskTier(directory, DirectoryLock(directory), capacity_bytes=(16 << 20),
                    policy="on-evict", fetch_wait_s=5.0, arena=arena, jobs=service.jobs)
    tier.set_block_bytes(arena.block_bytes)
    service.attach_disk(tier)
    yield service
    tier.close()
    arena.close()


def settle(service: CacheService, done, timeout_s: float = 20.0):
    """Apply completions as the loop would until `done()` is true."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the disk tier's jobs did not complete"
        service.jobs.process_completions()
        time.sleep(0.005)
    service.jobs.process_completions()


def store_chunk(service: CacheService, session, chunk_hash: bytes, record: bytes) -> int:
    """ALLOC, fill and COMMIT one chunk; returns its block id."""
    arena = service.arena
    alloc = service.handle(session, Alloc(1, chunk_hash, [len(record)]))
    (block_id,) = alloc.block_ids
    arena.numpy_view(arena.block_offset(block_id), len(record))[:] = np.frombuffer(record, np.uint8)
    assert service.handle(session, Commit([block_id])) == Ok()
    return block_id


def store_both(service: CacheService, session, settled: bool = True) -> None:
    """Store prompt A then B, chunk by chunk, into the 6-block arena: A's first 2 chunks
    (the least recently used) are evicted. `settled`: the disk's writes end after each
    store (the writers keep up, as between prefills), else nobody waits for them."""
    for _, chunk_hash, record in PROMPT_A + PROMPT_B:
        store_chunk(service, session, chunk_hash, record)
        if settled:
            settle(service, lambda: not service.disk._writing)


def lookup(service: CacheService, session) -> int:
    """LOOKUP of prompt A, waiting for a disk fetch as the server would."""
    reply = service.handle(session, Lookup([1], HASHES_A))
    if isinstance(reply, Deferred):
        settle(service, lambda: reply.job.done)
        reply = service.resume(session, reply)
    assert isinstance(reply, LookupReply), reply
    return reply.num_chunks


def disk_info(service: CacheService) -> dict:
    return service.disk.info()


def assert_nothing_held(service: CacheService) -> None:
    pool = service.pool
    assert pool.num_pinned_blocks == 0 and pool.num_writing_blocks == 0
    assert not service.disk.index.reading
    service.tiers.check_invariants()


def arena_prefix(service: CacheService) -> int:
    """How many of prompt A's first chunks the arena holds."""
    n = 0
    while n < len(PROMPT_A) and service.pool.cached.get(b"c" + (1).to_bytes(4, "little")
                                                         + PROMPT_A[n][1]):
        n += 1
    return n


def stored_and_settled(service: CacheService):
    """A session that stored prompts A then B; every disk write ended."""
    session = greeted(service, LAYOUT)
    store_both(service, session)
    settle(service, lambda: not service.disk._writing)
    return session


def test_evicted_chunks_are_read_back_bit_exact(disk_service):
    service = disk_service
    session = stored_and_settled(service)
    info = disk_info(service)
    assert info["disk_writes"] >= 2 and arena_prefix(service) < 4, info  # some of A on disk
    assert lookup(service, session) == 4  # the fetch never evicts A's chunks in the arena
    info = disk_info(service)
    assert info["disk_fetch_hit_chunks"] >= 1 and info["disk_fetch_failures"] == 0
    reply = service.handle(session, Acquire([1], HASHES_A))
    assert isinstance(reply, BlocksReply) and len(reply.block_ids) == 4
    arena = service.arena
    for block_id, n, (_, _, record) in zip(reply.block_ids, reply.num_bytes, PROMPT_A):
        assert bytes(arena.numpy_view(arena.block_offset(block_id), n)) == record
    service.handle(session, Release([reply.lease]))
    assert_nothing_held(service)


def test_chunks_next_in_line_are_written_ahead_and_evicted_without_a_copy(disk_service):
    service = disk_service
    session = greeted(service, LAYOUT)
    store_both(service, session)  # the arena is full: A0, next in line, is written ahead
    fp = service.disk._ns_fp(1)
    assert (fp, PROMPT_A[0][1]) in service.disk.index.entries
    for _ in range(4):  # each store evicts a chunk written ahead after the last one
        settle(service, lambda: not service.disk._writing)
        before = disk_info(service)
        fresh = chain(1, KV_BYTES, first_token=50_000 + 100 * before["disk_writes"])
        (_, chunk_hash, record), = fresh
        alloc = service.handle(session, Alloc(1, chunk_hash, [len(record)]))
        assert service.handle(session, Commit(alloc.block_ids)) == Ok()
        after = disk_info(service)
        assert after["disk_spills_present"] == before["disk_spills_present"] + 1
    assert disk_info(service)["disk_write_drops_late"] == 0
    settle(service, lambda: not service.disk._writing)
    assert_nothing_held(service)


class GatedCopies:
    """Replaces `DiskTier._copy_out`: records the thread of every copy, and holds each
    copy before it reads the blocks until `go` is set."""

    def __init__(self, monkeypatch) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []
        self.blocks: list = []  # the values whose copy started, in order
        original = DiskTier._copy_out

        def copy_out(tier, blocks, buffer):
            self.threads.append(threading.current_thread().name)
            self.blocks.append(blocks)
            self.entered.set()
            assert self.go.wait(20), "the test never released the copy"
            original(tier, blocks, buffer)
        monkeypatch.setattr(DiskTier, "_copy_out", copy_out)


def test_a_burst_faster_than_the_writers_drops_chunks_and_never_copies_in_the_loop(
        disk_service, monkeypatch):
    service = disk_service
    copies = GatedCopies(monkeypatch)
    session = greeted(service, LAYOUT)
    store_both(service, session, settled=False)  # B2 and B3 evict A0 and A1 unwritten
    assert copies.entered.wait(10)  # a write ahead is held in its copy
    copies.go.set()
    settle(service, lambda: not service.disk._writing)
    info = disk_info(service)
    assert info["disk_write_drops_late"] == 2, info
    assert threading.current_thread().name not in copies.threads, "the loop copied a chunk"
    fp = service.disk._ns_fp(1)
    assert not any((fp, h) in service.disk.index.entries for _, h, _ in PROMPT_A[:2])
    index = service.disk.index
    assert len(index.entries) + len(index.free_slots) == index.num_slots  # none leaked
    assert lookup(service, session) == 0  # A0 is gone: a miss, not an error
    assert_nothing_held(service)


def test_a_chunk_evicted_during_its_write_ahead_copy_is_never_written(disk_service,
                                                                      monkeypatch):
    service = disk_service
    copies = GatedCopies(monkeypatch)
    session = greeted(service, LAYOUT)
    for _, chunk_hash, record in PROMPT_A + PROMPT_B[:2]:  # 6 blocks: the arena is full
        store_chunk(service, session, chunk_hash, record)
    a0_blocks = service.pool.cached[b"c" + (1).to_bytes(4, "little") + PROMPT_A[0][1]]
    deadline = time.monotonic() + 10  # A0, least recently used, is written ahead first
    while not any(blocks is a0_blocks for blocks in copies.blocks):
        assert time.monotonic() < deadline, "A0's write ahead never started its copy"
        time.sleep(0.005)
    (old_block,) = a0_blocks
    # The copy has not read A0's block yet: B2 evicts A0 and overwrites that block.
    _, chunk_hash, record = PROMPT_B[2]
    assert store_chunk(service, session, chunk_hash, record) == old_block.block_id
    copies.go.set()
    settle(service, lambda: not service.disk._writing)
    fp = service.disk._ns_fp(1)
    assert (fp, PROMPT_A[0][1]) not in service.disk.index.entries, \
        "B2's bytes were written to disk under A0's key"
    info = disk_info(service)
    assert info["disk_write_drops_late"] == 1 and info["disk_writes"] >= 2, info
    assert lookup(service, session) == 0
    assert_nothing_held(service)


@pytest.mark.parametrize("code,kind", [(errno.ENOSPC, "nospace"), (errno.EIO, "io"),
                                       (errno.EROFS, "readonly")])
def test_a_failing_write_is_a_counted_drop(disk_service, monkeypatch, code, kind):
    service = disk_service

    def fail(self, *args):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(SlotFile, "write", fail)
    session = stored_and_settled(service)
    info = disk_info(service)
    assert info[f"disk_errors_{kind}"] >= 1
    assert info["disk_write_failures"] == info[f"disk_errors_{kind}"]
    assert info["disk_writes"] == 0 and info["disk_used_slots"] == 0
    assert len(service.disk.index.free_slots) == service.disk.index.num_slots  # all given back
    assert lookup(service, session) == arena_prefix(service) < 4  # a miss, not an error
    assert info["disk_fetches"] == 0
    assert_nothing_held(service)


def test_a_failing_read_is_a_counted_miss_and_the_slot_is_forgotten(disk_service, monkeypatch):
    service = disk_service
    session = stored_and_settled(service)
    first_missing = arena_prefix(service)
    fp = service.disk._ns_fp(1)
    assert (fp, PROMPT_A[first_missing][1]) in service.disk.index.entries

    def fail(self, *args):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(SlotFile, "read", fail)
    assert lookup(service, session) == first_missing
    info = disk_info(service)
    assert info["disk_errors_io"] == 1 and info["disk_fetch_failures"] == 1
    assert (fp, PROMPT_A[first_missing][1]) not in service.disk.index.entries, \
        "the slot that failed is never read again"
    assert_nothing_held(service)


@pytest.mark.parametrize("request_type", ["clear", "evict"])
def test_clear_and_evict_erase_disk_copies_so_that_a_restart_does_not_bring_them_back(
        disk_service, request_type):
    service = disk_service
    session = stored_and_settled(service)
    tier = service.disk
    on_disk = [h for _, h, _ in PROMPT_A if (tier._ns_fp(1), h) in tier.index.entries]
    assert on_disk
    if request_type == "clear":
        reply = service.handle(session, Clear())
        assert reply.count >= len(on_disk) and disk_info(service)["disk_used_slots"] == 0
    else:
        for chunk_hash in on_disk:
            assert service.handle(session, Evict(key=chunk_hash.hex())).count == 1
    assert not any((tier._ns_fp(1), h) in tier.index.entries for h in on_disk)
    settle(service, lambda: len(tier._writes) == 0 and not tier._writing)
    service.jobs.process_completions()
    assert lookup(service, session) == arena_prefix(service)  # a miss, not a disk hit
    restarted, kept = SlotFile.open(tier.directory, tier.slots.slot_bytes, tier.slots.num_slots)
    found = {h.chunk_hash for h in restarted.scan()}
    restarted.close()
    assert kept and not found & set(on_disk), "a restart would serve an erased chunk"


def test_a_slot_file_deleted_under_the_daemon_is_reported_and_still_served(disk_service, caplog):
    service = disk_service
    session = stored_and_settled(service)
    os.unlink(service.disk.slots.path)
    service.housekeeping()
    assert disk_info(service)["disk_file_deleted"] == 1
    assert "the slot file was deleted" in caplog.text
    assert lookup(service, session) == 4  # through the open descriptor, until a restart
    assert_nothing_held(service)


@pytest.mark.parametrize("value_bytes,on_disk", [(BLOCK_BYTES + 100, True),
                                                 (2 * BLOCK_BYTES - 100, False)])
def test_a_value_of_two_blocks_is_written_if_it_fits_a_slot_else_counted_once_when_evicted(
        disk_service, value_bytes, on_disk):
    service = disk_service
    big_layout = Layout("disk-big", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, value_bytes)
    session = greeted(service, LAYOUT, big_layout)  # namespaces 1 and 2
    big_hash = b"\xbb" * 16
    alloc = service.handle(session, Alloc(2, big_hash, [value_bytes]))
    assert len(alloc.block_ids) == 2, alloc  # a value of two blocks
    assert service.handle(session, Commit(alloc.block_ids)) == Ok()
    store_both(service, session)  # the big value is least recently used: evicted first
    assert b"c" + (2).to_bytes(4, "little") + big_hash not in service.pool.cached
    info = disk_info(service)
    assert info["disk_write_drops_late"] == 0, info
    assert info["disk_write_drops_oversize"] == int(not on_disk), info
    assert ((service.disk._ns_fp(2), big_hash) in service.disk.index.entries) == on_disk
    assert_nothing_held(service)
