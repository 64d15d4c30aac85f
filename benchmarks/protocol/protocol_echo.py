"""The raw echo baseline of bench_protocol.py: a Unix-socket echo server and its client.

Why this file exists: every section of bench_protocol.py reports its ops as a ratio to a
raw round trip measured in the same run, on the same machine, with the same framing
work (a 4-byte little-endian length, then the payload) but no protocol behind it. The
server runs in its own process: `python -m benchmarks.protocol.protocol_echo PATH`
(`protocol_harness.start_echo` starts and stops it). It imports nothing of lmcached.
"""

import os
import selectors
import signal
import socket
import struct
import sys

FRAME_LENGTH = struct.Struct("<I")  # a frame's length prefix, as lmcached.wire.protocol's
ECHO_SCRIPT = os.path.abspath(__file__)  # run as `python ECHO_SCRIPT PATH`


def echo_server(path: str) -> None:
    """A selectors echo server of length-prefixed frames (runs in its own process).

    Non-blocking like the daemon's loop: recv into a buffer, cut whole frames, send each
    back. Stops on SIGTERM and unlinks its socket.
    """
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    sel = selectors.DefaultSelector()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ, None)
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    buffers: dict[socket.socket, bytearray] = {}
    try:
        while not stop:
            for key, _ in sel.select():
                if key.data == "wake":
                    try:
                        wake_r.recv(64)
                    except BlockingIOError:
                        pass
                    continue
                if key.fileobj is listener:
                    sock, _ = listener.accept()
                    sock.setblocking(False)
                    buffers[sock] = bytearray()
                    sel.register(sock, selectors.EVENT_READ, "client")
                    continue
                sock = key.fileobj
                try:
                    data = sock.recv(256 * 1024)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(sock)
                    sock.close()
                    buffers.pop(sock, None)
                    continue
                inbuf = buffers[sock]
                inbuf += data
                while len(inbuf) >= 4:
                    end = 4 + int.from_bytes(inbuf[:4], "little")
                    if len(inbuf) < end:
                        break
                    frame = bytes(inbuf[:end])
                    del inbuf[:end]
                    sock.sendall(frame)  # small frames: the kernel buffer takes them whole
    finally:
        for sock in list(buffers):
            sock.close()
        listener.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class EchoClient:
    """Blocking client of the echo server: same framing work as `Connection.request`."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10.0)
        self.sock.connect(path)
        self.header = bytearray(4)

    def round_trip(self, frame: bytes) -> bytes:
        self.sock.sendall(frame)
        self._recv_exactly(self.header)
        (length,) = FRAME_LENGTH.unpack(self.header)
        payload = bytearray(length)
        self._recv_exactly(payload)
        return payload

    def _recv_exactly(self, buf: bytearray) -> None:
        view = memoryview(buf)
        while view:
            n = self.sock.recv_into(view)
            if n == 0:
                raise ConnectionResetError("echo server closed the connection")
            view = view[n:]

    def close(self) -> None:
        self.sock.close()



if __name__ == "__main__":
    echo_server(sys.argv[1])
