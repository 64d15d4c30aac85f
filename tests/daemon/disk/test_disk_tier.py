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
from lmcached.daemon.disk import writes as disk_writes
from lmcached.daemon.disk.directory import DirectoryLock, prepare_disk_directory
from lmcached.daemon.disk.scan import scan_slots
from lmcached.daemon.disk.slots import PAGE_BYTES, SlotFile, round_up, slot_bytes_for
from lmcached.daemon.disk.tier import DiskTier
from lmcached.daemon.spill.envelope import namespace_fingerprint
from lmcached.daemon.replies import Deferred
from lmcached.daemon.server_config import ServerConfig
from lmcached.daemon.service import CacheService
from lmcached.shm.arena import HEADER_BYTES, Arena
from lmcached.wire.units import format_bytes
from lmcached.wire.protocol import Acquire, Alloc, BlocksReply, Clear, Commit, Evict, Invalidate, \
    Layout, Lookup, LookupReply, Ok, Release

NUM_BLOCKS = 6
KV_BYTES = 5000
PROMPT_A = chain(4, KV_BYTES)  # (parent, chunk hash, record) of a prompt's 4 chunks
PROMPT_B = chain(4, KV_BYTES, first_token=1000)
RECORD_BYTES = len(PROMPT_A[0][2])
LAYOUT = Layout("disk-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, RECORD_BYTES)
HASHES_A = b"".join(h for _, h, _ in PROMPT_A)


UNALIGNED_BLOCK_BYTES = BLOCK_BYTES - 1024  # a --block-size of 64-byte multiples, not pages


def open_disk_service(name: str, path: str, block_bytes: int = BLOCK_BYTES,
                      policy: str = "on-evict", num_blocks: int = NUM_BLOCKS) -> CacheService:
    """A service on an arena of `num_blocks` blocks (the last block ends the mapping) with
    a disk tier of 16 MiB in directory `path`, its index rebuilt from what the directory
    holds."""
    directory = prepare_disk_directory(path)
    arena = Arena.create(name, HEADER_BYTES + num_blocks * block_bytes, block_bytes,
                         prefault=False)
    service = CacheService(ServerConfig(name=arena.name, socket="/nonexistent",
                                        max_session_share=100.0), arena)
    tier = DiskTier(directory, DirectoryLock(directory), capacity_bytes=(16 << 20),
                    policy=policy, fetch_wait_s=5.0, arena=arena, jobs=service.jobs)
    tier.set_block_bytes(arena.block_bytes)
    service.attach_tier(tier)
    return service


def close_disk_service(service: CacheService) -> None:
    service.spill_tier("disk").close()
    service.arena.close()


@pytest.fixture
def disk_service(unique_name, tmp_path):
    """A service on a 6-block arena with an on-evict disk tier of 16 MiB."""
    service = open_disk_service(unique_name, str(tmp_path / "disk"))
    yield service
    close_disk_service(service)


def test_a_capacity_that_holds_no_slot_of_the_first_layouts_blocks_turns_the_tier_off(
        unique_name, tmp_path, caplog):
    """The block size comes with the first layout: a percentage of the free space that
    holds a small slot but not one of those blocks turns the tier off, and says how the
    capacity was derived and what would fit (never "--disk-capacity 0 bytes")."""
    directory = prepare_disk_directory(str(tmp_path / "disk"))
    arena = Arena.create(unique_name, HEADER_BYTES + NUM_BLOCKS * BLOCK_BYTES, BLOCK_BYTES,
                         prefault=False)
    service = CacheService(ServerConfig(name=arena.name, socket="/nonexistent"), arena)
    capacity = PAGE_BYTES + slot_bytes_for(PAGE_BYTES)
    source = f"--disk-capacity 10% of the {capacity * 10}B free in {directory}"
    tier = DiskTier(directory, DirectoryLock(directory), capacity_bytes=capacity,
                    policy="on-evict", fetch_wait_s=5.0, arena=arena, jobs=service.jobs,
                    capacity_source=source, capacity_percent=10.0)
    try:
        assert tier.info()["disk_enabled"] == 1  # a slot of one page would fit
        with caplog.at_level("ERROR", logger="lmcached"):
            tier.set_block_bytes(BLOCK_BYTES)
        info = tier.info()
        need = PAGE_BYTES + slot_bytes_for(BLOCK_BYTES)
        assert info["disk_enabled"] == 0 and info["disk_slots"] == 0 and tier.index is None
        assert info["disk_off_reason"] == (
            f"{source} is {capacity} bytes, less than one slot of {need - PAGE_BYTES} bytes "
            f"and the file's 4096-byte header ({need} bytes)")
        (record,) = [r for r in caplog.records if "is off" in r.getMessage()]
        assert f"free at least {format_bytes(need * 10)} there" in record.getMessage()
        assert f"or give --disk-capacity in bytes (at least {need})" in record.getMessage()
    finally:
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
    """ALLOC, fill and COMMIT one chunk (in as many blocks as it spans); returns its first
    block id."""
    arena = service.arena
    alloc = service.handle(session, Alloc(1, chunk_hash, [len(record)]))
    for i, block_id in enumerate(alloc.block_ids):
        piece = record[i * arena.block_bytes:(i + 1) * arena.block_bytes]
        arena.numpy_view(arena.block_offset(block_id), len(piece))[:] = \
            np.frombuffer(piece, np.uint8)
    assert service.handle(session, Commit(alloc.block_ids)) == Ok()
    return alloc.block_ids[0]


def store_both(service: CacheService, session, settled: bool = True) -> None:
    """Store prompt A then B, chunk by chunk, into the 6-block arena: A's first 2 chunks
    (the least recently used) are evicted. `settled`: the disk's writes end after each
    store (the writers keep up, as between prefills), else nobody waits for them."""
    for _, chunk_hash, record in PROMPT_A + PROMPT_B:
        store_chunk(service, session, chunk_hash, record)
        if settled:
            settle(service, lambda: not service.spill_tier("disk")._writing)


def lookup(service: CacheService, session) -> int:
    """LOOKUP of prompt A, waiting for a disk fetch as the server would."""
    reply = service.handle(session, Lookup([1], HASHES_A))
    if isinstance(reply, Deferred):
        settle(service, lambda: reply.job.done)
        reply = service.resume(session, reply)
    assert isinstance(reply, LookupReply), reply
    return reply.num_chunks


def disk_info(service: CacheService) -> dict:
    return service.spill_tier("disk").info()


def assert_nothing_held(service: CacheService) -> None:
    pool = service.pool
    assert pool.num_pinned_blocks == 0 and pool.num_writing_blocks == 0
    assert not service.spill_tier("disk").index.reading
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
    settle(service, lambda: not service.spill_tier("disk")._writing)
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
    fp = service.spill_tier("disk")._ns_fp(1)
    assert (fp, PROMPT_A[0][1]) in service.spill_tier("disk").index.entries
    for _ in range(4):  # each store evicts a chunk written ahead after the last one
        settle(service, lambda: not service.spill_tier("disk")._writing)
        before = disk_info(service)
        fresh = chain(1, KV_BYTES, first_token=50_000 + 100 * before["disk_writes"])
        (_, chunk_hash, record), = fresh
        alloc = service.handle(session, Alloc(1, chunk_hash, [len(record)]))
        assert service.handle(session, Commit(alloc.block_ids)) == Ok()
        after = disk_info(service)
        assert after["disk_spills_present"] == before["disk_spills_present"] + 1
    assert disk_info(service)["disk_write_drops_late"] == 0
    settle(service, lambda: not service.spill_tier("disk")._writing)
    assert_nothing_held(service)


class GatedWrites:
    """Wraps `SlotFile.write_record` (a writer's record write, straight from the arena
    blocks): records the thread and slot of every write, and holds each write until
    `go` is set, before it reads the blocks (`when="before"`) or after them, between
    the data write and the commit (`when="after"`)."""

    def __init__(self, monkeypatch, when: str = "before") -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []
        self.slots: list[int] = []  # the slots whose write started, in order
        original = SlotFile.write_record

        def write_record(slot_file, slot, page, pieces):
            self.threads.append(threading.current_thread().name)
            self.slots.append(slot)
            if when == "after":
                original(slot_file, slot, page, pieces)
            self.entered.set()
            assert self.go.wait(20), "the test never released the write"
            if when == "before":
                original(slot_file, slot, page, pieces)
        monkeypatch.setattr(SlotFile, "write_record", write_record)


def test_a_burst_faster_than_the_writers_drops_chunks_and_never_copies_in_the_loop(
        disk_service, monkeypatch):
    service = disk_service
    writes = GatedWrites(monkeypatch)
    session = greeted(service, LAYOUT)
    store_both(service, session, settled=False)  # B2 and B3 evict A0 and A1 unwritten
    assert writes.entered.wait(10)  # a write ahead is held before its data write
    writes.go.set()
    settle(service, lambda: not service.spill_tier("disk")._writing)
    info = disk_info(service)
    assert info["disk_write_drops_late"] == 2, info
    assert threading.current_thread().name not in writes.threads, "the loop wrote a chunk"
    fp = service.spill_tier("disk")._ns_fp(1)
    assert not any((fp, h) in service.spill_tier("disk").index.entries for _, h, _ in PROMPT_A[:2])
    index = service.spill_tier("disk").index
    assert len(index.entries) + len(index.free_slots) == index.num_slots  # none leaked
    assert lookup(service, session) == 0  # A0 is gone: a miss, not an error
    assert_nothing_held(service)


def test_a_write_ahead_pass_walks_the_lru_order_only_once_few_writes_are_in_flight(
        disk_service, monkeypatch):
    service = disk_service
    writes = GatedWrites(monkeypatch)  # the writers hold every write: none ends
    session = greeted(service, LAYOUT)
    store_both(service, session, settled=False)
    in_flight = len(service.spill_tier("disk")._ahead)
    assert in_flight >= 1
    walks = []
    walk = service.pool.lru_values
    monkeypatch.setattr(service.pool, "lru_values", lambda *args: walks.append(args) or walk(*args))
    monkeypatch.setattr(disk_writes, "AHEAD_REFILL_AT", in_flight - 1)
    assert service.spill_tier("disk").write_ahead() == 0 and walks == []  # a commit's pass: no walk
    monkeypatch.setattr(disk_writes, "AHEAD_REFILL_AT", in_flight)
    service.spill_tier("disk").write_ahead()
    assert len(walks) == 1  # fell to the mark: one walk queues the next batch
    writes.go.set()
    settle(service, lambda: not service.spill_tier("disk")._writing)
    assert_nothing_held(service)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_chunk_evicted_during_its_write_ahead_is_never_committed(disk_service, monkeypatch,
                                                                   when):
    """The writer reads the block straight from the arena (no copy): a block reused while
    the writer reads it, before its data write or between it and the commit, is never
    indexed nor committed on disk under the old key."""
    service = disk_service
    writes = GatedWrites(monkeypatch, when)
    session = greeted(service, LAYOUT)
    for _, chunk_hash, record in PROMPT_A + PROMPT_B[:2]:  # 6 blocks: the arena is full
        store_chunk(service, session, chunk_hash, record)
    a0_key = b"c" + (1).to_bytes(4, "little") + PROMPT_A[0][1]
    a0_blocks = service.pool.cached[a0_key]
    # A0, least recently used, is written first
    a0_write = service.spill_tier("disk")._ahead[a0_key]
    deadline = time.monotonic() + 10
    while a0_write.slot not in writes.slots:
        assert time.monotonic() < deadline, "A0's write ahead never started"
        time.sleep(0.005)
    (old_block,) = a0_blocks
    # The writer holds A0's block: B2 evicts A0 and overwrites that block.
    _, chunk_hash, record = PROMPT_B[2]
    assert store_chunk(service, session, chunk_hash, record) == old_block.block_id
    writes.go.set()
    settle(service, lambda: not service.spill_tier("disk")._writing)
    fp = service.spill_tier("disk")._ns_fp(1)
    assert (fp, PROMPT_A[0][1]) not in service.spill_tier("disk").index.entries, \
        "B2's bytes were indexed under A0's key"
    committed = scan_slots(service.spill_tier("disk").slots)
    assert PROMPT_A[0][1] not in {h.chunk_hash for h in committed}, \
        "B2's bytes were committed on disk under A0's key: a restart would index them"
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
    monkeypatch.setattr(SlotFile, "write_record", fail)
    session = stored_and_settled(service)
    info = disk_info(service)
    assert info[f"disk_errors_{kind}"] >= 1
    assert info["disk_write_failures"] == info[f"disk_errors_{kind}"]
    assert info["disk_writes"] == 0 and info["disk_used_slots"] == 0
    # every slot given back once erased (it may have held a chunk)
    index = service.spill_tier("disk").index
    settle(service, lambda: len(index.free_slots) == index.num_slots)
    assert lookup(service, session) == arena_prefix(service) < 4  # a miss, not an error
    assert info["disk_fetches"] == 0
    assert_nothing_held(service)


def test_a_failing_read_is_a_counted_miss_and_the_slot_is_forgotten(disk_service, monkeypatch):
    service = disk_service
    session = stored_and_settled(service)
    first_missing = arena_prefix(service)
    fp = service.spill_tier("disk")._ns_fp(1)
    assert (fp, PROMPT_A[first_missing][1]) in service.spill_tier("disk").index.entries

    def fail(self, *args):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(SlotFile, "read", fail)
    assert lookup(service, session) == first_missing
    info = disk_info(service)
    assert info["disk_errors_io"] == 1 and info["disk_fetch_failures"] == 1
    assert (fp, PROMPT_A[first_missing][1]) not in service.spill_tier("disk").index.entries, \
        "the slot that failed is never read again"
    assert_nothing_held(service)


@pytest.mark.parametrize("request_type", ["clear", "evict"])
def test_clear_and_evict_erase_disk_copies_so_that_a_restart_does_not_bring_them_back(
        disk_service, request_type):
    service = disk_service
    session = stored_and_settled(service)
    tier = service.spill_tier("disk")
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
    restarted, kept = SlotFile.open(tier.disk_directory, tier.slots.slot_bytes, tier.slots.num_slots)
    found = {h.chunk_hash for h in scan_slots(restarted)}
    restarted.close()
    assert kept and not found & set(on_disk), "a restart would serve an erased chunk"


def test_a_slot_that_cannot_be_read_at_start_is_skipped_counted_and_the_rest_restored(
        unique_name, tmp_path, monkeypatch, caplog):
    directory = str(tmp_path / "disk")
    layout, chunks = full_blocks(BLOCK_BYTES, 4)
    service = written_then_restarted(unique_name, directory, BLOCK_BYTES, chunks, layout)
    close_disk_service(service)
    bad_offset = PAGE_BYTES + slot_bytes_for(BLOCK_BYTES)  # slot 1's envelope: a bad sector
    pread = os.pread

    def failing_pread(fd, length, offset):
        if offset == bad_offset:
            raise OSError(errno.EIO, "Input/output error")
        return pread(fd, length, offset)
    monkeypatch.setattr(os, "pread", failing_pread)
    service = open_disk_service(f"{unique_name}-3", directory)  # rebuilds the index
    try:
        assert service.spill_tier("disk").num_restored == len(chunks) - 1
        assert disk_info(service)["disk_errors_io"] == 1
        assert "1 slot envelope(s) could not be read at start (io)" in caplog.text
        index = service.spill_tier("disk").index
        assert len(index.free_slots) == index.num_slots - 3
    finally:
        close_disk_service(service)


def test_a_slot_file_deleted_under_the_daemon_is_reported_and_still_served(disk_service, caplog):
    service = disk_service
    session = stored_and_settled(service)
    os.unlink(service.spill_tier("disk").slots.path)
    service.housekeeping()
    assert disk_info(service)["disk_file_deleted"] == 1
    assert "the slot file was deleted" in caplog.text
    assert lookup(service, session) == 4  # through the open descriptor, until a restart
    assert_nothing_held(service)


@pytest.mark.parametrize("block_bytes,value_bytes,on_disk", [
    (BLOCK_BYTES, BLOCK_BYTES + 100, False),  # a slot holds one block of whole pages
    (UNALIGNED_BLOCK_BYTES, UNALIGNED_BLOCK_BYTES + 500, True),  # fits the slot's pages
    (UNALIGNED_BLOCK_BYTES, 2 * UNALIGNED_BLOCK_BYTES - 100, False)])
def test_a_value_of_two_blocks_is_written_if_it_fits_a_slot_else_counted_once_when_evicted(
        unique_name, tmp_path, caplog, block_bytes, value_bytes, on_disk):
    service = open_disk_service(unique_name, str(tmp_path / "disk"),
                                block_bytes)
    try:
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
        disk = service.spill_tier("disk")
        assert ((disk._ns_fp(2), big_hash) in disk.index.entries) == on_disk
        warnings = [r.getMessage() for r in caplog.records if "never written to disk" in
                    r.getMessage()]
        if on_disk:
            assert warnings == []
        else:  # once, naming the namespace and the --block-size that fits its records
            assert len(warnings) == 1 and "disk-big" in warnings[0], warnings
            assert f"--block-size {-(-value_bytes // 4096) * 4096} or more" in warnings[0]
        assert_nothing_held(service)
    finally:
        close_disk_service(service)


def full_blocks(block_bytes: int, num_chunks: int = NUM_BLOCKS):
    """(layout, chain) of chunks whose records fill their blocks to the last byte."""
    chunks = chain(num_chunks, block_bytes - (RECORD_BYTES - KV_BYTES), first_token=7000)
    assert all(len(record) == block_bytes for _, _, record in chunks)
    return Layout("disk-full-blocks", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, block_bytes), chunks


def written_then_restarted(name: str, directory: str, block_bytes: int, chunks, layout,
                           num_blocks: int = NUM_BLOCKS):
    """Store `chunks` into every block of an arena with a write-through disk tier, stop
    it, and start another on the same directory (a warm restart: an empty arena)."""
    service = open_disk_service(name, directory, block_bytes, "write-through", num_blocks)
    try:
        session = greeted(service, layout)
        for _, chunk_hash, record in chunks:  # one at a time: write-through pins 1/4
            store_chunk(service, session, chunk_hash, record)
            settle(service, lambda: not service.spill_tier("disk")._writing)
        assert disk_info(service)["disk_writes"] == len(chunks)
    finally:
        close_disk_service(service)
    return open_disk_service(f"{name}-2", directory, block_bytes, num_blocks=num_blocks)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("block_bytes", [BLOCK_BYTES, UNALIGNED_BLOCK_BYTES],
                         ids=["whole_pages", "unaligned"])
def test_records_move_between_the_arena_and_the_disk_in_place_and_bit_exact(
        unique_name, tmp_path, monkeypatch, direct, block_bytes):
    """Records that fill every block of the arena, its last included, go to disk and come
    back into new blocks after a warm restart byte for byte: with no copy (straight
    between the blocks and the file) where O_DIRECT takes whole pages or I/O is
    buffered, through a thread's buffer where O_DIRECT cannot (blocks that are not
    whole pages: the last page of the arena's last block would end past the mapping)."""
    if not direct:  # as on tmpfs
        monkeypatch.setattr(SlotFile, "_reopen_direct", staticmethod(lambda *args: None))
    copies = []
    for method in ("_copy_out", "_thread_buffer"):
        original = getattr(DiskTier, method)
        monkeypatch.setattr(DiskTier, method, lambda tier, *args, original=original, name=method:
                            copies.append(name) or original(tier, *args))
    in_place = not direct or block_bytes % 4096 == 0
    layout, chunks = full_blocks(block_bytes)
    directory = str(tmp_path / "disk")
    service = written_then_restarted(unique_name, directory, block_bytes, chunks, layout)
    try:
        assert disk_info(service)["disk_direct_io"] == int(direct)
        disk = service.spill_tier("disk")
        assert disk.num_restored == NUM_BLOCKS
        fp = namespace_fingerprint(layout)
        for _, chunk_hash, record in chunks:  # the event feed's read of a chunk's tokens
            assert disk.token_ids((fp, chunk_hash)) == record[64:64 + 16 * 8]
        assert disk.token_ids((fp, chunks[1][1][::-1])) is None  # not on disk
        assert bool(copies) != in_place, copies
        session = greeted(service, layout)
        hashes = b"".join(h for _, h, _ in chunks)
        reply = service.handle(session, Lookup([1], hashes))
        assert isinstance(reply, Deferred)
        settle(service, lambda: reply.job.done)
        assert service.resume(session, reply).num_chunks == NUM_BLOCKS
        reply = service.handle(session, Acquire([1], hashes))
        assert sorted(reply.block_ids) == list(range(NUM_BLOCKS))  # the last block too
        arena = service.arena
        for block_id, n, (_, _, record) in zip(reply.block_ids, reply.num_bytes, chunks):
            assert bytes(arena.numpy_view(arena.block_offset(block_id), n)) == record
        service.handle(session, Release([reply.lease]))
        assert disk_info(service)["disk_fetch_failures"] == 0
        assert bool(copies) != in_place, copies
        assert_nothing_held(service)
    finally:
        close_disk_service(service)


def test_a_slot_that_fails_its_checks_in_the_arena_blocks_gives_them_back(unique_name,
                                                                          tmp_path):
    """A record read straight into fresh arena blocks is verified there before its
    commit: a changed byte makes it a counted miss, its blocks (and those of the
    chunks after it) go back to the free queue, none pinned or WRITING."""
    layout, chunks = full_blocks(BLOCK_BYTES)
    directory = str(tmp_path / "disk")
    service = written_then_restarted(unique_name, directory, BLOCK_BYTES, chunks, layout)
    try:
        tier = service.spill_tier("disk")
        entry = tier.index.get((namespace_fingerprint(layout), chunks[2][1]))
        with open(tier.slots.path, "r+b") as f:  # a KV byte of chunk 2's record
            f.seek(tier.slots.slot_offset(entry.slot) + 4096 + BLOCK_BYTES - 1)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        session = greeted(service, layout)
        reply = service.handle(session, Lookup([1], b"".join(h for _, h, _ in chunks)))
        settle(service, lambda: reply.job.done)
        assert service.resume(session, reply).num_chunks == 2
        info = disk_info(service)
        assert info["disk_fetch_verify_checksum"] == 1 and info["disk_fetch_hit_chunks"] == 2
        assert len(service.pool.cached) == 2
        assert service.pool.num_empty_blocks == NUM_BLOCKS - 2  # the others given back
        assert_nothing_held(service)
    finally:
        close_disk_service(service)


DERIVED_ARENA_BYTES = 512 << 10  # 64 blocks of 8 KiB (prompt A's), 128 of 4 KiB


def open_derived_service(name: str, path: str) -> CacheService:
    """A daemon's start without --block-size on the disk directory `path`: the arena has
    no block size until the first HELLO; the slot file an earlier daemon left is opened
    with its own slot size and its index rebuilt (`startup.open_disk_tier`), before any
    layout attaches. Write-through, so that every stored chunk reaches the disk."""
    arena = Arena.create(name, HEADER_BYTES + DERIVED_ARENA_BYTES, 0, prefault=False)
    service = CacheService(ServerConfig(name=arena.name, socket="/nonexistent",
                                        max_session_share=100.0), arena)
    directory = prepare_disk_directory(path)
    tier = DiskTier(directory, DirectoryLock(directory), capacity_bytes=(16 << 20),
                    policy="write-through", fetch_wait_s=5.0, arena=arena, jobs=service.jobs)
    if tier.open_file(arena.block_bytes):
        tier.rebuild_index()
    service.attach_tier(tier)
    return service


def read_values(service: CacheService, reply: BlocksReply) -> list[bytes]:
    """The bytes of every value of an ACQUIRE's reply, each gathered from its blocks."""
    arena, out = service.arena, []
    for span, num_bytes in zip(reply.spans(), reply.num_bytes):
        data = b"".join(bytes(arena.numpy_view(arena.block_offset(block_id), arena.block_bytes))
                        for block_id in span)
        out.append(data[:num_bytes])
    return out


@pytest.mark.parametrize("other_record_bytes,fits", [(2000, True), (3 * PAGE_BYTES, False)],
                         ids=["smaller_blocks", "larger_blocks"])
def test_a_warm_restart_keeps_its_disk_tier_whichever_layout_attaches_first(
        unique_name, tmp_path, caplog, other_record_bytes, fits):
    """Without --block-size the first layout that attaches sets the block size. Layout A
    stored prompt A (on disk in slots sized for A's 8 KiB blocks); after a restart layout
    B attaches first and sets other blocks: the slot file keeps its slots and A's chunks,
    so A hits them, read back bit-exact (into two 4 KiB blocks each where B's blocks
    are smaller). Where B's records do not fit the slots, a warning names the file, its
    slot size and the --block-size that keeps it."""
    path = str(tmp_path / "disk")
    service = open_derived_service(unique_name, path)
    try:
        session = greeted(service, LAYOUT)
        assert service.arena.block_bytes == 2 * PAGE_BYTES
        for _, chunk_hash, record in PROMPT_A:
            store_chunk(service, session, chunk_hash, record)
            settle(service, lambda: not service.spill_tier("disk")._writing)
        assert disk_info(service)["disk_writes"] == len(PROMPT_A)
    finally:
        close_disk_service(service)
    slot_bytes = slot_bytes_for(2 * PAGE_BYTES)

    other = Layout("disk-other", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, other_record_bytes)
    service = open_derived_service(f"{unique_name}-2", path)
    try:
        assert service.spill_tier("disk").num_restored == len(PROMPT_A)
        session = greeted(service, other, LAYOUT)  # B first: it sets the block size
        assert service.arena.block_bytes == round_up(other_record_bytes)
        info = disk_info(service)
        assert info["disk_slot_bytes"] == slot_bytes and info["disk_used_slots"] == len(PROMPT_A)
        reply = service.handle(session, Lookup([2], HASHES_A))
        if isinstance(reply, Deferred):
            settle(service, lambda: reply.job.done)
            reply = service.resume(session, reply)
        assert reply.num_chunks == len(PROMPT_A), "the restart lost A's chunks on disk"
        reply = service.handle(session, Acquire([2], HASHES_A))
        assert read_values(service, reply) == [record for _, _, record in PROMPT_A]
        assert [len(span) for span in reply.spans()] == \
            [-(-RECORD_BYTES // service.arena.block_bytes)] * len(PROMPT_A)
        service.handle(session, Release([reply.lease]))
        warnings = [r.getMessage() for r in caplog.records if "keeps its slots" in r.getMessage()
                    and r.levelname == "WARNING"]
        if fits:
            assert warnings == []
        else:
            assert len(warnings) == 1, warnings
            path = service.spill_tier("disk").slots.path
            assert (f"disk tier {path} keeps its slots of {slot_bytes} bytes"
                    in warnings[0] and "--block-size 8192 to keep this file" in warnings[0]), \
                warnings[0]
        assert_nothing_held(service)
    finally:
        close_disk_service(service)


@pytest.mark.parametrize("block_bytes", [1024, 1600])
def test_spanned_records_go_to_disk_and_come_back_bit_exact_when_they_fit_a_slot(
        unique_name, tmp_path, block_bytes):
    """A chunk larger than one block spans several; it goes to disk when its record fits a
    slot (the block size rounded up to whole 4 KiB pages: 4 KiB for blocks of 1024 or
    1600 bytes), and a warm restart reads it back into as many fresh blocks, byte for
    byte (docs/operator.md, "The disk tier")."""
    record_bytes = 3000  # 3 blocks of 1024, 2 of 1600; one page of a slot
    chunks = chain(2, record_bytes - (RECORD_BYTES - KV_BYTES), first_token=9000)
    assert all(len(record) == record_bytes for _, _, record in chunks)
    layout = Layout("disk-spanned", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, record_bytes)
    service = written_then_restarted(unique_name, str(tmp_path / "disk"), block_bytes, chunks,
                                     layout, num_blocks=24)
    try:
        assert service.spill_tier("disk").num_restored == len(chunks)
        session = greeted(service, layout)
        hashes = b"".join(h for _, h, _ in chunks)
        reply = service.handle(session, Lookup([1], hashes))
        assert isinstance(reply, Deferred)
        settle(service, lambda: reply.job.done)
        assert service.resume(session, reply).num_chunks == len(chunks)
        reply = service.handle(session, Acquire([1], hashes))
        assert [len(span) for span in reply.spans()] == [-(-record_bytes // block_bytes)] * 2
        assert read_values(service, reply) == [record for _, _, record in chunks]
        service.handle(session, Release([reply.lease]))
        assert disk_info(service)["disk_fetch_failures"] == 0
        assert_nothing_held(service)
    finally:
        close_disk_service(service)


def test_a_fetch_held_between_read_and_commit_installs_nothing_after_a_clear(
        disk_service, monkeypatch):
    service = disk_service
    session = stored_and_settled(service)
    store_chunk(service, session, PROMPT_A[0][1], PROMPT_A[0][2])  # the chain's arena part
    settle(service, lambda: not service.spill_tier("disk")._writing)
    assert 1 <= arena_prefix(service) < 4
    read_done, go_on = threading.Event(), threading.Event()
    read_item = DiskTier._read_item

    def read_then_wait(self, item, page):  # reader thread: read and verified, not committed
        read_item(self, item, page)
        read_done.set()
        assert go_on.wait(10)
    monkeypatch.setattr(DiskTier, "_read_item", read_then_wait)
    reply = service.handle(session, Lookup([1], HASHES_A))
    assert isinstance(reply, Deferred)
    assert read_done.wait(10)
    assert service.pool.num_pinned_blocks > 0  # the fetch pins the chain's arena part
    assert service.handle(session, Clear()).count > 0
    pool = service.pool
    assert not pool.cached and pool.num_pinned_blocks == 0, \
        "CLEAR leaves nothing indexed and nothing pinned by a fetch"
    go_on.set()
    settle(service, lambda: reply.job.done)
    assert isinstance(service.resume(session, reply), LookupReply)
    assert not pool.cached, "a fetch started before CLEAR installed a chunk after it"
    reply = service.handle(session, Acquire([1], HASHES_A))
    assert isinstance(reply, BlocksReply) and reply.block_ids == []
    assert disk_info(service)["disk_fetch_hit_chunks"] == 0
    assert_nothing_held(service)


def test_a_wrong_parent_is_the_requests_miss_and_never_forgets_the_slot(disk_service):
    service = disk_service
    session = stored_and_settled(service)
    tier = service.spill_tier("disk")
    assert service.handle(session, Evict(key=PROMPT_A[0][1].hex())).count >= 1
    settle(service, lambda: len(tier._writes) == 0 and not tier._writing)
    store_chunk(service, session, PROMPT_A[0][1], PROMPT_A[0][2])  # back in the arena only
    service.pool.evict(b"c" + (1).to_bytes(4, "little") + PROMPT_A[1][1])
    fp = tier._ns_fp(1)
    assert arena_prefix(service) == 1 and (fp, PROMPT_A[1][1]) in tier.index.entries
    wrong = Lookup([1], HASHES_A[16:], parent=b"\x07" * 16)  # chunk 1 after a wrong parent
    reply = service.handle(session, wrong)
    if isinstance(reply, Deferred):
        settle(service, lambda: reply.job.done)
        reply = service.resume(session, reply)
    assert reply.num_chunks == 0, "a chunk verified from a wrong parent was served"
    assert disk_info(service)["disk_fetch_verify_tokens"] == 1
    assert (fp, PROMPT_A[1][1]) in tier.index.entries, "a request's wrong parent forgot a slot"
    assert lookup(service, session) == 4  # the right chain still hits every chunk
    assert_nothing_held(service)


def test_a_cancelled_write_ahead_erases_the_slot_of_the_chunk_it_evicted(disk_service):
    service = disk_service
    session = stored_and_settled(service)
    tier = service.spill_tier("disk")
    index = tier.index
    num_unused = len(index.free_slots)
    index.free_slots.clear()  # every later write takes the slot of the disk LRU's chunk
    victims = {e.slot: key for key, e in index.entries.items()}
    store_both(service, session, settled=False)  # write-aheads overtaken by evictions
    # Settled once every slot is indexed or back among the empty ones: no write and no
    # erase (queued, or on a writer thread) is left.
    settle(service, lambda: len(tier._writes) == 0 and not tier._writing and
           len(index.entries) + len(index.free_slots) + num_unused == index.num_slots)
    forgotten = set(victims) - {e.slot for e in index.entries.values()}
    assert forgotten, "no chunk was evicted from the disk"
    restarted, _ = SlotFile.open(tier.disk_directory, tier.slots.slot_bytes, tier.slots.num_slots)
    found = {h.slot: (h.ns_fp, h.chunk_hash) for h in scan_slots(restarted)}
    restarted.close()
    indexed = {e.slot: key for key, e in index.entries.items()}
    assert found == indexed, "a slot the index forgot keeps a chunk a restart would serve"


def test_invalidate_forgets_and_erases_the_disk_copy_so_that_a_restart_does_not_serve_it(
        disk_service):
    service = disk_service
    session = greeted(service, LAYOUT)
    store_both(service, session)  # the arena is full: chunks next in line written ahead
    tier = service.spill_tier("disk")
    fp = tier._ns_fp(1)
    pool_prefix = b"c" + (1).to_bytes(4, "little")
    both = [h for _, h, _ in PROMPT_A + PROMPT_B
            if (fp, h) in tier.index.entries and pool_prefix + h in service.pool.cached]
    assert both, "no chunk is in the arena and on disk at once"
    chunk_hash = both[0]
    block_ref = service.pool.cached[pool_prefix + chunk_hash][0].ref
    assert service.handle(session, Invalidate(1, chunk_hash, [block_ref])) is None
    assert (fp, chunk_hash) not in tier.index.entries, "the disk would serve it back"
    settle(service, lambda: len(tier._writes) == 0 and not tier._writing)
    service.jobs.process_completions()
    restarted, _ = SlotFile.open(tier.disk_directory, tier.slots.slot_bytes, tier.slots.num_slots)
    found = {h.chunk_hash for h in scan_slots(restarted)}
    restarted.close()
    assert chunk_hash not in found, "a restart would serve an invalidated chunk"
    assert_nothing_held(service)
