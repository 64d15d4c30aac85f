"""OPEN_TIER against a real daemon with a fake device tier (`--gpu-backend fake`): the
tier's descriptor arrives with its reply (SCM_RIGHTS), maps as the daemon's memory,
arrives on the right reply behind a backlog, and costs the daemon no descriptor."""

import os
import socket
import struct
import time

import msgspec
import pytest

from lmcached.protocol import (
    PROTOCOL_VERSION,
    Connection,
    DaemonError,
    Hello,
    Info,
    Layout,
    OpenTier,
    Ping,
    TierHandle,
    encode_frame,
    reply_decoder,
)
from lmcached.shm.arena import Arena

BACKLOG = 400  # INFO replies (~2.5 KiB each) queued before the TierHandle: more than the
# socket buffer holds, so the daemon keeps the rest, and the descriptor, in its outbuf
LAYOUT = Layout("fd-test", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)


@pytest.fixture
def fake_tier_daemon(daemon_factory):
    return daemon_factory("--capacity", "64MiB", "--block-size", "64KiB",
                          "--gpu-capacity", "8MiB", "--gpu-backend", "fake")


def daemon_fd_count(daemon) -> int:
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def wait_for_fd_count(daemon, expected, deadline_s: float = 5.0) -> int:
    """The daemon's descriptor count once it equals `expected` (or stops changing, for
    None), or when the deadline passes."""
    end = time.monotonic() + deadline_s
    count = daemon_fd_count(daemon)
    while time.monotonic() < end:
        time.sleep(0.05)
        previous, count = count, daemon_fd_count(daemon)
        if count == expected or (expected is None and count == previous):
            break
    return count


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_the_tier_descriptor_maps_the_daemons_memory(fake_tier_daemon):
    with Connection(fake_tier_daemon.socket) as conn:
        hello = conn.request(Hello(PROTOCOL_VERSION, os.getpid(), "t", [LAYOUT], ["fake-0"]))
        assert [(t.tier_id, t.kind, t.device) for t in hello.tiers] == \
            [(0, "host", ""), (1, "fake", "fake-0")]
        handle, fds = conn.request_with_fds(OpenTier(1))
        assert handle == TierHandle(1, hello.generation, "fake", "fake-0", 8 << 20)
        assert len(fds) == 1
        with pytest.raises(ValueError, match="generation"):  # a stale generation's memory
            Arena.from_fd(fds[0], hello.generation + 1, hello.block_bytes)
        tier = Arena.from_fd(fds[0], hello.generation, hello.block_bytes)
        os.close(fds[0])
        try:
            assert tier.num_blocks == hello.tiers[1].num_blocks == 127
            with pytest.raises(DaemonError, match="already opened"):
                conn.request_with_fds(OpenTier(1))
        finally:
            tier.close()


def test_a_session_without_the_device_gets_no_descriptor(fake_tier_daemon):
    before = open_fds()
    for devices in ([], ["*"], ["GPU-elsewhere"]):
        with Connection(fake_tier_daemon.socket) as conn:
            conn.request(Hello(PROTOCOL_VERSION, os.getpid(), "t", [LAYOUT], devices))
            with pytest.raises(DaemonError) as raised:
                conn.request_with_fds(OpenTier(1))
            assert raised.value.code == "bad_tier"
            assert conn.request(Ping()).__class__.__name__ == "Ok"  # still usable
    assert open_fds() == before


def test_the_descriptor_rides_its_own_reply_behind_a_backlog(fake_tier_daemon):
    """Replies the client does not read yet fill the socket; the descriptor must arrive
    with the TierHandle's first byte, not with an earlier INFO reply."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(fake_tier_daemon.socket)
    sock.settimeout(10)
    hello = Hello(PROTOCOL_VERSION, os.getpid(), "t", [LAYOUT], ["fake-0"])
    frames = [encode_frame(hello)] + [encode_frame(Info())] * BACKLOG + [encode_frame(OpenTier(1))] \
        + [encode_frame(Ping())] * 3
    sock.sendall(b"".join(frames))
    # Read nothing until the daemon has answered every frame, so that it holds the
    # replies the socket cannot take (and the descriptor's place among them).
    deadline = time.monotonic() + 10
    with Connection(fake_tier_daemon.socket) as watcher:
        while watcher.request(Info("stats")).sections["stats"]["requests"] < len(frames):
            assert time.monotonic() < deadline, "the daemon did not answer the backlog"
            time.sleep(0.05)
    replies, pending, received, carried = [], b"", 0, []
    while len(replies) < len(frames):
        data, fds, flags, _ = socket.recv_fds(sock, 4096, 4)
        assert not flags & socket.MSG_CTRUNC and data
        if fds:  # the byte range of the stream this read returned
            carried.append((received, received + len(data), fds))
        received += len(data)
        pending += data
        while len(pending) >= 4:
            (length,) = struct.unpack_from("<I", pending)
            if len(pending) < 4 + length:
                break
            replies.append((received - len(pending), reply_decoder.decode(pending[4 : 4 + length])))
            pending = pending[4 + length :]
    sock.close()
    assert [type(r).__name__ for _, r in replies] == \
        ["HelloReply"] + ["InfoReply"] * BACKLOG + ["TierHandle"] + ["Ok"] * 3
    assert len(carried) == 1, carried
    start, end, fds = carried[0]
    handle_at = replies[BACKLOG + 1][0]  # where the TierHandle frame starts in the stream
    # The kernel may return earlier bytes in the same read, never the descriptor before
    # the reply it was sent with.
    assert start <= handle_at < end, (start, handle_at, end)
    assert len(fds) == 1 and os.fstat(fds[0]).st_size == 8 << 20
    os.close(fds[0])


def test_open_tier_costs_the_daemon_no_descriptor(fake_tier_daemon):
    def open_and_close():
        with Connection(fake_tier_daemon.socket) as conn:
            conn.request(Hello(PROTOCOL_VERSION, os.getpid(), "t", [LAYOUT], ["fake-0"]))
            _, fds = conn.request_with_fds(OpenTier(1))
            for fd in fds:
                os.close(fd)

    open_and_close()  # the first session may open what the daemon keeps (e.g. a log)
    before = wait_for_fd_count(fake_tier_daemon, None)
    for _ in range(50):
        open_and_close()
    # Each session's socket closes when the daemon reads its EOF: wait for that.
    assert wait_for_fd_count(fake_tier_daemon, before) == before


def test_more_descriptors_than_asked_break_the_connection_and_leak_none():
    ours, theirs = socket.socketpair()
    conn = Connection.__new__(Connection)  # a Connection over one end of a socketpair
    conn.socket_path, conn.timeout_s, conn._sock = "socketpair", 5.0, ours
    conn._sock_timeout_s, conn._header, conn._broken = 5.0, bytearray(4), None
    frame = encode_frame(TierHandle(1, 1, "fake", "fake-0", 1))
    extra = [os.memfd_create("a"), os.memfd_create("b")]
    socket.send_fds(theirs, [frame], extra)
    before = open_fds()
    with pytest.raises(ConnectionError, match="more than 1"):
        conn.request_with_fds(OpenTier(1))
    assert open_fds() == before  # what arrived was closed
    with pytest.raises(ConnectionError, match="out of step"):
        conn.request(Ping())
    for fd in extra:
        os.close(fd)
    ours.close()
    theirs.close()


def test_a_hello_with_too_many_devices_is_refused(fake_tier_daemon):
    with Connection(fake_tier_daemon.socket) as conn:
        with pytest.raises(DaemonError) as raised:
            conn.request(Hello(PROTOCOL_VERSION, os.getpid(), "t", [LAYOUT],
                               [f"GPU-{i}" for i in range(17)]))
        assert raised.value.code == "bad_request"
    payload = msgspec.msgpack.encode(["open_tier", 0])
    with Connection(fake_tier_daemon.socket) as conn:
        conn.request(Hello(PROTOCOL_VERSION, os.getpid(), "t", [LAYOUT], ["fake-0"]))
        conn._sock.sendall(struct.pack("<I", len(payload)) + payload)  # tier 0: the host
        conn._recv_exactly(conn._header)
        (length,) = struct.unpack("<I", conn._header)
        reply = bytearray(length)
        conn._recv_exactly(reply)
        assert reply_decoder.decode(reply).code == "bad_request"
