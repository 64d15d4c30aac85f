"""A model-based test of device tiers with demotion: any interleaving of stores,
pins, releases, evictions, clears, crashes and demotion copies keeps every tier's
invariants, never moves a pinned chunk, and never indexes a chunk whose bytes are not
the ones stored under its key (hypothesis state machine, in one process; the copies of
the device tier are held back and released by the machine's own steps)."""

import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcached.daemon.server_config import ServerConfig
from lmcached.wire.protocol import (
    ALLOCATED,
    PROTOCOL_VERSION,
    Abort,
    Acquire,
    Alloc,
    Clear,
    Commit,
    Evict,
    Hello,
    Release,
    tier_of,
)
from lmcached.daemon.service import CacheService
from lmcached.shm.arena import HEADER_BYTES, Arena

from test_tiers import (
    BLOCK_BYTES,
    DEVICE,
    LAYOUT,
    RECORD_BYTES,
    GatedDeviceMemory,
    block_view,
    drain_demotions,
    hashes,
)

HOST_BLOCKS = 10
DEVICE_BLOCKS = 4
CHUNKS = st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True)
_machines = 0


class TieredCacheMachine(RuleBasedStateMachine):
    """Two clients with a device tier, one host-only; chunk i always holds bytes i."""

    def __init__(self) -> None:
        super().__init__()
        global _machines
        _machines += 1
        name = f"t{os.getpid()}m{_machines}"
        self.arena = Arena.create(name, HEADER_BYTES + HOST_BLOCKS * BLOCK_BYTES, BLOCK_BYTES,
                                  prefault=False)
        self.device = GatedDeviceMemory(name + "-dev", DEVICE_BLOCKS)
        self.device.gate.clear()
        self.service = CacheService(ServerConfig(name=name, socket="/nonexistent"),
                                    self.arena, [self.device])
        self.sessions = [self._hello([DEVICE]), self._hello([DEVICE]), self._hello([])]
        self.leases: list[tuple[int, int]] = []  # (session index, lease)
        self.pending: list[tuple[int, list[int], list[int]]] = []  # (session, refs, chunks)
        self.evicted: set[int] = set()  # chunks EVICTed and not committed since

    def _hello(self, devices):
        session = self.service.open_session(os.getpid(), os.geteuid(), 0)
        self.service.handle(session, Hello(PROTOCOL_VERSION, os.getpid(), "m", [LAYOUT],
                                           devices))
        return session

    def teardown(self) -> None:
        self.device.gate.set()
        self.service.close()
        self.device.close()
        self.arena.close()

    @rule(who=st.integers(0, 2), chunks=CHUNKS, commit=st.booleans())
    def store(self, who, chunks, commit):
        session = self.sessions[who]
        reply = self.service.handle(session, Alloc(1, hashes(chunks), [RECORD_BYTES] * len(chunks),
                                                   1 if who < 2 else 0))
        refs = iter(reply.block_ids)
        written, written_chunks = [], []
        for chunk, status in zip(chunks, reply.status):
            if status == ALLOCATED:
                ref = next(refs)
                block_view(self.service, ref)[:] = chunk % 251
                written.append(ref)
                written_chunks.append(chunk)
        if written and commit:
            self.service.handle(session, Commit(written))
            self.evicted -= set(written_chunks)
        elif written:
            self.pending.append((who, written, written_chunks))

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), commit=st.booleans())
    def finish_write(self, data, commit):
        who, refs, chunks = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        self.service.handle(self.sessions[who], (Commit if commit else Abort)(refs))
        if commit:
            self.evicted -= set(chunks)

    @rule(who=st.integers(0, 2), chunks=CHUNKS)
    def acquire(self, who, chunks):
        reply = self.service.handle(self.sessions[who], Acquire([1], hashes(chunks)))
        for ref, chunk in zip(reply.block_ids, chunks):
            assert (block_view(self.service, ref) == chunk % 251).all(), (chunk, hex(ref))
            if who == 2:
                assert tier_of(ref) == 0, "a host-only session got a device block"
        if reply.lease:
            self.leases.append((who, reply.lease))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        who, lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        self.service.handle(self.sessions[who], Release([lease]))

    @rule(chunk=st.integers(1, 12))
    def evict(self, chunk):
        self.service.handle(self.sessions[0], Evict(key=hashes([chunk]).hex()))
        self.evicted.add(chunk)

    @precondition(lambda self: self.service.tiers.pools[1].num_pinned_blocks)
    @rule(data=st.data())
    def evict_a_pinned_device_chunk(self, data):
        """The chunks being demoted are pinned device chunks: EVICT one mid-copy."""
        pool = self.service.tiers.pools[1]
        pinned = sorted(int.from_bytes(k[-16:], "little") for k, span in pool.cached.items()
                        if span[0].ref_cnt)
        if pinned:
            self.evict(data.draw(st.sampled_from(pinned)))

    @rule()
    def clear(self):
        self.service.handle(self.sessions[0], Clear())

    @rule(who=st.integers(0, 2))
    def crash(self, who):
        self.service.close_session(self.sessions[who])
        self.leases = [(w, lease) for w, lease in self.leases if w != who]
        self.pending = [p for p in self.pending if p[0] != who]
        self.sessions[who] = self._hello([DEVICE] if who < 2 else [])

    @rule()
    def copies_complete(self):
        self.device.gate.set()
        drain_demotions(self.service)
        self.device.gate.clear()

    @invariant()
    def tiers_are_consistent_and_every_indexed_chunk_holds_its_bytes(self):
        service = self.service
        service.tiers.check_invariants()
        demoting = service.demoter.demoting_blocks
        for pool in service.tiers.pools:
            assert demoting[pool.tier_id] <= pool.num_pinned_blocks, "demoting block unpinned"
            for key, span in pool.cached.items():
                chunk = int.from_bytes(key[-16:], "little")
                assert chunk not in self.evicted, f"EVICTed chunk {chunk} is back in tier " \
                    f"{pool.tier_id}"
                assert span[0].ref >> 32 == pool.tier_id
                view = block_view(service, span[0].ref)
                assert (view == chunk % 251).all(), (chunk, pool.tier_id)
        for who, session in enumerate(self.sessions):
            for blocks in session.leases.values():
                assert all(b.ref_cnt > 0 for b in blocks)


TieredCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30,
                                                deadline=None)
test_tiered_cache_model = TieredCacheMachine.TestCase
