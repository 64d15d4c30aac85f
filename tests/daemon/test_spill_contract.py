"""The contract every spill tier keeps (lmcached/daemon/spill/tier.py, `SpillTier`), run
against the disk tier, L2 (on an in-memory store) and a test-only tier kept in a dict
(tests/daemon/spill/dict_tier.py), each attached to a CacheService through the spill tier
list (`CacheService.attach_tier`) and driven by requests as the loop would.

The dict tier is written in its own folder and attached here by one line: that it passes
these tests is what "a new tier is one folder and one line in the list" means.
"""

import ast
import dataclasses
import os
import time

import pytest

from spill.dict_tier import DictTier
from test_disk_tier import HASHES_A, LAYOUT, NUM_BLOCKS, PROMPT_A, PROMPT_B, store_chunk
from test_l2_tier import FakeStore
from test_service import BLOCK_BYTES, greeted
from lmcached.daemon.disk.directory import DirectoryLock, prepare_disk_directory
from lmcached.daemon.disk.tier import DiskTier
from lmcached.daemon.info import info_sections
from lmcached.daemon.l2.tier import L2Tier
from lmcached.daemon.replies import Deferred
from lmcached.daemon.server_config import ServerConfig
from lmcached.daemon.service import CacheService
from lmcached.daemon.spill.envelope import namespace_fingerprint
from lmcached.shm.arena import HEADER_BYTES, Arena
from lmcached.wire.protocol import (Acquire, BlocksReply, Clear, Events, Lookup, LookupReply,
                                    Release, Subscribe)
from lmcached.wire.record_format import RECORD_HEADER_BYTES, read_header


def disk_tier(service: CacheService, tmp_path) -> DiskTier:
    directory = prepare_disk_directory(str(tmp_path / "disk"))
    return DiskTier(directory, DirectoryLock(directory), capacity_bytes=16 << 20,
                    policy="on-evict", fetch_wait_s=5.0, arena=service.arena,
                    jobs=service.jobs)


def l2_tier(service: CacheService, tmp_path) -> L2Tier:
    return L2Tier(FakeStore(), service.arena, url="fake://", policy="write-through", ttl_s=0.0,
                  queue_bytes=1 << 20, fetch_wait_s=5.0, num_threads=2, jobs=service.jobs)


def dict_tier(service: CacheService, tmp_path) -> DictTier:
    return DictTier(service.arena)


# How each tier shows that its writes ended (the contract does not say; the test waits).
IDLE = {
    "disk": lambda tier: not tier._writing,
    "l2": lambda tier: tier.num_writes_in_flight == 0,
    "dict": lambda tier: True,
}


@pytest.fixture(params=[disk_tier, l2_tier, dict_tier], ids=["disk", "l2", "dict"])
def tiered(request, unique_name, tmp_path):
    """(service, tier): a 6-block arena and one spill tier attached through the list."""
    arena = Arena.create(unique_name, HEADER_BYTES + NUM_BLOCKS * BLOCK_BYTES, BLOCK_BYTES,
                         prefault=False)
    service = CacheService(ServerConfig(name=arena.name, socket="/nonexistent",
                                        max_session_share=100.0), arena)
    tier = request.param(service, tmp_path)
    service.attach_tier(tier)
    assert service.spill_tiers == [tier]
    yield service, tier
    for attached in service.spill_tiers:
        attached.close()
    arena.close()


def pump(service: CacheService, done, timeout_s: float = 20.0) -> None:
    """Run the loop's completions and housekeeping until `done()`."""
    deadline = time.monotonic() + timeout_s
    while True:
        service.jobs.process_completions()
        service.housekeeping()
        if done():
            return
        assert time.monotonic() < deadline, "the spill tier's work did not end"
        time.sleep(0.005)


def store_a_then_b(service: CacheService, tier):
    """A session that stored prompt A then B into the 6-block arena, each chunk's writes
    ended before the next: A's first chunks are evicted into the tier."""
    session = greeted(service, LAYOUT)
    for _, chunk_hash, record in PROMPT_A + PROMPT_B:
        store_chunk(service, session, chunk_hash, record)
        pump(service, lambda: IDLE[tier.name](tier))
    return session


def lookup_a(service: CacheService, session) -> int:
    """LOOKUP of prompt A, waiting for the tier's fetch as the server would."""
    reply = service.handle(session, Lookup([1], HASHES_A))
    if isinstance(reply, Deferred):
        pump(service, lambda: reply.job.done)
        reply = service.resume(session, reply)
    assert isinstance(reply, LookupReply), reply
    return reply.num_chunks


def assert_nothing_pinned(service: CacheService) -> None:
    pool = service.pool
    assert pool.num_pinned_blocks == 0 and pool.num_writing_blocks == 0
    service.tiers.check_invariants()


def test_a_chunk_spilled_is_fetched_back_bit_exact(tiered):
    service, tier = tiered
    session = store_a_then_b(service, tier)
    assert service.pool.cached.get(b"c" + (1).to_bytes(4, "little") + PROMPT_A[0][1]) is None
    assert lookup_a(service, session) == len(PROMPT_A)
    reply = service.handle(session, Acquire([1], HASHES_A))
    assert isinstance(reply, BlocksReply) and len(reply.block_ids) == len(PROMPT_A)
    arena = service.arena
    for block_id, n, (_, _, record) in zip(reply.block_ids, reply.num_bytes, PROMPT_A):
        assert bytes(arena.numpy_view(arena.block_offset(block_id), n)) == record
    service.handle(session, Release([reply.lease]))
    assert_nothing_pinned(service)


def test_clear_makes_a_spilled_chunk_a_miss(tiered):
    service, tier = tiered
    session = store_a_then_b(service, tier)
    service.handle(session, Clear())
    pump(service, lambda: IDLE[tier.name](tier))
    assert lookup_a(service, session) == 0
    assert lookup_a(service, session) == 0  # nothing came back from the tier later either
    assert_nothing_pinned(service)


def test_a_second_lookup_of_a_chain_joins_the_fetch_in_flight(tiered):
    service, tier = tiered
    session = store_a_then_b(service, tier)
    fetches = tier.stats().fetches
    first = service.handle(session, Lookup([1], HASHES_A))
    second = service.handle(session, Lookup([1], HASHES_A))
    assert isinstance(first, Deferred) and isinstance(second, Deferred)
    assert second.job is first.job
    assert tier.stats().fetches == fetches + 1 and tier.stats().fetches_joined == 1
    pump(service, lambda: first.job.done)
    for deferred in (first, second):
        assert service.resume(session, deferred) == LookupReply(len(PROMPT_A))
    assert_nothing_pinned(service)


def test_info_shows_each_spill_section_and_no_section_for_a_tier_it_does_not_name(tiered):
    service, tier = tiered
    greeted(service, LAYOUT)
    sections = info_sections(service)
    assert [name for name in sections if name in ("l2", "disk", "dict")] == ["l2", "disk"]
    for name in ("l2", "disk"):
        assert sections[name][f"{name}_enabled"] == int(name == tier.name)


def test_stats_are_typed_and_every_counter_is_an_info_field(tiered):
    service, tier = tiered
    session = store_a_then_b(service, tier)
    lookup_a(service, session)
    stats = tier.stats()
    assert dataclasses.is_dataclass(stats) and stats.fetches >= 1
    fields = dataclasses.fields(stats)
    assert all(type(getattr(stats, f.name)) is int for f in fields)
    info = tier.info()
    assert {f"{tier.name}_{f.name}": getattr(stats, f.name) for f in fields}.items() \
        <= info.items()


# Which tiers list the keys they hold for the event feed's snapshot (L2 cannot).
LISTS_KEYS = {"disk": True, "l2": False, "dict": True}


def test_a_tier_lists_what_it_holds_for_the_event_snapshot(tiered):
    """`snapshot_keys`, `chunk_parent` and `token_ids` (what lmcached/daemon/events.py
    knows of a tier): a tier that lists its keys lists those it holds, once each, each
    with a parent and its record's token ids; a key it does not hold has
    neither; L2 lists nothing and answers None."""
    service, tier = tiered
    store_a_then_b(service, tier)
    fp = namespace_fingerprint(LAYOUT)
    stored = [((fp, chunk_hash), record) for _, chunk_hash, record in PROMPT_A + PROMPT_B]
    keys = list(tier.snapshot_keys())
    if not LISTS_KEYS[tier.name]:
        assert keys == []
        assert all(tier.chunk_parent(key) is None and tier.token_ids(key) is None
                   for key, _ in stored)
        return
    held = set(keys)
    assert held and len(held) == len(keys)
    assert held <= {key for key, _ in stored}
    for key, record in stored:
        if key in held:
            assert isinstance(tier.chunk_parent(key), bytes)
            assert tier.token_ids(key) == \
                record[RECORD_HEADER_BYTES:read_header(record).tokens_end]
        else:
            assert tier.chunk_parent(key) is None and tier.token_ids(key) is None
    unknown = (fp, PROMPT_A[0][1][::-1])
    assert tier.chunk_parent(unknown) is None and tier.token_ids(unknown) is None
    assert tier.chunk_parent((b"\0" * 16, keys[0][1])) is None  # another namespace's
    service.handle(greeted(service, LAYOUT), Clear())
    pump(service, lambda: IDLE[tier.name](tier))
    assert list(tier.snapshot_keys()) == []
    assert tier.chunk_parent(keys[0]) is None and tier.token_ids(keys[0]) is None


DAEMON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "lmcached", "daemon")
FEED_MODULES = ("events.py", "event_handlers.py")  # the feed and its requests


def tier_internals_named(source: str) -> list[str]:
    """What Python `source` names of one tier's internals: calls of `spill_tier(...)`
    (a tier picked by name) and the attributes `index` / `entries` (the disk index)."""
    named = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("spill_tier", "index", "entries"):
            named.append(ast.unparse(node))
        elif isinstance(node, ast.Name) and node.id == "spill_tier":
            named.append(node.id)
    return named


@pytest.mark.parametrize("module", FEED_MODULES)
def test_the_event_feed_knows_the_tiers_through_their_interface_only(module):
    """lmcached/daemon/events.py and event_handlers.py iterate `spill_tiers` and ask
    `snapshot_keys`, `chunk_parent` and `token_ids`: they pick no tier by name and read
    no tier's index."""
    with open(os.path.join(DAEMON_DIR, module)) as f:
        source = f.read()
    assert tier_internals_named(source) == []
    assert "spill_tier(" not in source and ".index" not in source


def test_the_internals_check_finds_a_tier_picked_by_name():
    planted = ('disk = service.spill_tier("disk")\n'
               "entries = disk.index.entries if disk is not None else {}\n")
    assert tier_internals_named(planted) == [
        "service.spill_tier", "disk.index.entries", "disk.index"]


def test_every_chunk_a_fetch_installs_is_announced_once(tiered):
    """A fetch from any tier installs the chunks prompt A missed in the arena; each one
    is a stored "cpu" event, once, and nothing else is (`BlockPool.commit` announces
    whatever it indexes: no install path can forget to)."""
    service, tier = tiered
    session = store_a_then_b(service, tier)
    before = set(service.pool.cached)
    watcher = greeted(service, LAYOUT)
    cursor = service.handle(watcher, Subscribe([1])).cursor
    assert lookup_a(service, session) == len(PROMPT_A)
    installed = [key[5:] for key in service.pool.cached if key not in before]
    assert installed
    reply = service.handle(watcher, Events(cursor, 0, False))
    stored = [e.chunk_hash for e in reply.events if (e.kind, e.medium) == ("stored", "cpu")]
    removed = {e.chunk_hash for e in reply.events if (e.kind, e.medium) == ("removed", "cpu")}
    assert sorted(h for h in stored if h not in removed) == sorted(installed)
    assert len(stored) == len(set(stored)) and set(stored) <= {h for _, h, _ in PROMPT_A}
    assert_nothing_pinned(service)
