"""DaemonLink: a failed fill never leaves a readable or a stuck record
(`fill_and_commit` of client/chain/ on a link); a link maps the device tiers it asked for and only those, closes
their descriptors, and a tier it cannot map is one warning per process and a session
without that device (the daemon then refuses that tier to it); an ACQUIRE reply of
device block refs stays within one frame (`chunks_per_request`)."""

import logging
import os
import time

import pytest
import torch

from engine_worker import prompt_kv, small_layout
from lmcached.client import CacheEngine, daemon_link, link_reconnect, link_tiers
from lmcached.client.chain import chunks_per_request, fill_and_commit
from lmcached.client.daemon_link import DaemonLink
from lmcached.client.layout import KVLayout
from lmcached.wire.connection import Connection, DaemonError
from lmcached.wire.frames import encode_frame
from lmcached.wire.protocol import (
    ANY_DEVICE,
    MAX_FRAME_BYTES,
    MAX_TIERS,
    TIER_SHIFT,
    Alloc,
    BlocksReply,
    Info,
    Lookup,
    block_ref,
    tier_of,
)
from lmcached.shm.arena import Arena

LAYOUT = KVLayout("link-test", num_layers=2, num_kv_heads=2, head_size=16, dtype="float16",
                  chunk_size=16)
HASHES = [bytes([i]) * 16 for i in range(1, 4)]


def alloc(link: DaemonLink, tier: int = 0) -> tuple[list[int], int]:
    hello = link.ensure_connected()
    reply = link.request(Alloc(hello.namespaces[0], b"".join(HASHES), [4096] * len(HASHES),
                               tier))
    return list(reply.block_ids), hello.generation


def num_ready(link: DaemonLink) -> int:
    return link.request(Lookup(link.hello_reply.namespaces, b"".join(HASHES))).num_chunks


def writing_blocks(socket: str) -> int:
    with Connection(socket) as conn:
        return conn.request(Info("blocks")).sections["blocks"]["writing_blocks"]


def test_a_fill_that_raises_aborts_the_blocks_and_reraises(daemon):
    link = DaemonLink(daemon.socket, layouts=[LAYOUT.to_wire()])
    try:
        block_ids, generation = alloc(link)
        assert block_ids and writing_blocks(daemon.socket) == len(block_ids)

        def broken_fill() -> None:
            raise RuntimeError("copy failed half way")

        with pytest.raises(RuntimeError, match="half way"):
            fill_and_commit(link, block_ids, generation, broken_fill)
        assert writing_blocks(daemon.socket) == 0  # aborted, back in the free queue
        assert num_ready(link) == 0  # nothing half-written is readable

        block_ids, generation = alloc(link)  # the same chunks can be stored again
        filled = []
        assert fill_and_commit(link, block_ids, generation, lambda: filled.append(1)) is True
        assert filled == [1] and num_ready(link) == len(HASHES)
    finally:
        link.close()


def test_a_commit_into_another_generation_is_not_sent(daemon):
    link = DaemonLink(daemon.socket, layouts=[LAYOUT.to_wire()])
    try:
        block_ids, generation = alloc(link)
        assert fill_and_commit(link, block_ids, generation + 1, lambda: None) is False
    finally:
        link.close()


# ------------------------------------------------------------------- device tiers
def assert_no_device_in_session(link: DaemonLink) -> None:
    """The session's HELLO named no device: ALLOC into tier 1 is refused, host ALLOC works."""
    with pytest.raises(DaemonError) as refused:
        alloc(link, 1)
    assert refused.value.code == "bad_tier"
    block_ids, _ = alloc(link)
    assert [tier_of(ref) for ref in block_ids] == [0] * len(HASHES)


@pytest.fixture
def fake_tier_daemon(daemon_factory):
    """A daemon with a 1 MiB "fake" device tier (device "fake-0", tier 1) of 64 KiB blocks."""
    return daemon_factory("--capacity", "16MiB", "--block-size", "64KiB",
                          "--gpu-capacity", "1MiB", "--gpu-backend", "fake")


@pytest.fixture
def warned(monkeypatch):
    """A fresh per-process record of the devices warned about."""
    monkeypatch.setattr(daemon_link, "_WARNED_DEVICES", set())


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_link_maps_the_tier_of_its_device_and_allocates_there(fake_tier_daemon):
    num_fds = open_fds()
    link = DaemonLink(fake_tier_daemon.socket, layouts=[LAYOUT.to_wire()], devices=["fake-0"])
    try:
        hello = link.ensure_connected()
        (info,) = [t for t in hello.tiers if t.device == "fake-0"]
        tier = link.tiers[info.tier_id]
        assert set(link.tiers) == {info.tier_id} and link.home_tier == info.tier_id
        assert isinstance(tier, Arena) and tier.generation == hello.generation
        assert (tier.capacity_bytes, tier.num_blocks) == (info.size_bytes, info.num_blocks)
        snapshot = link.snapshot()
        assert snapshot.tiers == link.tiers and snapshot.home_tier == info.tier_id
        block_ids, _ = alloc(link, link.home_tier)
        assert [tier_of(ref) for ref in block_ids] == [info.tier_id] * len(HASHES)
    finally:
        link.close()
    with pytest.raises(ValueError, match="closed"):  # unmapped with the host arena
        tier.numpy_view(0, 1)
    assert open_fds() == num_fds  # OPEN_TIER's descriptor was closed once mapped


@pytest.mark.parametrize("devices", [(), (ANY_DEVICE,), ("fake-9",)])
def test_a_link_maps_no_tier_it_did_not_ask_for(fake_tier_daemon, monkeypatch, devices):
    opened = []
    real_map_tier = link_tiers.map_tier
    monkeypatch.setattr(link_tiers, "map_tier",
                        lambda *args: opened.append(args) or real_map_tier(*args))
    link = DaemonLink(fake_tier_daemon.socket, layouts=[LAYOUT.to_wire()], devices=devices)
    try:
        link.ensure_connected()
        assert (link.tiers, link.home_tier, opened) == ({}, 0, [])
        if devices != (ANY_DEVICE,):  # the daemon knows the session cannot read tier 1
            assert_no_device_in_session(link)
    finally:
        link.close()


REAL_FROM_FD = Arena.from_fd


def from_fd_of_another_generation(cls, fd, generation, block_bytes, size_bytes, populate=True):
    return REAL_FROM_FD(fd, generation + 1, block_bytes, size_bytes, populate)  # the real check


def ctrunc(conn: Connection, message, max_fds=1, timeout_s=None):
    conn.close()  # as after MSG_CTRUNC: the connection is out of step
    raise ConnectionError("descriptors were truncated (MSG_CTRUNC)")


@pytest.mark.parametrize("attr, broken, reason", [
    ((Arena, "from_fd"), classmethod(from_fd_of_another_generation), "not of generation"),
    ((Connection, "request_with_fds"), ctrunc, "MSG_CTRUNC"),
])
def test_a_tier_that_cannot_be_mapped_is_warned_once_and_left_out_of_the_session(
        fake_tier_daemon, monkeypatch, warned, caplog, attr, broken, reason):
    monkeypatch.setattr(*attr, broken)
    num_fds = open_fds()
    links = [DaemonLink(fake_tier_daemon.socket, layouts=[LAYOUT.to_wire()],
                        devices=["fake-0"]) for _ in range(2)]
    try:
        with caplog.at_level(logging.WARNING, logger="lmcached.client.daemon_link"):
            for link in links:
                link.connect()
                assert (link.tiers, link.home_tier, link.failed_devices) == ({}, 0, {"fake-0"})
                assert_no_device_in_session(link)  # reconnected without the device
        messages = [r.getMessage() for r in caplog.records if "not usable" in r.getMessage()]
        assert len(messages) == 1 and reason in messages[0] and "fake-0" in messages[0]
        # The sessions that asked for the device are gone: two links and this INFO.
        deadline = time.monotonic() + 10
        while fake_tier_daemon.info()["connected_clients"] != 3:
            assert time.monotonic() < deadline, "a session that failed to map stayed open"
            time.sleep(0.05)
    finally:
        for link in links:
            link.close()
    assert open_fds() == num_fds  # OPEN_TIER's descriptor was closed on failure too


def test_an_acquire_reply_of_chunks_per_request_device_chunks_fits_one_frame():
    # Chunks of many small blocks, every ref of the last tier: 9 msgpack bytes each.
    layout = KVLayout("many-blocks", num_layers=1, num_kv_heads=1, head_size=8,
                      dtype="float16", chunk_size=16)
    block_bytes = 64
    blocks_per_chunk = -(-layout.record_bytes(16) // block_bytes)
    assert blocks_per_chunk >= 8  # the block refs dominate the reply
    num_chunks = chunks_per_request(layout, block_bytes)
    ref = block_ref(MAX_TIERS - 1, (1 << TIER_SHIFT) - 1)
    reply = BlocksReply(lease=(1 << 64) - 1, block_ids=[ref] * (num_chunks * blocks_per_chunk),
                        span_lengths=[blocks_per_chunk] * num_chunks,
                        num_bytes=[layout.record_bytes(16)] * num_chunks)
    assert len(encode_frame(reply)) <= MAX_FRAME_BYTES + 4


def test_a_link_given_no_socket_finds_its_daemon_where_it_started_later(
        monkeypatch, short_tmp, unique_name):
    """A worker given only the daemon's name looks where the daemon may listen
    (/run/lmcached, ..., $XDG_RUNTIME_DIR/lmcached) at each reconnect: a daemon started
    after the worker, in the last of those places, is found without a restart."""
    from conftest import start_daemon
    from lmcached.wire import socket_path

    monkeypatch.setattr(socket_path, "RUN_DIRECTORY", os.path.join(short_tmp, "run-lmcached"))
    for name in ("LMCACHED_SOCKET", "RUNTIME_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.path.join(short_tmp, "xdg"))
    link = DaemonLink(None, name=unique_name, layouts=[LAYOUT.to_wire()])
    assert not link.try_connect()  # nothing runs yet: a miss, not an error
    where = os.path.join(short_tmp, "xdg", "lmcached", f"{unique_name}.sock")
    daemon = start_daemon(unique_name, where, os.path.join(short_tmp, "d.log"),
                          "--capacity", "8MiB")
    try:
        deadline = time.monotonic() + 10
        while link.snapshot() is None:  # the back-off passes, the next try finds it
            assert time.monotonic() < deadline, link.socket_path
            time.sleep(0.05)
        assert link.socket_path == where and link.generation is not None
        link.close()
    finally:
        assert daemon.stop() == 0


# ------------------------------------------- permanent refusals, idle-closed sessions
def lmcached_records(caplog, level: int = logging.WARNING) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("lmcached") and r.levelno >= level]


def test_a_layout_too_large_for_a_session_is_one_error_naming_sizes_and_fix_no_retry_storm(
        daemon, caplog):
    """A 32 MiB chunk record against a 64 MiB arena of 1 MiB blocks (one session may hold
    31 of its 63 blocks) can never be stored: one ERROR naming the sizes and the options,
    misses for every call, and no second HELLO within the long back-off (a transient
    back-off would have retried about five times in 1.5 s)."""
    caplog.set_level(logging.INFO, logger="lmcached")
    big = KVLayout("too-big", num_layers=32, num_kv_heads=8, head_size=128,
                   dtype="bfloat16", chunk_size=256)
    record_bytes = big.record_bytes(256)
    tokens = list(range(512))
    engine = CacheEngine.connect(big, socket=daemon.socket, data_timeout_s=0.2)
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # a serving loop: one cache call per step
            assert engine.lookup(tokens) == 0
            time.sleep(0.01)
        assert engine.link.hello_reply is None
    finally:
        engine.close()
    assert daemon.info()["errors_too_large"] == 1  # one HELLO, not a retry storm
    records = lmcached_records(caplog)
    assert [r.levelno for r in records] == [logging.ERROR], [r.getMessage() for r in records]
    message = records[0].getMessage()
    for part in (f"a chunk record of {record_bytes} bytes", "needs 33 blocks of 1048576 bytes",
                 "one session may hold 31 of the arena's 63", "--max-session-share 50%",
                 "--capacity 67MiB or more or --max-session-share 53", "smaller chunk_size",
                 "refuses this client", f"next try in {link_reconnect.PERMANENT_BACKOFF_S:.0f} s"):
        assert part in message, (part, message)
    assert not any("unavailable" in r.getMessage() or "is back" in r.getMessage()
                   for r in caplog.records)


def test_a_strict_connect_raises_the_permanent_refusal(daemon):
    big = KVLayout("too-big", num_layers=32, num_kv_heads=8, head_size=128,
                   dtype="bfloat16", chunk_size=256)
    with pytest.raises(DaemonError) as refused:
        CacheEngine.connect(big, socket=daemon.socket, strict=True)
    assert refused.value.code == "too_large" and refused.value.permanent


def test_a_session_closed_while_idle_is_reopened_without_a_miss_or_warning(daemon_factory,
                                                                            caplog):
    daemon = daemon_factory("--capacity", "64MiB", "--block-size", "1MiB",
                            "--idle-timeout", "0.5")
    layout = small_layout()
    tokens = list(range(64))
    kv = prompt_kv(layout, tokens)
    engine = CacheEngine.connect(layout, socket=daemon.socket, strict=True)
    try:
        assert engine.store(tokens, kv) == 4
        old = engine.link.hello_reply
        deadline = time.monotonic() + 20
        while daemon.info().get("errors_idle_timeout", 0) < 1:  # the daemon closed our session
            assert time.monotonic() < deadline, "the daemon never closed the idle session"
            time.sleep(0.1)
        caplog.clear()
        caplog.set_level(logging.DEBUG, logger="lmcached")
        assert engine.lookup(tokens) == 64  # a hit, not a miss
        got, ret_mask = engine.retrieve(tokens, return_tuple=False)
        assert bool(ret_mask.all()) and torch.equal(got, kv)
        assert not lmcached_records(caplog), [r.getMessage() for r in caplog.records]
        new = engine.link.hello_reply
        assert new.session_id != old.session_id and new.generation == old.generation
        # Pins of the closed session never look held by the new one.
        assert not engine.link.holds(old.session_id, old.generation)
        assert engine.link.holds(new.session_id, new.generation)
        assert any("idle" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.DEBUG)
    finally:
        engine.close()
    assert daemon.info()["pinned_blocks"] == 0
