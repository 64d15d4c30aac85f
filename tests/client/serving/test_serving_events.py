"""`EventRelay` (client/serving/events.py) against a real daemon, without any engine: chunks
another client stores are announced as block events in the relay's block size and block
hash (a stand-in hasher here; vLLM's in tests/vllm_connector/test_vllm_kv_events.py), per
medium, removed on EVICT / CLEAR, and everything announced is removed when the daemon
restarts."""

import hashlib
import os
import time

import numpy as np
import torch

from conftest import start_daemon
from test_tiers import DEVICE, block_view, drain_demotions, hello, tiered  # noqa: F401
from lmcached.client import CacheEngine, KVLayout
from lmcached.client.serving.events import EventRelay
from lmcached.wire.connection import Connection
from lmcached.wire.protocol import Alloc, Clear, Commit, Events, Evict, Info, Ok, Subscribe
from lmcached.wire.record_format import ROOT_HASH, hash_block_tokens, write_header

CHUNK, BLOCK = 16, 4


def layout() -> KVLayout:
    return KVLayout("tiny-llama", num_layers=2, num_kv_heads=2, head_size=8,
                    dtype="bfloat16", chunk_size=CHUNK, fmt="vllm")


def block_hash(parent, token_ids, extra) -> bytes:
    """A stand-in engine hash: chained, over the tokens and extra keys."""
    return hashlib.sha256(repr((parent, list(token_ids), extra)).encode()).digest()


def own_hashes(tokens: list[int]) -> list[bytes]:
    out, parent = [], None
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = block_hash(parent, tokens[start:start + BLOCK], None)
        out.append(parent)
    return out


def store(socket: str, tokens: list[int]) -> None:
    engine = CacheEngine.connect(layout(), socket=socket, strict=True)
    try:
        kv = torch.zeros(layout().chunk_shape(len(tokens)), dtype=torch.bfloat16)
        engine.store(torch.tensor(tokens), kv)
    finally:
        engine.close()


def poll_until(relay: EventRelay, count: int, timeout_s: float = 10.0) -> list:
    events, deadline = [], time.monotonic() + timeout_s
    while len(events) < count:
        assert time.monotonic() < deadline, (events, relay.stats)
        events.extend(relay.poll())
        time.sleep(0.01)
    return events


def test_stored_chunks_become_block_events_in_the_relays_terms(daemon):
    relay = EventRelay(layout().to_wire(), BLOCK, block_hash, socket=daemon.socket)
    try:
        assert relay.poll() == []  # subscribes from now on
        tokens = list(range(100, 140))  # 2 full chunks and a partial one of 8 tokens
        store(daemon.socket, tokens)
        events = poll_until(relay, 3)
        assert [(e.kind, e.medium, len(e.block_hashes)) for e in events] == [
            ("stored", "cpu", 4), ("stored", "cpu", 4), ("stored", "cpu", 2)]
        assert [h for e in events for h in e.block_hashes] == own_hashes(tokens)
        assert [t for e in events for t in e.token_ids] == tokens
        assert events[1].parent_block_hash == events[0].block_hashes[-1]
        with Connection(daemon.socket) as admin:
            admin.request(Clear())
        removed = poll_until(relay, 3)
        assert {(e.kind, e.medium) for e in removed} == {("removed", "cpu")}
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(own_hashes(tokens))
        assert relay.num_announced_chunks == 0 and relay.stats["unresolved_parent"] == 0
    finally:
        relay.close()


def test_a_store_that_continues_a_chain_is_announced_chained(daemon):
    """CacheEngine.store of a chain's continuation (a mask that skips its first chunk,
    stored before): its ALLOC names the skipped chunk as the first new chunk's parent,
    so the relay hashes the new blocks from the earlier chunk's last block."""
    relay = EventRelay(layout().to_wire(), BLOCK, block_hash, socket=daemon.socket)
    engine = CacheEngine.connect(layout(), socket=daemon.socket, strict=True)
    try:
        assert relay.poll() == []
        tokens = list(range(200, 248))  # 3 full chunks
        kv = torch.zeros(layout().chunk_shape(len(tokens)), dtype=torch.bfloat16)
        assert engine.store(torch.tensor(tokens[:CHUNK]), kv[:, :, :CHUNK]) == 1
        first = poll_until(relay, 1)
        mask = torch.arange(len(tokens)) >= CHUNK
        assert engine.store(torch.tensor(tokens), kv, mask=mask) == 2
        rest = poll_until(relay, 2)
        assert [h for e in first + rest for h in e.block_hashes] == own_hashes(tokens)
        assert rest[0].parent_block_hash == first[0].block_hashes[-1]
        assert relay.stats["unresolved_parent"] == relay.stats["unresolved_salt"] == 0
    finally:
        engine.close()
        relay.close()


def test_a_chunk_whose_parent_was_never_seen_is_counted_not_guessed(daemon):
    store(daemon.socket, list(range(16)))  # before the relay subscribed, without a snapshot
    relay = EventRelay(layout().to_wire(), BLOCK, block_hash, socket=daemon.socket,
                       snapshot=False)
    try:
        relay.poll()
        store(daemon.socket, list(range(32)))  # chunk 0 exists: chunk 1 is new
        deadline = time.monotonic() + 10
        while relay.stats["unresolved_parent"] < 1:
            assert relay.poll() == [] and time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        relay.close()


def test_a_relay_attaching_to_a_full_daemon_announces_it_paced_and_complete(daemon_factory):
    """2,400 chunks stored before the relay attaches, one chain's first chunk cached again
    last (its children come before it in the snapshot): every chunk is announced exactly
    once, parents before children, at most `max_events` chunk events a poll, and chunks
    stored and removed while the snapshot pages are announced and removed in order."""
    daemon = daemon_factory("--capacity", "32MiB", "--block-size", "4KiB")
    prompts = [list(range(p * 100_000, p * 100_000 + 100 * CHUNK)) for p in range(24)]
    for tokens in prompts:
        store(daemon.socket, tokens)
    first = hash_block_tokens(ROOT_HASH, np.array(prompts[3][:CHUNK], dtype=np.int64))
    with Connection(daemon.socket) as admin:
        assert admin.request(Evict(key=first.hex())).count == 1
    store(daemon.socket, prompts[3][:CHUNK])
    relay = EventRelay(layout().to_wire(), BLOCK, block_hash, socket=daemon.socket,
                       max_events=100)
    late = list(range(7_000_000, 7_000_000 + 2 * CHUNK))
    try:
        events = relay.poll()  # subscribes, with a snapshot: its first page
        assert len(events) == 100 and relay.snapshot_left > 2000
        store(daemon.socket, late)  # during the snapshot: a live event after it
        with Connection(daemon.socket) as admin:  # a snapshot chunk leaves before its page
            gone = hash_block_tokens(hash_block_tokens(ROOT_HASH, np.array(
                prompts[23][:CHUNK], dtype=np.int64)), np.array(prompts[23][CHUNK:2 * CHUNK],
                                                                  dtype=np.int64))
            assert admin.request(Evict(key=gone.hex())).count == 1
        deadline = time.monotonic() + 60
        while relay.snapshot_left or not events or relay.stats["polls"] < 2:
            assert time.monotonic() < deadline, relay.stats
            before = relay.stats["chunk_events"]
            events.extend(relay.poll())
            assert relay.stats["chunk_events"] - before <= 100
        events.extend(poll_until(relay, 0))
        for _ in range(3):
            events.extend(relay.poll())
    finally:
        relay.close()
    stored = [e for e in events if e.kind == "stored"]
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == len(set(hashes))  # each block announced once
    seen = set()
    for e in stored:  # parents first
        assert e.parent_block_hash is None or e.parent_block_hash in seen, relay.stats
        seen.update(e.block_hashes)
    expected = set(own_hashes(late))
    for p, tokens in enumerate(prompts):  # the last prompt: chunk 0 only, its chunk 1 left
        expected.update(own_hashes(tokens)[:CHUNK // BLOCK] if p == 23 else own_hashes(tokens))
    assert seen == expected
    assert relay.stats["snapshot"] == 23 * 100 + 1
    assert relay.stats["unresolved_parent"] == 98  # past the missing chunk 1: unloadable
    assert relay.stats["lost"] == 0 and relay.num_announced_chunks == 23 * 100 + 1 + 2


def test_a_restarted_daemon_means_every_announced_block_is_removed(unique_name, short_tmp):
    """The daemon on the same socket restarts (a new arena generation): what the relay
    announced is gone, and removed; never a wholesale clear."""
    socket = os.path.join(short_tmp, "d.sock")
    args = ("--capacity", "64MiB", "--block-size", "1MiB")
    daemon = start_daemon(unique_name, socket, os.path.join(short_tmp, "1.log"), *args)
    relay = EventRelay(layout().to_wire(), BLOCK, block_hash, socket=socket)
    try:
        relay.poll()
        tokens = list(range(500, 532))
        store(socket, tokens)
        poll_until(relay, 2)
        daemon.stop()
        daemon = start_daemon(unique_name, socket, os.path.join(short_tmp, "2.log"), *args)
        events = poll_until(relay, 2, timeout_s=20)
        assert {(e.kind, e.medium) for e in events} == {("removed", "cpu")}
        assert sorted(h for e in events for h in e.block_hashes) == sorted(own_hashes(tokens))
        assert relay.stats["restarts"] == 1 and relay.num_announced_chunks == 0
    finally:
        relay.close()
        daemon.stop()


def test_a_relay_without_a_daemon_returns_nothing_and_retries_later(short_tmp):
    relay = EventRelay(layout().to_wire(), BLOCK, block_hash,
                       socket=os.path.join(short_tmp, "none.sock"))
    assert relay.poll() == [] and relay.stats["errors"] == 1
    assert relay.poll() == [] and relay.stats["errors"] == 1  # no retry within a second


def chained(events: list) -> list[tuple]:
    """(block hashes, parent block hash) of each stored event, the relay's own terms."""
    return [(tuple(e.block_hashes), e.parent_block_hash) for e in events if e.kind == "stored"]


def poll_while(relay: EventRelay, done, timeout_s: float = 20.0) -> list:
    events, deadline = [], time.monotonic() + timeout_s
    while not done(events):
        assert time.monotonic() < deadline, (chained(events), relay.stats)
        events.extend(relay.poll())
        time.sleep(0.01)
    return events


def test_after_a_restart_the_disk_and_the_prewarm_announce_every_chunk_chained(
        daemon_factory, short_tmp):
    """A 6-chunk prompt stored, the daemon stopped (its arena saved to disk) and started
    again on the same disk: a relay attaching to it announces every chunk on "disk"
    (the snapshot: token ids from the slots) and on "cpu" (the prewarm reads them back),
    each with the block hashes and the parent another relay announced before the
    restart: a router chains them as it chained the first announcement."""
    disk = os.path.join(short_tmp, "disk")
    os.mkdir(disk, 0o700)
    args = ("--capacity", "1MiB", "--block-size", "4KiB", "--disk-path", disk,
            "--disk-capacity", "4MiB")
    tokens = list(range(3000, 3000 + 6 * CHUNK))
    first = daemon_factory(*args)
    relay = EventRelay(layout().to_wire(), BLOCK, block_hash, socket=first.socket)
    try:
        relay.poll()
        store(first.socket, tokens)
        before = chained(poll_until(relay, 6))
    finally:
        relay.close()
    assert [h for hashes, _ in before for h in hashes] == own_hashes(tokens)
    assert first.stop() == 0
    second = daemon_factory(*args)
    relay = EventRelay(layout().to_wire(), BLOCK, block_hash, socket=second.socket)
    try:
        events = poll_while(relay, lambda got: len(chained(got)) >= 12)
        events.extend(relay.poll())
    finally:
        relay.close()
    for medium in ("disk", "cpu"):  # the prewarm reads a chain back tail first
        assert sorted(chained(e for e in events if e.medium == medium)) == sorted(before), \
            medium
    assert relay.stats["snapshot"] >= 6
    assert not any(relay.stats[k] for k in ("unresolved_parent", "unresolved_tokens",
                                            "unresolved_salt", "lost")), relay.stats


def test_chunks_a_demotion_moves_to_the_arena_are_announced_chained(tiered):
    """An 8-chunk chain stored in a device tier (one ALLOC: the daemon knows each chunk's
    parent there), then its 4 least recently used chunks demoted to the arena: each
    stored "cpu" event names the parent its ALLOC did, so a relay announces every
    demoted chunk, in its own block hashes, chained from the one before."""
    service, _ = tiered
    session, _ = hello(service, [DEVICE])
    watcher, _ = hello(service)
    cursor = service.handle(watcher, Subscribe([1])).cursor
    tokens = np.arange(9000, 9000 + 8 * CHUNK, dtype=np.int64)
    hashes, parent = [], ROOT_HASH
    for i in range(8):
        parent = hash_block_tokens(parent, tokens[i * CHUNK:(i + 1) * CHUNK])
        hashes.append(parent)
    alloc = service.handle(session, Alloc(1, b"".join(hashes), [1000] * 8, 1))
    for i, ref in enumerate(alloc.block_ids):
        write_header(block_view(service, ref), 0, hashes[i], tokens[i * CHUNK:(i + 1) * CHUNK])
    assert service.handle(session, Commit(alloc.block_ids)) == Ok()
    drain_demotions(service)  # the reserve: one chunk
    service.demoter.plan({1: 4})  # an ALLOC of 4 found the tier full: 3 more
    drain_demotions(service)
    assert service.demoter.stats.demotions == 4
    reply = service.handle(watcher, Events(cursor, 0, True))
    assert [(e.medium, e.chunk_hash) for e in reply.events] == [("cpu", h) for h in hashes[:4]]
    relay = EventRelay(layout().to_wire(), BLOCK, block_hash, socket="/nonexistent")
    events = relay.translate(reply.events)
    expected = own_hashes(tokens.tolist())
    assert [h for e in events for h in e.block_hashes] == expected[:16]
    assert [e.parent_block_hash for e in events] == [None] + [expected[4 * i - 1]
                                                              for i in (1, 2, 3)]
    assert relay.stats["unresolved_parent"] == relay.stats["unresolved_salt"] == 0


class Announced:
    """What a router learns from a relay's block events: the blocks announced now per
    medium; a block announced twice without a removal between, or removed while not
    announced, is recorded in `doubled` / `unknown_removals`."""

    def __init__(self) -> None:
        self.blocks: set[tuple[str, bytes]] = set()
        self.doubled: list = []
        self.unknown_removals: list = []

    def apply(self, events) -> None:
        for event in events:
            for h in event.block_hashes:
                key = (event.medium, h)
                if event.kind == "stored":
                    if key in self.blocks:
                        self.doubled.append(key)
                    self.blocks.add(key)
                elif key in self.blocks:
                    self.blocks.discard(key)
                else:
                    self.unknown_removals.append(key)


def test_chunks_stored_while_a_relay_attaches_are_announced_once_paced_and_complete(
        daemon_factory):
    """The fault of 100k chunks stored while an instance attaches, at 6,400 chunks: 3,200
    cached when a relay attaches with a snapshot, 3,200 more stored by another client
    while its snapshot pages (the arena of 4,096 blocks evicts ~2,300 meanwhile). Each
    poll reads at most `max_events` chunk events; at the end the relay has announced
    exactly what a relay that followed the feed from the start announced (nothing lost),
    each block once (nothing doubled), and nothing it announced has left the arena."""
    import threading
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "4KiB")
    prompts = [list(range(p * 100_000, p * 100_000 + 100 * CHUNK)) for p in range(64)]
    witness = EventRelay(layout().to_wire(), BLOCK, block_hash, socket=daemon.socket,
                         max_events=4096, snapshot=False)
    witness.poll()
    truth = Announced()
    for tokens in prompts[:32]:
        store(daemon.socket, tokens)
        truth.apply(witness.poll())
    relay = EventRelay(layout().to_wire(), BLOCK, block_hash, socket=daemon.socket,
                       max_events=256)
    seen = Announced()

    def writer() -> None:
        engine = CacheEngine.connect(layout(), socket=daemon.socket, strict=True)
        try:
            kv = torch.zeros(layout().chunk_shape(100 * CHUNK), dtype=torch.bfloat16)
            for tokens in prompts[32:]:
                engine.store(torch.tensor(tokens), kv)
        finally:
            engine.close()

    thread = threading.Thread(target=writer)
    try:
        seen.apply(relay.poll())  # subscribes: the snapshot's first page
        thread.start()
        deadline = time.monotonic() + 120
        quiet = 0
        while quiet < 3:  # the writer done, the snapshot paged, the feed drained
            assert time.monotonic() < deadline, relay.stats
            before = relay.stats["chunk_events"]
            seen.apply(relay.poll())
            truth.apply(witness.poll())
            read = relay.stats["chunk_events"] - before
            assert read <= 256
            busy = thread.is_alive() or relay.snapshot_left or read
            quiet = 0 if busy else quiet + 1
            time.sleep(0.001)
        thread.join()
        truth.apply(witness.poll())
        with Connection(daemon.socket) as conn:
            cached = {k: v for s in conn.request(Info()).sections.values()
                      for k, v in s.items()}["cached_values"]
    finally:
        thread.join()
        relay.close()
        witness.close()
    assert relay.stats["snapshot"] > 1000 and relay.stats["removed"] > 1000, relay.stats
    assert seen.doubled == [] and seen.unknown_removals == []
    assert witness.stats["lost"] == relay.stats["lost"] == 0
    assert not any(relay.stats[k] for k in ("unresolved_parent", "unresolved_tokens",
                                            "unresolved_salt")), relay.stats
    assert seen.blocks == truth.blocks
    assert relay.num_announced_chunks == witness.num_announced_chunks == cached
