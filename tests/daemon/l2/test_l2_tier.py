"""The L2 tier's logic in one process: a real arena and block pool, an in-memory store.

What Redis does is tested in test_l2_redis_store.py and end to end in test_l2_daemon.py;
here the store is a dict whose answers the test controls (held back, down, tampered), so
that pins, queue bounds, installs and counters are checked exactly after each step, with
the block pool's invariants.
"""

import os
import threading

import numpy as np
import pytest

from lmcached.daemon import keys
from lmcached.daemon.server_config import ServerConfig
from lmcached.daemon.l2.redis_store import L2Unavailable
from lmcached.daemon.l2.tier import DOWN_HOLD_S, L2Tier
from lmcached.daemon.l2.values import GENERATION_KEY, l2_key
from lmcached.daemon.spill.tier import FetchRequest
from lmcached.daemon.spill.envelope import (
    VERIFY_REASONS,
    namespace_fingerprint,
    verify_value,
)
from lmcached.wire.protocol import (
    local_block,
    tier_of,
    ALLOCATED,
    PROTOCOL_VERSION,
    Acquire,
    Alloc,
    AllocReply,
    BlocksReply,
    Clear,
    Commit,
    Error,
    Hello,
    Layout,
    Lookup,
    LookupReply,
    Release,
)
from lmcached.wire.record_format import RECORD_HEADER, RECORD_HEADER_BYTES, RECORD_MAGIC, ROOT_HASH, hash_block_tokens
from lmcached.daemon.replies import Deferred
from lmcached.daemon.jobs import JobRunner
from lmcached.daemon.service import CacheService
from lmcached.shm.arena import HEADER_BYTES, Arena

CHUNK = 16
RECORD_BYTES = RECORD_HEADER_BYTES + 8 * CHUNK + 3000  # header, token ids, "KV"
LAYOUT = Layout("tier-test", 1, 0, "vllm", "bfloat16", 2, 2, 4, CHUNK, RECORD_BYTES)
BLOCK_BYTES = 4096


class FakeStore:
    """An L2 store in memory: `gate` holds writes back, `down` makes every call fail."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.down = False
        self.mode, self.state, self.errors, self.num_reconnects = "standalone", "up", {}, 0
        self.lock = threading.Lock()
        self.num_length_calls = 0

    def _check(self) -> None:
        if self.down:
            self.state = "down"
            raise L2Unavailable("fake outage")

    def set_many(self, items) -> int:
        self.gate.wait(10)
        self._check()
        with self.lock:
            for key, value in items:
                self.data[key] = bytes(value)
        return len(items)

    def set_many_reading_generation(self, items) -> tuple[int, int]:
        return self.set_many(items), self.generation()

    def generation(self) -> int:
        self._check()
        return int(self.data.get(GENERATION_KEY, b"0"))

    def bump_generation(self) -> int:
        self._check()
        with self.lock:
            self.data[GENERATION_KEY] = b"%d" % (int(self.data.get(GENERATION_KEY, b"0")) + 1)
            return int(self.data[GENERATION_KEY])

    def exists_prefix(self, keys) -> int:
        self._check()
        n = 0
        while n < len(keys) and keys[n] in self.data:
            n += 1
        return n

    def value_lengths(self, keys):
        self._check()
        self.num_length_calls += 1
        return [len(self.data.get(k, b"")) for k in keys]

    def get_many(self, keys):
        self._check()
        return [self.data.get(k) for k in keys]

    def close(self) -> None:
        pass


class Node:
    """A CacheService with an L2 tier on its own arena, as the daemon wires them."""

    def __init__(self, name: str, store: FakeStore, num_blocks: int = 32,
                 device_memories=(), devices=(), **tier_args) -> None:
        self.arena = Arena.create(name, HEADER_BYTES + num_blocks * BLOCK_BYTES, BLOCK_BYTES,
                                  prefault=False)
        # One session stands for every client of the node: it may hold the whole arena.
        self.woken = threading.Semaphore(0)
        self.service = CacheService(ServerConfig(name=name, socket="/nonexistent",
                                                 max_session_share=100.0),
                                    self.arena, device_memories, JobRunner(self.woken.release))
        args = dict(url="fake://", policy="write-through", ttl_s=0.0, queue_bytes=1 << 20,
                    fetch_wait_s=5.0, num_threads=2)
        args.update(tier_args)
        self.tier = L2Tier(store, self.arena, jobs=self.service.jobs, **args)
        self.service.attach_tier(self.tier)
        self.session = self.service.open_session(os.getpid(), os.geteuid(), 0)
        reply = self.service.handle(self.session, Hello(PROTOCOL_VERSION, os.getpid(), "t",
                                                        [LAYOUT], list(devices)))
        self.ns = reply.namespaces[0]

    def settle(self, until) -> None:
        """Apply completions until `until()` holds (as the loop does when woken)."""
        for _ in range(200):
            self.service.jobs.process_completions()
            if until():
                return
            self.woken.acquire(timeout=0.05)
        raise AssertionError(f"the tier did not settle: {self.tier.info()}")

    def store(self, records: list[tuple[bytes, bytes]]) -> None:
        hashes = b"".join(h for h, _ in records)
        reply = self.service.handle(self.session, Alloc(self.ns, hashes,
                                                        [len(r) for _, r in records]))
        assert isinstance(reply, AllocReply) and set(reply.status) == {ALLOCATED}
        for (_, record), span in zip(records, reply.spans()):
            self.write(span, record)
        self.service.handle(self.session, Commit(reply.block_ids))

    def write(self, block_ids: list[int], record: bytes) -> None:
        for i, block_id in enumerate(block_ids):
            piece = record[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]
            self.arena.numpy_view(self.arena.block_offset(block_id), len(piece))[:] = \
                np.frombuffer(piece, np.uint8)

    def read(self, block_ids: list[int], num_bytes: int) -> bytes:
        return b"".join(bytes(self.arena.numpy_view(self.arena.block_offset(b), BLOCK_BYTES))
                        for b in block_ids)[:num_bytes]

    def close(self) -> None:
        self.tier.close()
        self.service.close()
        self.service.pool.check_invariants()
        self.arena.close()


def make_prompt(first_token: int, num_chunks: int, kv_bytes: int = 3000):
    """(chunk hash, record) per chunk of a prompt, records as clients write them."""
    rng = np.random.default_rng(first_token)
    parent, out = ROOT_HASH, []
    for i in range(num_chunks):
        tokens = np.arange(first_token + i * CHUNK, first_token + (i + 1) * CHUNK, dtype="<i8")
        chunk_hash = hash_block_tokens(parent, tokens)
        header = bytearray(RECORD_HEADER_BYTES)
        RECORD_HEADER.pack_into(header, 0, RECORD_MAGIC, CHUNK, 0, chunk_hash)
        out.append((chunk_hash, bytes(header) + tokens.tobytes() + rng.bytes(kv_bytes)))
        parent = chunk_hash
    return out


@pytest.fixture
def nodes(unique_name):
    made = []

    def make(store: FakeStore, **kwargs) -> Node:
        node = Node(f"{unique_name}-{len(made)}", store, **kwargs)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()


FP = namespace_fingerprint(LAYOUT)


def test_write_through_pins_until_written_and_writes_verifiable_values(nodes):
    store = FakeStore()
    node = nodes(store)
    prompt = make_prompt(0, 4)
    store.gate.clear()  # Redis is slow: nothing is written yet
    node.store(prompt)
    pool = node.service.pool
    assert pool.num_pinned_blocks == 4, "queued chunks stay pinned until written"
    info = node.tier.info()
    assert info["l2_queue_values"] == 4
    # Every verify reason is an INFO field from the start, 0 until a value fails it.
    assert {k: v for k, v in info.items() if k.startswith("l2_fetch_verify_")} == {
        f"l2_fetch_verify_{reason}": 0 for reason in VERIFY_REASONS}
    store.gate.set()
    node.settle(lambda: node.tier.info()["l2_writes"] == 4)
    assert pool.num_pinned_blocks == 0 and node.tier.queued_bytes == 0
    pool.check_invariants()
    parent = ROOT_HASH
    for chunk_hash, record in prompt:
        assert bytes(verify_value(store.data[l2_key(FP, chunk_hash)], FP, chunk_hash,
                                  parent)) == record
        parent = chunk_hash


def test_a_full_queue_drops_and_pins_nothing_it_dropped(nodes):
    store = FakeStore()
    store.gate.clear()
    node = nodes(store, queue_bytes=2 * RECORD_BYTES + 100)
    node.store(make_prompt(0, 5))
    info = node.tier.info()
    assert info["l2_queue_values"] == 2 and info["l2_write_drops_queue_full"] == 3
    assert node.service.pool.num_pinned_blocks == 2
    store.gate.set()
    node.settle(lambda: node.tier.info()["l2_queue_values"] == 0)
    assert node.service.pool.num_pinned_blocks == 0 and len(store.data) == 2


def _answer(node: Node, request):
    """Handle a LOOKUP / ACQUIRE as the server does: park it until its fetch ends."""
    reply = node.service.handle(node.session, request)
    if isinstance(reply, Deferred):
        node.settle(lambda: reply.job.done)
        reply = node.service.resume(node.session, reply)
    return reply


def test_a_miss_is_fetched_verified_installed_and_served_bit_exact(nodes):
    store = FakeStore()
    writer, reader = nodes(store), nodes(store)
    prompt = make_prompt(0, 6)
    writer.store(prompt)
    writer.settle(lambda: writer.tier.info()["l2_writes"] == 6)
    hashes = b"".join(h for h, _ in prompt)
    reply = reader.service.handle(reader.session, Lookup([reader.ns], hashes))
    assert isinstance(reply, Deferred), "a miss waits for the fetch"
    reader.settle(lambda: reply.job.done)
    assert reader.service.resume(reader.session, reply) == LookupReply(6)
    blocks = _answer(reader, Acquire([reader.ns], hashes))
    assert isinstance(blocks, BlocksReply) and len(blocks.span_lengths) == 6
    for (_, record), span in zip(prompt, blocks.spans()):
        assert reader.read(span, len(record)) == record
    reader.service.handle(reader.session, Release([blocks.lease]))
    info = reader.tier.info()
    assert info["l2_fetch_hit_chunks"] == 6 and info["l2_fetches"] == 1
    pool = reader.service.pool
    assert pool.num_pinned_blocks == 0 and len(pool.cached) == 6
    pool.check_invariants()


def test_a_partial_arena_hit_fetches_only_the_rest_of_the_chain(nodes):
    store = FakeStore()
    writer, reader = nodes(store), nodes(store)
    prompt = make_prompt(0, 5)
    writer.store(prompt)
    writer.settle(lambda: writer.tier.info()["l2_writes"] == 5)
    reader.store(prompt[:2])  # the first two chunks are in the reader's arena already
    reader.settle(lambda: reader.tier.info()["l2_queue_values"] == 0)
    hashes = b"".join(h for h, _ in prompt) + make_prompt(99, 1)[0][0]  # + a chunk nobody has
    assert _answer(reader, Lookup([reader.ns], hashes)) == LookupReply(5)
    info = reader.tier.info()
    assert info["l2_fetch_hit_chunks"] == 3 and info["l2_fetch_miss_chunks"] == 1


def test_a_fetch_for_a_namespace_freed_meanwhile_installs_nothing_under_its_reused_id(nodes):
    """The reader's session ends while its fetch runs: its namespace is freed (nothing
    of it is cached) and its id given to another model's layout, which must never find
    the fetched chunks of the first under that id."""
    store = FakeStore()
    writer, reader = nodes(store), nodes(store)
    prompt = make_prompt(0, 6)
    writer.store(prompt)
    writer.settle(lambda: writer.tier.info()["l2_writes"] == 6)
    hashes = b"".join(h for h, _ in prompt)
    parked = reader.service.handle(reader.session, Lookup([reader.ns], hashes))
    assert isinstance(parked, Deferred)
    reader.service.close_session(reader.session)  # before any batch is installed
    assert LAYOUT not in reader.service.namespaces
    other = reader.service.open_session(os.getpid(), os.geteuid(), 0)
    other_layout = Layout("another-model", 1, 0, "vllm", "bfloat16", 2, 2, 4, CHUNK,
                          RECORD_BYTES)
    reply = reader.service.handle(other, Hello(PROTOCOL_VERSION, os.getpid(), "t",
                                               [other_layout]))
    assert reply.namespaces == [reader.ns]  # the freed id, given again
    reader.settle(lambda: parked.job.done)
    pool = reader.service.pool
    assert len(pool.cached) == 0 and reader.tier.info()["l2_fetch_hit_chunks"] == 0
    assert pool.acquire_prefix([keys.chunk_prefix(reader.ns) + h for h, _ in prompt]) == []
    reader.service.close_session(other)


@pytest.mark.parametrize("tamper", ["kv", "other_chunk", "foreign"])
def test_a_bad_value_ends_the_chain_and_is_never_installed(nodes, tamper):
    store = FakeStore()
    writer, reader = nodes(store), nodes(store)
    prompt = make_prompt(0, 5)
    writer.store(prompt)
    writer.settle(lambda: writer.tier.info()["l2_writes"] == 5)
    key = l2_key(FP, prompt[2][0])
    value = bytearray(store.data[key])
    if tamper == "kv":
        value[-1] ^= 1
    elif tamper == "foreign":
        other = namespace_fingerprint(Layout("other", 1, 0, "vllm", "bfloat16", 2, 2, 4, CHUNK,
                                             RECORD_BYTES))
        value = bytearray(store.data[key].replace(FP, other, 1))
    else:
        store.data[key] = store.data[l2_key(FP, prompt[3][0])]  # another chunk's value
    if tamper != "other_chunk":
        store.data[key] = bytes(value)
    hashes = b"".join(h for h, _ in prompt)
    assert _answer(reader, Lookup([reader.ns], hashes)) == LookupReply(2)
    info = reader.tier.info()
    reason = {"kv": "checksum", "other_chunk": "foreign", "foreign": "foreign"}[tamper]
    assert sum(v for k, v in info.items() if k.startswith("l2_fetch_verify_")) == 1
    assert info[f"l2_fetch_verify_{reason}"] == 1
    assert len(reader.service.pool.cached) == 2


def test_on_evict_spills_the_evicted_bytes_before_the_block_is_reused(nodes):
    store = FakeStore()
    node = nodes(store, num_blocks=4, policy="on-evict")
    first, second = make_prompt(0, 4), make_prompt(1000, 2)
    node.store(first)
    node.settle(lambda: True)
    assert not store.data, "on-evict writes nothing before pressure"
    node.store(second)  # evicts first[3] and first[2] (the tail of the chain first)
    node.settle(lambda: node.tier.info()["l2_writes"] == 2 and not node.tier.num_writes_in_flight)
    assert set(store.data) == {l2_key(FP, first[3][0]), l2_key(FP, first[2][0])}
    for chunk_hash, record in first[2:]:
        value = store.data[l2_key(FP, chunk_hash)]
        assert value[64:] == record, "the spilled bytes are the evicted record's"
    # Fetched back: the arena makes room by evicting (and spilling) `second`.
    hashes = b"".join(h for h, _ in first)
    assert _answer(node, Lookup([node.ns], hashes)) == LookupReply(4)
    node.settle(lambda: node.tier.info()["l2_writes"] == 4 and not node.tier.num_writes_in_flight)
    assert l2_key(FP, second[1][0]) in store.data
    node.service.pool.check_invariants()


def test_no_room_in_the_arena_stops_the_install(nodes):
    store = FakeStore()
    writer, reader = nodes(store), nodes(store, num_blocks=3)
    prompt = make_prompt(0, 4)
    writer.store(prompt)
    writer.settle(lambda: writer.tier.info()["l2_writes"] == 4)
    assert _answer(reader, Lookup([reader.ns], b"".join(h for h, _ in prompt[:1]))) == \
        LookupReply(1)
    pinned = _answer(reader, Acquire([reader.ns], prompt[0][0]))
    reader.store(make_prompt(500, 2))  # every block is pinned or written-through-pinned
    reader.settle(lambda: reader.tier.info()["l2_queue_values"] == 0)
    hold = _answer(reader, Acquire([reader.ns], b"".join(h for h, _ in make_prompt(500, 2))))
    assert _answer(reader, Lookup([reader.ns], b"".join(h for h, _ in prompt))) == LookupReply(1)
    assert reader.tier.info()["l2_fetch_nospace"] == 1
    reader.service.handle(reader.session, Release([pinned.lease, hold.lease]))
    reader.service.pool.check_invariants()


def test_down_drops_writes_and_answers_misses_at_once(nodes):
    store = FakeStore()
    node = nodes(store)
    store.down = True
    node.store(make_prompt(0, 3))
    node.settle(lambda: node.tier.info()["l2_queue_values"] == 0)
    info = node.tier.info()
    assert info["l2_write_drops_down"] == 3 and info["l2_writes"] == 0
    assert node.service.pool.num_pinned_blocks == 0
    hashes = b"".join(h for h, _ in make_prompt(700, 2))
    # Within the hold after an outage, a miss does not even start a fetch: answered at once.
    for _ in range(2):
        assert node.service.handle(node.session, Lookup([node.ns], hashes)) == LookupReply(0)
    assert node.tier.info()["l2_fetches_skipped"] == 2 and node.tier.info()["l2_fetches"] == 0


def test_a_fetch_that_fails_on_an_outage_answers_at_once(nodes):
    store = FakeStore()
    node = nodes(store)
    store.down = True
    hashes = b"".join(h for h, _ in make_prompt(700, 2))
    reply = node.service.handle(node.session, Lookup([node.ns], hashes))
    assert isinstance(reply, Deferred)
    node.settle(lambda: reply.job.done)  # ends on the outage, long before its 5 s wait
    assert node.service.resume(node.session, reply) == LookupReply(0)
    info = node.tier.info()
    assert info["l2_fetch_down"] == 1 and info["l2_fetch_waits_timed_out"] == 0


def test_a_namespace_whose_values_redis_cannot_hold_stays_out_of_l2(nodes):
    store = FakeStore()
    node = nodes(store)
    huge = Layout("huge", 1, 0, "vllm", "bfloat16", 2, 2, 4, CHUNK, 600 << 20)
    node.tier.register_namespace(99, huge)
    assert node.tier.start_fetch(FetchRequest(
        node.service.pool, [99], [b"c" + (99).to_bytes(4, "little")], b"\1" * 16, 0,
        b"\0" * 16, list)) is None
    assert node.tier.info()["l2_fetches"] == 0


def test_a_fetch_larger_than_the_arena_keeps_its_head_and_stops(nodes):
    store = FakeStore()
    writer, reader = nodes(store), nodes(store, num_blocks=4)
    prompt = make_prompt(0, 10)
    writer.store(prompt)
    writer.settle(lambda: writer.tier.info()["l2_writes"] == 10)
    hashes = b"".join(h for h, _ in prompt)
    # The first 4 chunks fill the arena and stay: installing more would evict the head.
    assert _answer(reader, Lookup([reader.ns], hashes)) == LookupReply(4)
    info = reader.tier.info()
    assert info["l2_fetch_nospace"] == 1 and info["l2_fetch_hit_chunks"] == 4
    pool = reader.service.pool
    assert set(pool.cached) == {reader.service.ns_registry.prefixes[reader.ns] + h for h, _ in prompt[:4]}
    assert pool.num_pinned_blocks == 0
    pool.check_invariants()


def test_values_longer_than_the_record_are_neither_written_nor_fetched(nodes):
    store = FakeStore()
    writer, reader = nodes(store), nodes(store)
    prompt = make_prompt(0, 3)
    # A hostile client's 3x value: ALLOC refuses a chunk larger than its layout's record,
    # so nothing of it is written, to the arena or to L2.
    huge = writer.service.handle(writer.session, Alloc(writer.ns, prompt[0][0],
                                                       [3 * len(prompt[0][1])]))
    assert isinstance(huge, Error) and huge.code == "bad_request"
    assert writer.tier.info()["l2_write_drops_oversize"] == 0
    assert l2_key(FP, prompt[0][0]) not in store.data
    # Planted straight into Redis: STRLEN sees it, no GET ever reads it.
    store.data[l2_key(FP, prompt[0][0])] = b"\0" * (RECORD_BYTES + 65)
    gets = []
    store.get_many = lambda keys, get=store.get_many: gets.append(keys) or get(keys)
    assert _answer(reader, Lookup([reader.ns], b"".join(h for h, _ in prompt))) == LookupReply(0)
    assert reader.tier.info()["l2_fetch_oversize"] == 1 and gets == []


def test_lengths_are_asked_in_windows_up_to_the_first_gap(nodes):
    store = FakeStore()
    node = nodes(store)
    hashes = b"".join(h for h, _ in make_prompt(0, 600))  # nothing of it in L2
    assert _answer(node, Lookup([node.ns], hashes)) == LookupReply(0)
    assert store.num_length_calls == 1, "a gap at the first window ends the search"
    assert node.tier.info()["l2_fetch_miss_chunks"] == 600


def test_a_prefix_on_a_device_tier_is_served_and_only_the_rest_is_fetched(nodes, unique_name):
    from test_tiers import DEVICE, GatedDeviceMemory

    store = FakeStore()
    writer = nodes(store)
    prompt = make_prompt(0, 5)
    writer.store(prompt)
    writer.settle(lambda: writer.tier.info()["l2_writes"] == 5)
    device = GatedDeviceMemory(unique_name + "-dev", 8)
    device.gate.clear()  # no demotion: the prefix stays on the device
    try:
        reader = nodes(store, device_memories=[device], devices=[DEVICE])
        hashes = b"".join(h for h, _ in prompt)
        alloc = reader.service.handle(reader.session, Alloc(reader.ns, hashes[:32],
                                                            [RECORD_BYTES] * 2, 1))
        assert [tier_of(ref) for ref in alloc.block_ids] == [1, 1]
        for (_, record), ref in zip(prompt, alloc.block_ids):
            device.arena.numpy_view(device.arena.block_offset(local_block(ref)),
                                    len(record))[:] = np.frombuffer(record, np.uint8)
        reader.service.handle(reader.session, Commit(alloc.block_ids))
        assert _answer(reader, Lookup([reader.ns], hashes)) == LookupReply(5)
        assert reader.tier.info()["l2_fetch_hit_chunks"] == 3
        blocks = _answer(reader, Acquire([reader.ns], hashes))
        assert [tier_of(ref) for ref in blocks.block_ids] == [1, 1, 0, 0, 0]
        for (_, record), ref in zip(prompt[2:], blocks.block_ids[2:]):
            assert reader.read([ref], len(record)) == record
        reader.service.handle(reader.session, Release([blocks.lease]))
        reader.service.tiers.check_invariants()
    finally:
        device.gate.set()
        reader.service.close()  # its demotion thread reads the device tier
        device.close()


def test_a_fetch_held_before_its_install_installs_nothing_after_a_clear(nodes):
    store = FakeStore()
    writer, reader, other = nodes(store), nodes(store), nodes(store)
    prompt = make_prompt(0, 6)
    writer.store(prompt)
    writer.settle(lambda: writer.tier.info()["l2_writes"] == 6)
    reader.store(prompt[:1])  # the chain's arena part, pinned by the fetch
    reader.settle(lambda: reader.tier.info()["l2_queue_values"] == 0)
    hashes = b"".join(h for h, _ in prompt)
    reply = reader.service.handle(reader.session, Lookup([reader.ns], hashes))
    assert isinstance(reply, Deferred)
    fetches = reader.tier._fetches
    for _ in range(200):  # the fetch thread read and verified a batch; the loop holds it
        if any(m[0] == "batch" for m in list(fetches.done)):
            break
        threading.Event().wait(0.01)
    else:
        raise AssertionError("the fetch thread posted no batch")
    pool = reader.service.pool
    assert pool.num_pinned_blocks == 1
    assert reader.service.handle(reader.session, Clear()).count == 1
    assert not pool.cached and pool.num_pinned_blocks == 0
    assert reader.tier.info()["l2_clear_pending"] == 1
    reader.settle(lambda: reply.job.done and not reader.tier.info()["l2_clear_pending"])
    assert reader.service.resume(reader.session, reply) == LookupReply(0)
    assert not pool.cached, "a fetch started before CLEAR installed a chunk after it"
    info = reader.tier.info()
    assert info["l2_fetch_hit_chunks"] == 0 and info["l2_generation"] == 1
    assert info["l2_clears"] == 1 and info["l2_clear_failures"] == 0
    # The L2 keeps the old keys (their TTL removes them) but no daemon reads them again.
    assert l2_key(FP, prompt[0][0]) in store.data
    for node in (reader, other):
        assert _answer(node, Lookup([node.ns], hashes)) == LookupReply(0)
        assert node.tier.info()["l2_fetch_hit_chunks"] == 0
    assert other.tier.info()["l2_generation"] == 1, "another daemon learned the generation"
    assert pool.num_pinned_blocks == 0 and pool.num_writing_blocks == 0
    pool.check_invariants()


def test_a_clear_while_l2_is_down_fetches_nothing_until_its_generation_advanced(nodes):
    store = FakeStore()
    writer, reader = nodes(store), nodes(store)
    prompt = make_prompt(0, 3)
    writer.store(prompt)
    writer.settle(lambda: writer.tier.info()["l2_writes"] == 3)
    hashes = b"".join(h for h, _ in prompt)
    store.down = True
    reader.service.handle(reader.session, Clear())
    reader.settle(lambda: reader.tier.info()["l2_clear_failures"] == 1)
    store.down, store.state = False, "up"
    threading.Event().wait(DOWN_HOLD_S)  # after an outage the tier waits this long
    assert _answer(reader, Lookup([reader.ns], hashes)) == LookupReply(0)  # retried, not read
    reader.settle(lambda: not reader.tier.info()["l2_clear_pending"])
    assert reader.tier.info()["l2_generation"] == 1
    assert _answer(reader, Lookup([reader.ns], hashes)) == LookupReply(0)
    writer.store(make_prompt(1000, 2))  # the writer learns the generation from its writes
    writer.settle(lambda: writer.tier.info()["l2_generation"] == 1)
    fresh = make_prompt(2000, 2)
    writer.store(fresh)
    writer.settle(lambda: writer.tier.info()["l2_queue_values"] == 0)
    fresh_hashes = b"".join(h for h, _ in fresh)
    assert _answer(reader, Lookup([reader.ns], fresh_hashes)) == LookupReply(2)
