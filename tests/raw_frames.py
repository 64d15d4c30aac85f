"""Raw-socket frame helpers for tests: bytes on the daemon's socket, with no Connection.

Tests that must send what no `Connection` would (a forged length, garbage, a pipelined
burst) or see exactly which frames came back use these instead of writing their own
framing. The frame layout is lmcached/wire/frames.py's: a u32 little-endian length
(`FRAME_LENGTH`), then the payload.

    sock = connect(daemon.socket)
    sock.sendall(frame(b"\\xc1junk"))           # or frame(b"", MAX_FRAME_BYTES + 1)
    reply = recv_reply(sock)                    # one frame, decoded
"""

import select
import socket

from lmcached.wire.frames import FRAME_LENGTH, reply_decoder


def connect(path: str, timeout_s: float = 10.0) -> socket.socket:
    """A blocking Unix stream socket connected to `path`, with a `timeout_s` timeout."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(path)
    return sock


def frame(payload: bytes, length: int | None = None) -> bytes:
    """`payload` framed: its length prefix (or a forged `length`), then the payload."""
    return FRAME_LENGTH.pack(len(payload) if length is None else length) + payload


def send_payload(sock: socket.socket, payload: bytes, length: int | None = None) -> None:
    """Send one frame of a hand-built `payload` (see `frame`)."""
    sock.sendall(frame(payload, length))


def recv_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    """Exactly `num_bytes` bytes from `sock`.

    Raises:
        ConnectionResetError: the peer closed the connection first.
    """
    data = bytearray()
    while len(data) < num_bytes:
        chunk = sock.recv(num_bytes - len(data))
        if not chunk:
            raise ConnectionResetError(
                f"the daemon closed the connection ({len(data)} of {num_bytes} bytes read)")
        data += chunk
    return bytes(data)


def recv_frame(sock: socket.socket) -> bytes:
    """The payload of the next frame (reads nothing past it)."""
    (length,) = FRAME_LENGTH.unpack(recv_exactly(sock, FRAME_LENGTH.size))
    return recv_exactly(sock, length)


def recv_reply(sock: socket.socket):
    """The next frame, decoded as a reply (`reply_decoder`)."""
    return reply_decoder.decode(recv_frame(sock))


def read_frames(sock: socket.socket, count: int) -> list[bytes]:
    """The payloads of the next `count` frames (reads nothing past them)."""
    return [recv_frame(sock) for _ in range(count)]


def read_replies(sock: socket.socket, count: int) -> list:
    """The next `count` frames, decoded as replies."""
    return [reply_decoder.decode(payload) for payload in read_frames(sock, count)]


def split_frames(buf: bytes | bytearray) -> tuple[list[bytes], bytes]:
    """Cut `buf` into the payloads of its whole frames and what is left (a partial frame)."""
    payloads, pos = [], 0
    while len(buf) - pos >= FRAME_LENGTH.size:
        end = pos + FRAME_LENGTH.size + FRAME_LENGTH.unpack_from(buf, pos)[0]
        if end > len(buf):
            break
        payloads.append(bytes(buf[pos + FRAME_LENGTH.size : end]))
        pos = end
    return payloads, bytes(buf[pos:])


def read_until_eof(sock: socket.socket, chunk_bytes: int = 1 << 20) -> list[bytes]:
    """The payloads of every frame that arrives until the peer closes (EOF).

    Raises:
        AssertionError: the stream ended inside a frame.
    """
    buf = bytearray()
    while chunk := sock.recv(chunk_bytes):
        buf += chunk
    payloads, rest = split_frames(buf)
    assert rest == b"", f"the stream ended inside a frame ({len(rest)} bytes left)"
    return payloads


def pending_bytes(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    """Bytes that already arrived on `sock` and were not read yet (peeked, not consumed;
    b"" when none has, or at EOF)."""
    if not select.select([sock], [], [], 0)[0]:
        return b""
    return sock.recv(limit, socket.MSG_PEEK)
