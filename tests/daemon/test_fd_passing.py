"""Descriptors on replies (SCM_RIGHTS; OPEN_TIER's TierHandle), at two layers.

In process: the daemon's real event loop (`Server.serve_forever` on a real listening
socket, in a thread) over a stand-in service whose OPEN_TIER hands out memfds: each
descriptor arrives with the first byte of its own reply, also behind replies the
client reads late, and neither side keeps a descriptor it should not.
Against a real daemon with a fake device tier (`--gpu-backend fake`): the tier's
descriptor maps the daemon's memory, rides its own reply behind a backlog, and costs
the daemon no descriptor.
"""

import os
import socket
import struct
import threading
import time

import msgspec
import pytest

from raw_frames import recv_reply, send_payload
from lmcached.daemon.server_config import ServerConfig
from lmcached.wire.connection import Connection, DaemonError
from lmcached.wire.frames import encode_frame, reply_decoder
from lmcached.wire.protocol import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    Info,
    InfoReply,
    Layout,
    Ok,
    OpenTier,
    Ping,
    Shutdown,
    TierHandle,
)
from lmcached.daemon.server import Server
from lmcached.daemon.session import Session
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
            Arena.from_fd(fds[0], hello.generation + 1, hello.block_bytes, handle.size_bytes)
        tier = Arena.from_fd(fds[0], hello.generation, hello.block_bytes, handle.size_bytes)
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


def test_a_hello_with_too_many_devices_is_refused(fake_tier_daemon):
    with Connection(fake_tier_daemon.socket) as conn:
        with pytest.raises(DaemonError) as raised:
            conn.request(Hello(PROTOCOL_VERSION, os.getpid(), "t", [LAYOUT],
                               [f"GPU-{i}" for i in range(17)]))
        assert raised.value.code == "bad_request"
    payload = msgspec.msgpack.encode(["open_tier", 0])
    with Connection(fake_tier_daemon.socket) as conn:
        conn.request(Hello(PROTOCOL_VERSION, os.getpid(), "t", [LAYOUT], ["fake-0"]))
        send_payload(conn._sock, payload)  # tier 0: the host
        assert recv_reply(conn._sock).code == "bad_request"


# ------------------------------------------------ in process: the loop, a stand-in service
MiB = 1 << 20
PAD_BYTES = 64 * 1024  # an INFO reply of the stand-in service: ~64 KiB
TIER_BYTES = 1 * MiB


class TierService:
    """The part of CacheService the loop calls, answering PING, INFO (PAD_BYTES of
    padding), SHUTDOWN, and OPEN_TIER t with `tier_fds(t)` as `session.reply_fds` (as
    CacheService.open_tier does)."""

    def __init__(self, name: str) -> None:
        self.stop_requested = False
        self.spill_tiers = []  # the server's teardown closes them
        self.num_requests = 0
        self.work_units = 0  # fixed prices only (CacheService.work_units)
        self.tiers = {t: Arena.create_memfd(f"{name}-t{t}", 9, TIER_BYTES, prefault=False)
                      for t in (1, 2)}
        for t, arena in self.tiers.items():  # a pattern per tier, to tell them apart
            arena.numpy_view(8192, 4096)[:] = 0x10 + t
        self._next_session_id = 0

    def tier_fds(self, tier_id: int) -> list[int]:
        """Tiers 1 and 2: their memfd; 3: both; 4: tier 1's, on a reply too large for
        the socket's buffer (its device name), so that it is sent in parts."""
        one, two = self.tiers[1].export_fd(), self.tiers[2].export_fd()
        return {1: [one], 2: [two], 3: [one, two], 4: [one]}[tier_id]

    def handle(self, session: Session, request):
        self.num_requests += 1
        if type(request) is OpenTier:
            session.reply_fds = self.tier_fds(request.tier_id)
            device = "x" * (MiB // 2) if request.tier_id == 4 else f"fake-{request.tier_id}"
            return TierHandle(request.tier_id, 9, "fake", device, TIER_BYTES)
        if type(request) is Info:
            return InfoReply({"pad": {"bytes": "x" * PAD_BYTES}})
        if type(request) is Shutdown:
            self.stop_requested = True
        return Ok()

    def open_session(self, pid: int, uid: int, gid: int) -> Session:
        self._next_session_id += 1
        return Session(self._next_session_id, pid, uid, gid)

    def error(self, code: str, message: str) -> Error:
        return Error(code, message)

    def spill_tier(self, name: str) -> None:
        return None  # no disk tier to rebuild or save

    def close_session(self, session: Session) -> None:
        pass

    def withdraw(self, session: Session, reply) -> None:
        pass

    def housekeeping(self) -> None:
        pass

    def close(self) -> None:
        for arena in self.tiers.values():
            arena.close()


@pytest.fixture
def loop_server(unique_name, short_tmp):
    """(socket path, TierService) of a Server loop serving in a thread of this process."""
    path = os.path.join(short_tmp, "fd.sock")
    server = Server(ServerConfig(name=unique_name, socket=path))
    server.service = service = TierService(unique_name)
    server._listen(path)
    failures = []

    def serve():
        try:
            server.serve_forever()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path, service
    if thread.is_alive():
        with Connection(path) as conn:
            conn.request(Shutdown())
        thread.join(10)
    assert not thread.is_alive() and not failures, failures


def recv_exactly_with_fds(sock: socket.socket, num_bytes: int, offset: int, carried: dict):
    """`num_bytes` of the stream; descriptors that come with a read are recorded in
    `carried` at the stream offset of that read's first byte (reads never cross a reply
    boundary, so that offset is where the daemon attached them)."""
    data = b""
    while len(data) < num_bytes:
        chunk, fds, flags, _ = socket.recv_fds(sock, num_bytes - len(data), 4)
        assert chunk and not flags & socket.MSG_CTRUNC
        if fds:
            carried[offset + len(data)] = fds
        data += chunk
    return data


def same_file(fd_a: int, fd_b: int) -> bool:
    a, b = os.fstat(fd_a), os.fstat(fd_b)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def test_the_descriptor_comes_with_its_reply_and_reads_the_tiers_bytes(loop_server):
    path, service = loop_server
    with Connection(path) as conn:
        assert conn.request_with_fds(Ping()) == (Ok(), [])
        handle, fds = conn.request_with_fds(OpenTier(2))
        assert handle == TierHandle(2, 9, "fake", "fake-2", TIER_BYTES) and len(fds) == 1
        assert os.pread(fds[0], 4096, 8192) == bytes([0x12]) * 4096
        service.tiers[2].numpy_view(0, 16)[:] = 0x99  # the daemon writes, the client sees
        assert os.pread(fds[0], 16, 0) == b"\x99" * 16
        assert not os.get_inheritable(fds[0])  # MSG_CMSG_CLOEXEC: no spawned child gets it
        os.close(fds[0])
        assert conn.request(Ping()) == Ok()  # the stream is still in step


@pytest.mark.parametrize("slow_reader", [False, True])
def test_pipelined_replies_carry_each_descriptor_on_its_own_reply(loop_server, slow_reader):
    """Replies queued back to back, some carrying descriptors: the second reply is
    larger than the socket takes (sent in parts, its descriptor with the first), the
    next ones wait in the daemon's outbuf behind it. A slow reader also lets the daemon
    buffer megabytes of replies between two descriptors (several pending at once)."""
    path, service = loop_server
    padding = 40 if slow_reader else 0  # 40 INFO replies: ~2.5 MiB, beyond the socket's buffer
    requests = ([Ping(), OpenTier(4), OpenTier(1), Ping()] + [Info()] * padding + [OpenTier(2)]
                + [Info()] * padding + [OpenTier(1), Ping()])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(path)
    sock.settimeout(10)
    sock.sendall(b"".join(encode_frame(r) for r in requests))
    if slow_reader:  # read nothing until the daemon has had to keep replies back
        deadline = time.monotonic() + 10
        while service.num_requests < 4 + padding // 4:  # ~640 KiB of replies: more than
            # the socket takes, so the rest waits in the daemon's outbuf
            assert time.monotonic() < deadline, "the daemon did not answer"
            time.sleep(0.01)
        time.sleep(0.1)
    carried, starts, replies, offset = {}, [], [], 0
    for _ in requests:
        header = recv_exactly_with_fds(sock, 4, offset, carried)
        (length,) = struct.unpack("<I", header)
        payload = recv_exactly_with_fds(sock, length, offset + 4, carried)
        starts.append(offset)
        replies.append(type(reply_decoder.decode(payload)))
        offset += 4 + length
    sock.close()
    assert replies == [{OpenTier: TierHandle, Info: InfoReply}.get(type(r), Ok) for r in requests]
    handles = [i for i, r in enumerate(requests) if type(r) is OpenTier]
    assert sorted(carried) == [starts[i] for i in handles]  # on those replies, nowhere else
    for i in handles:
        (fd,) = carried[starts[i]]
        assert same_file(fd, service.tier_fds(requests[i].tier_id)[0])
        os.close(fd)


def test_descriptors_on_replies_leak_on_neither_side(loop_server):
    """The daemon lends its descriptors (it never dups or closes them) and the client
    owns what it receives: 200 OPEN_TIERs leave this process's descriptor count as it
    was (the loop and the client run in it)."""
    path, service = loop_server
    with Connection(path) as conn:
        conn.request(Ping())
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(200):
            _, fds = conn.request_with_fds(OpenTier(1))
            assert len(fds) == 1 and same_file(fds[0], service.tiers[1].export_fd())
            os.close(fds[0])
        assert len(os.listdir("/proc/self/fd")) == before
        service.tiers[1].export_fd()  # the daemon's own descriptor is still open


def test_more_descriptors_than_asked_break_the_connection_and_leak_none(loop_server):
    path, _ = loop_server
    with Connection(path) as conn:
        conn.request(Ping())
        before = open_fds()
        with pytest.raises(ConnectionError, match="more than 1 file descriptors"):
            conn.request_with_fds(OpenTier(3))  # two descriptors, room for one
        assert open_fds() == before  # the one that arrived was closed
        with pytest.raises(ConnectionError, match="out of step"):
            conn.request(Ping())
    with Connection(path) as conn:  # two asked for: both arrive
        _, fds = conn.request_with_fds(OpenTier(3), max_fds=2)
        assert len(fds) == 2
        for fd in fds:
            os.close(fd)
