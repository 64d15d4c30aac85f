"""Device tiers in the daemon, in one process: block references, placement, read
preference, demotion to the host arena, and what a session may see (lmcached/daemon/memory_tiers.py,
lmcached/daemon/demotion.py, lmcached/daemon/service.py).

The device tier here is host memory behind the device-tier interface (a "fake" tier,
as CI runs it); its copies can be held back and made to fail, so that every step of a
demotion is observed from the loop's side.
"""

import os
import threading
import time

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcached.daemon.server_config import ServerConfig
from lmcached.daemon.demotion import DEMOTION_STATS, reserve_blocks
from lmcached.daemon.metrics import metric_families, take_snapshot
from lmcached.wire.frames import request_decoder
from lmcached.wire.protocol import (
    ALLOCATED,
    EXISTS,
    HASH_BYTES,
    PROTOCOL_VERSION,
    Acquire,
    Alloc,
    Clear,
    Clients,
    Commit,
    Error,
    Events,
    Evict,
    Hello,
    HelloReply,
    Info,
    Layout,
    Lookup,
    OpenTier,
    Release,
    Subscribe,
    TierHandle,
    TierInfo,
    block_ref,
    local_block,
    tier_of,
)
from lmcached.daemon.service import CacheService
from lmcached.shm.arena import HEADER_BYTES, Arena
from lmcached.daemon.block_pool import BlockPool

BLOCK_BYTES = 64 << 10
HOST_BLOCKS = 32
DEVICE_BLOCKS = 8
RECORD_BYTES = 1000
DEVICE = "fake-0"
LAYOUT = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, RECORD_BYTES)


class GatedDeviceMemory:
    """A device tier backed by a host arena, whose copies the test can hold and fail."""

    kind = "fake"

    def __init__(self, name: str, num_blocks: int, extra_bytes: int = 0) -> None:
        self.device = DEVICE
        self.arena = Arena.create(name, HEADER_BYTES + num_blocks * BLOCK_BYTES + extra_bytes,
                                  prefault=False)
        self.size_bytes = self.arena.capacity_bytes
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.copies = 0
        self._fd_r, self._fd_w = os.pipe()

    block_bytes = property(lambda self: self.arena.block_bytes)
    num_blocks = property(lambda self: self.arena.num_blocks)

    def set_block_bytes(self, block_bytes: int) -> None:
        self.arena.set_block_bytes(block_bytes)

    def export_fd(self) -> int:
        return self._fd_r

    def copy_to_host(self, block_id: int, nbytes: int, dst: np.ndarray) -> None:
        assert self.gate.wait(10), "test never opened the gate"
        if self.fail:
            raise OSError("injected device error")
        dst[:] = self.arena.numpy_view(self.arena.block_offset(block_id), nbytes)
        self.copies += 1

    def close(self) -> None:
        os.close(self._fd_r)
        os.close(self._fd_w)
        self.arena.close()


@pytest.fixture
def tiered(unique_name):
    """A service with a 32-block host arena and one 8-block device tier "fake-0"."""
    arena = Arena.create(unique_name, HEADER_BYTES + HOST_BLOCKS * BLOCK_BYTES, BLOCK_BYTES,
                         prefault=False)
    device = GatedDeviceMemory(unique_name + "-dev", DEVICE_BLOCKS)
    service = CacheService(ServerConfig(name=unique_name, socket="/nonexistent"), arena,
                           [device])
    yield service, device
    device.gate.set()
    service.close()
    device.close()
    arena.close()


def hashes(ids) -> bytes:
    return b"".join(i.to_bytes(HASH_BYTES, "little") for i in ids)


def hello(service, devices=()):
    session = service.open_session(os.getpid(), os.geteuid(), 0)
    reply = service.handle(session, Hello(PROTOCOL_VERSION, os.getpid(), "t", [LAYOUT],
                                          list(devices)))
    assert isinstance(reply, HelloReply), reply
    return session, reply


def write_and_commit(service, session, ids, tier=1, fill=None):
    """ALLOC + fill each block with its chunk id + COMMIT; returns the refs."""
    alloc = service.handle(session, Alloc(1, hashes(ids), [RECORD_BYTES] * len(ids), tier))
    assert alloc.status == [ALLOCATED] * len(ids), alloc
    for ref, chunk in zip(alloc.block_ids, ids):
        block_view(service, ref)[:] = chunk % 251 if fill is None else fill
    assert service.handle(session, Commit(alloc.block_ids)).__class__.__name__ == "Ok"
    return alloc.block_ids


def block_view(service, ref) -> np.ndarray:
    memory = service.tiers.tiers[tier_of(ref)].memory
    arena = memory if isinstance(memory, Arena) else memory.arena
    return arena.numpy_view(arena.block_offset(local_block(ref)), RECORD_BYTES)


def drain_demotions(service, deadline_s: float = 10.0) -> None:
    """Let the demotion worker finish everything queued, finishing on 'the loop'."""
    end = time.monotonic() + deadline_s
    demoter = service.demoter
    while any(demoter.demoting_blocks):
        assert time.monotonic() < end, "demotions did not finish"
        time.sleep(0.005)
        service.jobs.process_completions()


def tier_keys(service, tier_id) -> set:
    return set(service.tiers.pools[tier_id].cached)


# ----------------------------------------------------------------- block refs
@given(st.integers(0, 16), st.integers(0, (1 << 32) - 1))
def test_block_refs_round_trip_and_host_refs_are_block_ids(tier, block):
    ref = block_ref(tier, block)
    assert (tier_of(ref), local_block(ref)) == (tier, block)
    if tier == 0:
        assert ref == block


def test_a_pool_names_its_tier_in_every_block_ref():
    pool = BlockPool(4, tier_id=3)
    assert [b.ref for b in pool.blocks] == [3 << 32 | i for i in range(4)]


# ---------------------------------------------------------------------- HELLO
def test_hello_announces_every_tier_and_sets_read_preference(tiered):
    service, _ = tiered
    gpu, reply = hello(service, [DEVICE])
    assert reply.tiers == [
        TierInfo(0, "host", "", service.arena.capacity_bytes, BLOCK_BYTES, HOST_BLOCKS),
        TierInfo(1, "fake", DEVICE, service.tiers.tiers[1].size_bytes, BLOCK_BYTES,
                 DEVICE_BLOCKS),
    ]
    assert gpu.readable == (1, 0)
    assert hello(service)[0].readable == (0,)
    assert hello(service, ["*"])[0].readable == (0, 1)
    assert hello(service, ["GPU-not-here"])[0].readable == (0,)


def test_open_tier_is_only_for_the_sessions_own_devices(tiered):
    service, device = tiered
    gpu, _ = hello(service, [DEVICE])
    handle = service.handle(gpu, OpenTier(1))
    assert handle == TierHandle(1, service.arena.generation, "fake", DEVICE, device.size_bytes)
    assert gpu.reply_fds == [device.export_fd()]
    gpu.reply_fds = []  # as the server takes them
    again = service.handle(gpu, OpenTier(1))  # once per session: fds in flight are bounded
    assert isinstance(again, Error) and again.code == "bad_request", again
    assert gpu.reply_fds == []
    for devices in ([], ["*"], ["GPU-other"]):
        session, _ = hello(service, devices)
        reply = service.handle(session, OpenTier(1))
        assert isinstance(reply, Error) and reply.code == "bad_tier", reply
        assert session.reply_fds == []


def test_alloc_for_a_tier_the_session_did_not_ask_for_is_refused(tiered):
    service, _ = tiered
    host_only, _ = hello(service)
    reply = service.handle(host_only, Alloc(1, hashes([1]), [RECORD_BYTES], 1))
    assert isinstance(reply, Error) and reply.code == "bad_tier"
    assert service.pool.num_writing_blocks == 0
    service.tiers.check_invariants()


# ------------------------------------------------------------------ placement
def test_chunks_go_to_the_device_tier_while_it_has_empty_blocks_then_to_the_host(tiered):
    service, device = tiered
    device.gate.clear()  # no demotion completes during the ALLOC
    gpu, _ = hello(service, [DEVICE])
    ids = list(range(1, 13))
    alloc = service.handle(gpu, Alloc(1, hashes(ids), [RECORD_BYTES] * 12, 1))
    assert alloc.status == [ALLOCATED] * 12
    assert [tier_of(r) for r in alloc.block_ids] == [1] * DEVICE_BLOCKS + [0] * 4
    assert service.tiers.pools[1].stats.evictions == 0  # placement never evicts a device
    service.handle(gpu, Commit(alloc.block_ids))
    service.tiers.check_invariants()


def test_a_host_only_session_never_sees_device_chunks_and_stores_its_own_copy(tiered):
    service, device = tiered
    device.gate.clear()  # keep the chunks on the device
    gpu, _ = hello(service, [DEVICE])
    write_and_commit(service, gpu, [1, 2, 3])
    host_only, _ = hello(service)
    assert service.handle(host_only, Lookup([1], hashes([1, 2, 3]))).num_chunks == 0
    blocks = service.handle(host_only, Acquire([1], hashes([1, 2, 3])))
    assert blocks.block_ids == [] and blocks.lease == 0
    alloc = service.handle(host_only, Alloc(1, hashes([1, 2]), [RECORD_BYTES] * 2))
    assert alloc.status == [ALLOCATED, ALLOCATED]
    assert all(tier_of(r) == 0 for r in alloc.block_ids)
    service.handle(host_only, Commit(alloc.block_ids))
    # The key is now READY in both tiers; the device session reads its own tier first.
    pinned = service.handle(gpu, Acquire([1], hashes([1, 2, 3])))
    assert [tier_of(r) for r in pinned.block_ids] == [1, 1, 1]
    assert service.handle(gpu, Alloc(1, hashes([1]), [RECORD_BYTES], 1)).status == [EXISTS]
    service.handle(gpu, Release([pinned.lease]))
    service.tiers.check_invariants()


def test_a_scheduler_session_pins_chunks_of_any_tier(tiered):
    service, device = tiered
    device.gate.clear()
    gpu, _ = hello(service, [DEVICE])
    refs = write_and_commit(service, gpu, [1, 2])
    scheduler, _ = hello(service, ["*"])
    pinned = service.handle(scheduler, Acquire([1], hashes([1, 2, 3])))
    assert pinned.block_ids == refs
    service.close_session(scheduler)  # a crashed scheduler releases device pins too
    assert service.tiers.pools[1].num_pinned_blocks == 0
    service.tiers.check_invariants()


def test_a_kv_adapter_namespace_stays_on_the_host(tiered):
    service, _ = tiered
    kv_layout = Layout("store", 1, 0, "kv", "uint8", 1, 1, 1, 1, 1)
    session = service.open_session(os.getpid(), os.geteuid(), 0)
    service.handle(session, Hello(PROTOCOL_VERSION, os.getpid(), "kv", [kv_layout], [DEVICE]))
    ns = session.namespaces[0]
    alloc = service.handle(session, Alloc(ns, hashes([5]), [RECORD_BYTES], 1))
    assert [tier_of(r) for r in alloc.block_ids] == [0]


# -------------------------------------------------------------------- demotion
def test_demotion_keeps_a_reserve_of_empty_device_blocks_and_moves_bytes_exactly(tiered):
    service, device = tiered
    gpu, _ = hello(service, [DEVICE])
    ids = list(range(1, DEVICE_BLOCKS + 1))
    write_and_commit(service, gpu, ids)
    drain_demotions(service)
    pool = service.tiers.pools[1]
    assert pool.num_empty_blocks == reserve_blocks(DEVICE_BLOCKS)
    demoted = tier_keys(service, 0)
    assert len(demoted) == reserve_blocks(DEVICE_BLOCKS) == service.demoter.stats.demotions
    assert not demoted & tier_keys(service, 1)
    # The least recently used chunk went first (chunk 1: committed first, never read).
    assert service.tiers.find(next(iter(demoted)), (0,))[0].num_bytes == RECORD_BYTES
    # Every chunk still reads back, from whichever tier, with its own bytes.
    pinned = service.handle(gpu, Acquire([1], hashes(ids)))
    assert len(pinned.block_ids) == len(ids)
    for ref, chunk in zip(pinned.block_ids, ids):
        assert (block_view(service, ref) == chunk % 251).all(), (chunk, tier_of(ref))
    assert tier_of(pinned.block_ids[0]) == 0  # chunk 1 was demoted
    assert service.demoter.stats.demoted_bytes == RECORD_BYTES * len(demoted)
    service.handle(gpu, Release([pinned.lease]))
    service.tiers.check_invariants()


def test_a_pinned_device_chunk_is_never_demoted(tiered):
    service, _ = tiered
    gpu, _ = hello(service, [DEVICE])
    reader, _ = hello(service, [DEVICE])
    ids = list(range(1, DEVICE_BLOCKS))
    write_and_commit(service, gpu, ids)
    drain_demotions(service)
    on_device = sorted(tier_keys(service, 1))
    pinned = service.handle(reader, Acquire([1], hashes(ids)))
    device_refs = [r for r in pinned.block_ids if tier_of(r) == 1]
    assert len(device_refs) == len(on_device)
    write_and_commit(service, gpu, [100])  # pressure on a tier whose values are pinned
    drain_demotions(service)
    assert sorted(tier_keys(service, 1)) >= on_device  # none of the pinned ones moved
    for ref in device_refs:
        assert service.tiers.pools[1].blocks[local_block(ref)].ref_cnt == 1
    service.handle(reader, Release([pinned.lease]))
    service.tiers.check_invariants()


def test_a_chunk_being_demoted_stays_readable_and_its_copy_lands_on_commit_only(tiered):
    service, device = tiered
    device.gate.clear()
    gpu, _ = hello(service, [DEVICE])
    ids = list(range(1, DEVICE_BLOCKS + 1))
    write_and_commit(service, gpu, ids)
    demoting = sum(service.demoter.demoting_blocks)
    assert demoting == reserve_blocks(DEVICE_BLOCKS)
    host = service.tiers.pools[0]
    assert host.num_writing_blocks == demoting and not host.cached  # invisible until done
    reader, _ = hello(service, [DEVICE])
    pinned = service.handle(reader, Acquire([1], hashes(ids)))
    assert [tier_of(r) for r in pinned.block_ids] == [1] * len(ids)
    device.gate.set()
    drain_demotions(service)
    assert len(host.cached) == demoting
    # The reader's pins were on the device copies: they stay valid until released.
    for ref, chunk in zip(pinned.block_ids, ids):
        assert (block_view(service, ref) == chunk % 251).all()
    service.handle(reader, Release([pinned.lease]))
    assert service.tiers.pools[1].num_pinned_blocks == 0
    service.tiers.check_invariants()


def test_a_chunk_evicted_while_it_is_copied_is_not_resurrected_on_the_host(tiered):
    service, device = tiered
    device.gate.clear()
    gpu, _ = hello(service, [DEVICE])
    write_and_commit(service, gpu, list(range(1, DEVICE_BLOCKS + 1)))
    assert sum(service.demoter.demoting_blocks) == 1
    admin = service.open_session(os.getpid(), os.geteuid(), 0)
    assert service.handle(admin, Evict(key=hashes([1]).hex()[:32])).count == 1
    assert service.handle(admin, Clear()).count == DEVICE_BLOCKS - 1
    device.gate.set()
    drain_demotions(service)
    assert not service.tiers.pools[0].cached
    assert service.demoter.stats.demotions_aborted == 1
    assert service.tiers.pools[0].num_writing_blocks == 0
    service.tiers.check_invariants()


def test_a_copy_error_aborts_the_host_blocks_and_fails_the_tier(tiered):
    service, device = tiered
    device.fail = True
    gpu, _ = hello(service, [DEVICE])
    write_and_commit(service, gpu, list(range(1, DEVICE_BLOCKS + 1)))
    drain_demotions(service)
    assert service.tiers.tiers[1].failed
    assert service.demoter.stats.errors_demotion == 1
    assert service.tiers.pools[0].num_writing_blocks == 0
    # Its chunks stay readable where they are; new chunks go to the host.
    assert len(tier_keys(service, 1)) == DEVICE_BLOCKS
    refs = write_and_commit(service, gpu, [50, 51])
    assert [tier_of(r) for r in refs] == [0, 0]
    info = service.handle(gpu, Info("memory")).sections["memory"]
    assert info["tier1_state"] == "failed"
    service.tiers.check_invariants()


def test_a_host_copy_makes_demotion_free_the_device_copy_without_a_second_one(tiered):
    service, device = tiered
    device.gate.clear()
    gpu, _ = hello(service, [DEVICE])
    host_only, _ = hello(service)
    write_and_commit(service, gpu, list(range(1, DEVICE_BLOCKS + 1)))  # chunk 1 demoting
    write_and_commit(service, host_only, [1, 2], tier=0)  # host copies meanwhile
    device.gate.set()
    drain_demotions(service)
    stats = service.demoter.stats
    assert (stats.demotions, stats.demotions_deduplicated) == (0, 1)  # 1: copied, dropped
    write_and_commit(service, gpu, [9])  # takes the empty block: chunk 2 (LRU) must go
    drain_demotions(service)
    assert stats.demotions_deduplicated == 2 and device.copies == 1  # 2: never copied
    assert tier_keys(service, 0) == {k for k in service.pool.cached}
    assert len(service.pool.cached) == 2 and service.pool.num_writing_blocks == 0
    assert not tier_keys(service, 0) & tier_keys(service, 1)
    service.tiers.check_invariants()


def test_a_session_that_ends_while_writing_to_the_device_gives_its_blocks_back(tiered):
    service, device = tiered
    device.gate.clear()
    gpu, _ = hello(service, [DEVICE])
    alloc = service.handle(gpu, Alloc(1, hashes([1, 2]), [RECORD_BYTES] * 2, 1))
    pinned_reader, _ = hello(service, [DEVICE])
    write_and_commit(service, pinned_reader, [7])
    lease = service.handle(pinned_reader, Acquire([1], hashes([7]))).lease
    assert lease
    service.close_session(gpu)
    service.close_session(pinned_reader)
    pool = service.tiers.pools[1]
    assert pool.num_writing_blocks == 0 and pool.num_pinned_blocks == 0
    assert alloc.block_ids  # they were device blocks
    service.tiers.check_invariants()


def test_info_lists_each_device_tier_and_the_demotion_counters(tiered):
    service, _ = tiered
    gpu, _ = hello(service, [DEVICE])
    write_and_commit(service, gpu, [1, 2])
    sections = service.handle(gpu, Info(None)).sections
    memory, blocks, stats = sections["memory"], sections["blocks"], sections["stats"]
    assert {k: memory[k] for k in memory if k.startswith("tier1_")} == {
        "tier1_kind": "fake", "tier1_device": DEVICE, "tier1_state": "ok",
        "tier1_capacity_bytes": service.tiers.tiers[1].size_bytes,
        "tier1_capacity_human": memory["tier1_capacity_human"],
        "tier1_stored_bytes": 2 * RECORD_BYTES, "tier1_stored_human": "1.95K",
    }
    assert memory["device_tiers"] == 1
    assert blocks["tier1_num_blocks"] == DEVICE_BLOCKS
    assert blocks["tier1_cached_blocks"] == 2 and blocks["tier1_free_blocks"] == 6
    assert blocks["cached_blocks"] == 0  # host fields describe the host arena
    assert set(DEMOTION_STATS) <= set(stats) and stats["tier1_hits"] == 0
    clients = service.handle(gpu, Clients()).clients
    assert {row["devices"] for row in clients} == {DEVICE}


def test_device_tier_metrics_equal_info(tiered):
    service, _ = tiered
    gpu, _ = hello(service, [DEVICE])
    write_and_commit(service, gpu, list(range(1, DEVICE_BLOCKS + 1)))
    drain_demotions(service)
    lease = service.handle(gpu, Acquire([1], hashes([8]))).lease
    snap = take_snapshot(service)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in metric_families(snap) for s in family.samples}
    info = snap.info

    def sample(name, **labels):
        if name.startswith("lmcached_tier"):
            labels.update(tier="1", device=DEVICE)
        return samples[(name, tuple(sorted(labels.items())))]

    assert sample("lmcached_tier_blocks", state="pinned") == 1
    assert sample("lmcached_tier_blocks", state="cached") \
        == info["blocks"]["tier1_cached_blocks"] == DEVICE_BLOCKS - 1
    assert sample("lmcached_tier_hit_chunks_total") == 1
    assert sample("lmcached_tier_up") == 1
    assert sample("lmcached_demotions_total") == info["stats"]["demotions"] == 1
    assert sample("lmcached_demoted_bytes_total") == RECORD_BYTES
    service.handle(gpu, Release([lease]))


# ------------------------------------------- clients from before tiers (still v2)
class HelloBeforeTiers(msgspec.Struct, tag="hello", array_like=True):
    version: int
    pid: int
    name: str
    layouts: list[Layout] = []


class HelloReplyBeforeTiers(msgspec.Struct, tag="hello_reply", array_like=True):
    session_id: int
    arena_name: str
    generation: int
    block_bytes: int
    num_blocks: int
    capacity_bytes: int
    namespaces: list[int]
    server_pid: int


class AllocBeforeTiers(msgspec.Struct, tag="alloc", array_like=True):
    ns: int
    hashes: bytes
    num_bytes: list[int]


def test_a_client_from_before_tiers_is_served_host_blocks_only(tiered):
    service, device = tiered
    device.gate.clear()
    gpu, _ = hello(service, [DEVICE])
    write_and_commit(service, gpu, [1, 2])  # device copies an old client must not get
    old = service.open_session(os.getpid(), os.geteuid(), 0)
    frame = msgspec.msgpack.encode(HelloBeforeTiers(PROTOCOL_VERSION, 1, "old", [LAYOUT]))
    reply = service.handle(old, request_decoder.decode(frame))
    old_reply = msgspec.msgpack.Decoder(HelloReplyBeforeTiers).decode(
        msgspec.msgpack.encode(reply))
    assert old_reply.namespaces == [1] and old_reply.block_bytes == BLOCK_BYTES
    assert old.readable == (0,)
    alloc = service.handle(old, request_decoder.decode(msgspec.msgpack.encode(
        AllocBeforeTiers(1, hashes([1, 2, 3]), [RECORD_BYTES] * 3))))
    assert alloc.status == [ALLOCATED] * 3 and max(alloc.block_ids) < HOST_BLOCKS
    service.handle(old, Commit(alloc.block_ids))
    pinned = service.handle(old, Acquire([1], hashes([1, 2, 3])))
    assert pinned.block_ids == alloc.block_ids
    service.handle(old, Release([pinned.lease]))
    service.tiers.check_invariants()


def test_a_device_tier_smaller_than_a_block_stays_unused(unique_name):
    arena = Arena.create(unique_name, HEADER_BYTES + HOST_BLOCKS * BLOCK_BYTES, BLOCK_BYTES,
                         prefault=False)
    device = GatedDeviceMemory(unique_name + "-dev", 0, BLOCK_BYTES // 2)  # half a block
    service = CacheService(ServerConfig(name=unique_name, socket="/nonexistent"), arena,
                           [device])
    try:
        gpu, reply = hello(service, [DEVICE])
        assert reply.tiers[1].num_blocks == 0 and service.tiers.pools[1] is None
        refs = write_and_commit(service, gpu, [1, 2])
        assert [tier_of(r) for r in refs] == [0, 0]
        assert service.demoter is None
    finally:
        service.close()
        device.close()
        arena.close()


def test_a_store_that_finds_the_tier_full_makes_room_for_the_next_one(tiered):
    service, _ = tiered
    gpu, _ = hello(service, [DEVICE])
    write_and_commit(service, gpu, list(range(1, DEVICE_BLOCKS + 1)))  # fills the tier
    drain_demotions(service)
    refs = write_and_commit(service, gpu, [20, 21, 22, 23])  # 1 empty block: 3 overflow
    assert [tier_of(r) for r in refs].count(0) == 3
    drain_demotions(service)
    assert service.tiers.pools[1].num_empty_blocks >= 4  # room for a store of that size
    refs = write_and_commit(service, gpu, [30, 31, 32, 33])
    assert [tier_of(r) for r in refs] == [1, 1, 1, 1]  # the newest chunks are on the device
    service.tiers.check_invariants()


def test_a_demotion_announces_each_chunk_it_installs_on_the_host_with_its_parent(tiered):
    """A device tier's COMMIT keeps the parents its ALLOC named (each chunk's the one
    before it in the ALLOC); a demotion installs the chunk in the host arena with that
    parent: one stored "cpu" event for each chunk demoted, none for the others."""
    service, _ = tiered
    gpu, _ = hello(service, [DEVICE])
    cursor = service.handle(gpu, Subscribe([])).cursor
    ids = list(range(1, DEVICE_BLOCKS + 1))
    write_and_commit(service, gpu, ids)
    assert {k: p for k, p in service.tiers.pools[1].ledger.parents.items()} == {
        b"c" + (1).to_bytes(4, "little") + hashes([i]): hashes([i - 1]) for i in ids[1:]}
    drain_demotions(service)
    demoted = tier_keys(service, 0)
    assert demoted
    reply = service.handle(gpu, Events(cursor, 0, False))
    stored = [(e.chunk_hash, e.parent) for e in reply.events
              if (e.kind, e.medium) == ("stored", "cpu")]
    assert sorted(stored) == sorted(
        (key[5:], hashes([int.from_bytes(key[5:], "little") - 1])
         if int.from_bytes(key[5:], "little") > 1 else b"") for key in demoted)
