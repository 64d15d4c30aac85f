"""CacheEngine over a device tier, in real processes against a real daemon whose device
tier is a memfd (`--gpu-backend fake`, device "fake-0"): what CI can run of the GPU tier.
Stores land in the tier, other processes read them in place from their own mapping of
it, host-only processes never see them, a full tier demotes to the host arena without
a wrong byte, a killed reader's device pins come back, and a tier that cannot be mapped
is one warning and the host arena. A block ref of a tier the engine has not mapped is a
miss or a skipped store, never an error. Last, without a daemon: `TieredRecords` over
two arenas writes and reads each record in the tier of its ref."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import start_daemon
from engine_worker import prompt_kv, small_layout
from lmcached.client import CacheEngine, hash_request_tokens
from lmcached.client import daemon_link, link_tiers
from lmcached.client.kv_io import KVSource
from lmcached.client.records import RecordIO
from lmcached.client.tiered_records import TieredRecords
from lmcached.wire.protocol import block_ref, tier_of
from lmcached.shm.arena import Arena

WORKER = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "engine_worker.py")
DEVICE = "fake-0"
CHUNK = 16


def run_worker(*args, device: str | None = DEVICE, timeout_s: float = 120) -> dict:
    env = {**os.environ, "LMCACHED_TEST_TIER_DEVICE": device or ""}
    proc = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def tiered_daemon(daemon_factory):
    """A 16 MiB arena and a 1 MiB fake device tier, both of 64 KiB blocks: the tier holds
    15 chunks, and keeps 1 block empty (an eighth) by demotion."""
    return daemon_factory("--capacity", "16MiB", "--block-size", "64KiB",
                          "--gpu-capacity", "1MiB", "--gpu-backend", "fake")


def test_stores_land_in_the_tier_and_other_processes_read_them_in_place(tiered_daemon):
    assert run_worker("store", tiered_daemon.socket, 0, 8 * CHUNK, 0, 1) == {"stored": 8}
    info = tiered_daemon.info()
    assert (info["tier1_cached_blocks"], info["cached_blocks"]) == (8, 0)
    # Another process with the tier: bit-exact, and its views are its own mapping of it.
    assert run_worker("views", tiered_daemon.socket, 0, 8 * CHUNK) == \
        {"hit": 8 * CHUNK, "mismatches": 0, "views_in_tier": 8, "devices": ["cpu"]}
    assert run_worker("retrieve", tiered_daemon.socket, 0, 8 * CHUNK, 0, 1) == \
        {"hit": 8 * CHUNK, "mismatches": 0}
    assert tiered_daemon.info()["tier1_hits"] == 16
    # A host-only process does not see device chunks; it stores and reads its own copy.
    host = dict(device=None)
    assert run_worker("retrieve", tiered_daemon.socket, 0, 8 * CHUNK, 0, 1, **host)["hit"] == 0
    assert run_worker("store", tiered_daemon.socket, 0, 8 * CHUNK, 0, 1, **host) == {"stored": 8}
    assert run_worker("retrieve", tiered_daemon.socket, 0, 8 * CHUNK, 0, 1, **host) == \
        {"hit": 8 * CHUNK, "mismatches": 0}
    info = tiered_daemon.info()
    assert (info["tier1_cached_blocks"], info["cached_blocks"]) == (8, 8)
    assert info["tier1_pinned_blocks"] == info["pinned_blocks"] == 0


def test_a_full_tier_demotes_to_the_host_arena_and_every_byte_reads_back(tiered_daemon):
    prompts = [(p * 1000, 6 * CHUNK) for p in range(6)]  # 36 chunks for a 15-chunk tier
    for start, length in prompts:
        assert run_worker("store", tiered_daemon.socket, start, length, 0, 1) == {"stored": 6}
    info = tiered_daemon.info()
    assert info["demotions"] > 0 and info["errors_demotion"] == 0
    assert info["tier1_cached_blocks"] + info["cached_blocks"] == 36
    for start, length in prompts:  # from the tier or from the host arena: the same bytes
        assert run_worker("retrieve", tiered_daemon.socket, start, length, 0, 1) == \
            {"hit": length, "mismatches": 0}
    # The first prompt was demoted (least recently used): a host-only process has it.
    assert run_worker("retrieve", tiered_daemon.socket, 0, 6 * CHUNK, 0, 1,
                      device=None) == {"hit": 6 * CHUNK, "mismatches": 0}
    assert tiered_daemon.info()["tier1_pinned_blocks"] == 0


def test_a_killed_reader_gives_its_device_pins_back(tiered_daemon):
    run_worker("store", tiered_daemon.socket, 0, 4 * CHUNK, 0, 1)
    env = {**os.environ, "LMCACHED_TEST_TIER_DEVICE": DEVICE}
    holder = subprocess.Popen([sys.executable, WORKER, "hold", tiered_daemon.socket, "0",
                               str(4 * CHUNK)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert json.loads(holder.stdout.readline()) == {"pinned_chunks": 4}
        assert tiered_daemon.info()["tier1_pinned_blocks"] == 4
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.stdout.close()
    for _ in range(100):  # the daemon sees the EOF on its next loop pass
        if tiered_daemon.info()["tier1_pinned_blocks"] == 0:
            break
    assert tiered_daemon.info()["tier1_pinned_blocks"] == 0


def test_a_tier_that_cannot_be_mapped_is_one_warning_and_the_host_arena(
        tiered_daemon, monkeypatch, caplog):
    def cannot_map(info, handle, fd):
        raise OSError("mapping refused (test)")

    monkeypatch.setattr(link_tiers, "map_tier", cannot_map)
    monkeypatch.setattr(daemon_link, "_WARNED_DEVICES", set())
    layout = small_layout()
    tokens = list(range(4 * CHUNK))
    with caplog.at_level(logging.WARNING, logger="lmcached.client.daemon_link"):
        for _ in range(2):
            with CacheEngine.connect(layout, socket=tiered_daemon.socket, strict=True,
                                     tier_device=DEVICE) as engine:
                assert engine.link.tiers == {} and engine.link.failed_devices == {DEVICE}
                engine.store(tokens, prompt_kv(layout, tokens))
                kv, mask = engine.retrieve(tokens, return_tuple=False)
                assert int(mask.sum()) == len(tokens)
                assert torch.equal(kv, prompt_kv(layout, tokens))
    warnings = [r for r in caplog.records if "not usable here" in r.getMessage()]
    assert len(warnings) == 1 and "mapping refused (test)" in warnings[0].getMessage()
    info = tiered_daemon.info()
    assert (info["tier1_cached_blocks"], info["cached_blocks"]) == (0, 4)


def test_the_engine_writes_device_blocks_through_its_mapping(tiered_daemon):
    layout = small_layout()
    tokens = list(range(3 * CHUNK))
    with CacheEngine.connect(layout, socket=tiered_daemon.socket, strict=True,
                             tier_device=DEVICE) as engine:
        assert engine.link.home_tier == 1 and set(engine.link.tiers) == {1}
        assert engine.store(tokens, prompt_kv(layout, tokens)) == 3
        run = engine.acquire(tokens)
        try:
            assert [tier_of(span[0]) for span in run.spans] == [1, 1, 1]
        finally:
            run.release()


def test_views_outlive_a_killed_daemon_and_the_engine_maps_the_next_generation(
        tiered_daemon, short_tmp):
    layout = small_layout()
    tokens = list(range(4 * CHUNK))
    expected = prompt_kv(layout, tokens)
    engine = CacheEngine.connect(layout, socket=tiered_daemon.socket, strict=True,
                                 tier_device=DEVICE)
    restarted = None
    try:
        engine.store(tokens, expected)
        old_generation = engine.link.generation
        views = engine.retrieve_views(tokens)
        chunks = views.chunks
        tiered_daemon.proc.kill()
        tiered_daemon.proc.wait(30)
        # The daemon is gone; the memory it owned stays mapped while views hold it.
        assert torch.equal(torch.cat(chunks, dim=layout.token_dim), expected)
        views.release()  # its RELEASE goes nowhere: no error
        del chunks
        restarted = start_daemon(tiered_daemon.name, tiered_daemon.socket,
                                 os.path.join(short_tmp, "restarted.log"),
                                 "--capacity", "16MiB", "--block-size", "64KiB",
                                 "--gpu-capacity", "1MiB", "--gpu-backend", "fake")
        kv, mask = engine.retrieve(tokens, return_tuple=False)  # reconnects: a cold cache
        assert int(mask.sum()) == 0
        deadline = time.monotonic() + 10
        while True:  # past the link's back-off
            try:
                engine.link.ensure_connected()
                break
            except daemon_link.CacheUnavailable:
                assert time.monotonic() < deadline, "the engine did not reconnect"
                time.sleep(0.05)
        assert engine.link.generation != old_generation
        assert engine.link.tiers[1].generation == engine.link.generation
        assert engine.store(tokens, expected) == 4
        kv, mask = engine.retrieve(tokens, return_tuple=False)
        assert int(mask.sum()) == len(tokens) and torch.equal(kv, expected)
        assert restarted.info()["tier1_cached_blocks"] == 4
    finally:
        engine.close()
        if restarted is not None:
            restarted.stop()


def test_refs_of_a_tier_the_engine_has_not_mapped_are_misses_and_skipped_stores(
        tiered_daemon, caplog):
    layout = small_layout()
    tokens = list(range(4 * CHUNK))
    kv = prompt_kv(layout, tokens)
    with CacheEngine.connect(layout, socket=tiered_daemon.socket, strict=True,
                             tier_device=DEVICE) as engine:
        assert engine.store(tokens, kv) == 4
        # A broken daemon would hand this session refs of tier 1 after the engine lost
        # its mapping of it: simulated by hiding the mapping from the engine's reads.
        mapping, engine.link.tiers = engine.link.tiers, {}
        try:
            with caplog.at_level(logging.WARNING, logger="lmcached.client.engine"):
                _, mask = engine.retrieve(tokens, return_tuple=False)
                assert int(mask.sum()) == 0 and engine.num_verify_failures == 1
                with engine.retrieve_views(tokens) as views:
                    assert views.num_tokens == 0
                assert engine.lookup(tokens, pin=True) == 0
                assert engine.lookup_unpin(tokens) == 1
                other = list(range(1000, 1000 + 3 * CHUNK))
                assert engine.store(other, prompt_kv(layout, other)) == 0
                assert engine.store(other, prompt_kv(layout, other)) == 0
            info = tiered_daemon.info()
            assert info["tier1_pinned_blocks"] == info["tier1_writing_blocks"] == 0
            assert (info["tier1_cached_blocks"], info["cached_blocks"]) == (4, 0)
            messages = [r.getMessage() for r in caplog.records]
            assert sum("but this process maps tiers [0]" in m for m in messages) == 1
            assert sum("does not hold the requested tokens" in m for m in messages) == 1
        finally:
            engine.link.tiers = mapping
        kv_out, mask = engine.retrieve(tokens, return_tuple=False)  # mapped again: hits
        assert int(mask.sum()) == len(tokens) and torch.equal(kv_out, kv)
        run = engine.acquire(tokens)
        assert [tier_of(span[0]) for span in run.spans] == [1] * 4
        run.release()


# ------------------------------------------------ records of two tiers (no daemon)
@pytest.fixture
def two_tiers(unique_name):
    """A host arena and a "fake" device tier (anonymous arenas of 64 KiB blocks) with
    their readers, as an engine holds them for a session that mapped tier 1."""
    host = Arena.create_memfd(unique_name, 7, 1 << 20, 64 * 1024)
    device = Arena.create_memfd(unique_name, 7, 1 << 20, 64 * 1024)
    layout = small_layout()
    yield TieredRecords({0: RecordIO(host, layout), 1: RecordIO(device, layout)}), layout
    host.close()
    device.close()


def write_prompt(records, layout, spans: list[list[int]]) -> tuple:
    """Write the records of a `len(spans)`-chunk prompt into `spans`; returns what a
    reader passes to verify_prefix."""
    tokens = np.arange(len(spans) * CHUNK, dtype=np.int64)
    hashes = hash_request_tokens(CHUNK, tokens)
    chunks = [(i * CHUNK, (i + 1) * CHUNK) for i in range(len(spans))]
    source = KVSource(prompt_kv(layout, tokens.tolist()), layout)
    for span, chunk_hash, (start, end) in zip(spans, hashes, chunks):
        records.write(span, chunk_hash, tokens[start:end], source, start, end)
    return tokens, hashes, chunks


def test_tiered_records_write_each_chunk_in_the_tier_of_its_ref(two_tiers):
    records, layout = two_tiers
    # Chunks 0-1 in host blocks 3, 4; chunks 2-3 in device blocks 3, 4 (the same local ids).
    spans = [[3], [4], [block_ref(1, 3)], [block_ref(1, 4)]]
    tokens, hashes, chunks = write_prompt(records, layout, spans)
    fp = layout.fingerprint
    assert records.verify_prefix(spans, hashes, tokens, chunks, fp) == 4
    host, device = records.by_tier[0], records.by_tier[1]
    # Each record is in its own tier only: the other tier's block with that id is empty.
    assert host.verify([3], hashes[0], tokens[:CHUNK], fp)
    assert not device.verify([3], hashes[0], tokens[:CHUNK], fp)
    assert device.verify([3], hashes[2], tokens[2 * CHUNK : 3 * CHUNK], fp)
    assert not host.verify([3], hashes[2], tokens[2 * CHUNK : 3 * CHUNK], fp)
    expected = prompt_kv(layout, tokens.tolist())
    views = [records.kv_view(span[0], CHUNK) for span in spans]
    assert torch.equal(torch.cat(views, dim=layout.token_dim), expected)
    device_base = device.arena.numpy_view(0, 1).ctypes.data
    assert [device_base <= v.data_ptr() < device_base + device.arena.capacity_bytes
            for v in views] == [False, False, True, True]  # zero copy, from its tier


def test_verify_prefix_over_mixed_tiers_stops_at_the_first_bad_record(two_tiers):
    records, layout = two_tiers
    spans = [[block_ref(1, 0)], [block_ref(1, 1)], [5], [6], [block_ref(1, 2)],
             [block_ref(1, 3)]]
    tokens, hashes, chunks = write_prompt(records, layout, spans)
    fp = layout.fingerprint
    assert records.verify_prefix(spans, hashes, tokens, chunks, fp) == 6
    other = tokens.copy()
    other[5 * CHUNK + 3] += 1  # chunk 5 (device block 3) holds other tokens
    assert records.verify_prefix(spans, hashes, other, chunks, fp) == 5
    other = tokens.copy()
    other[3 * CHUNK] += 1  # chunk 3 (host block 6)
    assert records.verify_prefix(spans, hashes, other, chunks, fp) == 3
    # A partial last chunk on the device tier goes through the one-by-one path.
    short = tokens[: 5 * CHUNK + 7]
    spans[5] = [block_ref(1, 9)]
    write_prompt(records, layout, spans[:5])
    source = KVSource(prompt_kv(layout, short.tolist()), layout)
    short_hashes = hash_request_tokens(CHUNK, short)
    records.write(spans[5], short_hashes[5], short[5 * CHUNK :], source, 5 * CHUNK, len(short))
    short_chunks = chunks[:5] + [(5 * CHUNK, len(short))]
    assert records.verify_prefix(spans, short_hashes, short, short_chunks, fp) == 6
    assert torch.equal(records.kv_view(spans[5][0], 7),
                       prompt_kv(layout, short.tolist()).narrow(layout.token_dim, 5 * CHUNK, 7))


def test_a_ref_of_a_tier_not_mapped_here_is_a_miss_not_an_error(two_tiers):
    records, layout = two_tiers
    spans = [[1], [2], [block_ref(1, 1)]]
    tokens, hashes, chunks = write_prompt(records, layout, spans)
    fp = layout.fingerprint
    foreign = spans[:2] + [[block_ref(2, 1)]]  # tier 2: never mapped
    assert records.verify_prefix(foreign, hashes, tokens, chunks, fp) == 2
    assert not records.verify(foreign[2], hashes[2], tokens[2 * CHUNK :], fp)
    # A host-only reader (an engine without tiers) given a device ref: a miss too.
    host = records.by_tier[0]
    assert host.verify_prefix(spans, hashes, tokens, chunks, fp) == 2
    assert host.verify_prefix(spans[2:], hashes[2:], tokens, chunks[2:], fp) == 0
    assert not host.maps([1, block_ref(1, 1)]) and host.maps([1, 2])
    assert records.maps([1, block_ref(1, 1)]) and not records.maps([1, block_ref(2, 1)])
