"""The blocking client connection to the daemon: one request, one reply.

Why this file exists: every client (the engine's daemon link, the CLI, the launcher, the
benchmarks) talks to the daemon through `Connection`, which keeps a request and its
reply in step and says when a connection can no longer be trusted; `hello` and
`list_clients` are the two exchanges more than one of them needs.
"""

import collections
import os
import select
import socket
import struct

import msgspec

from lmcached.wire.frames import FRAME_LENGTH, encode_frame, reply_decoder
from lmcached.wire import protocol
from lmcached.wire.protocol import (
    MAX_FRAME_BYTES,
    NO_REPLY_REQUESTS,
    PROTOCOL_VERSION,
    Clients,
    Error,
    Hello,
    HelloReply,
    Layout,
)

# An Error frame the daemon sends before it closes a connection (a refusal) is far smaller.
_MAX_REFUSAL_BYTES = 64 * 1024
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
# poll(2) events of a connection the peer closed (or that broke).
_PEER_GONE_EVENTS = select.POLLHUP | select.POLLRDHUP | select.POLLERR | select.POLLNVAL


class DaemonError(RuntimeError):
    """The daemon answered a request with an Error reply.

    Attributes:
        code: machine-readable error kind (e.g. "bad_request", "not_owner").
        message: the daemon's explanation (sizes, the option to change).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def permanent(self) -> bool:
        """Whether a HELLO refused so stays refused until a setting changes
        (protocol.PERMANENT_ERROR_CODES): not an outage to retry soon."""
        return self.code in protocol.PERMANENT_ERROR_CODES


class Connection:
    """A blocking client connection to the daemon: one request, one reply.

    Blocking sockets give the lowest round trip here (~22 us, against ~33 us for a
    selectors loop and 56-160 us for asyncio). Not thread-safe: callers that share one
    connection between threads hold their own lock.

    A request that fails half-way (timeout, closed socket, undecodable reply) leaves the
    byte stream out of step: a late reply would be read as the answer to the next
    request. The connection then refuses every later request; open a new one.

    Args:
        socket_path: path of the daemon's Unix socket.
        timeout_s: connect timeout, and the default timeout of each request, in seconds.

    Raises:
        OSError (FileNotFoundError, ConnectionRefusedError, PermissionError,
            TimeoutError, ...): no daemon answers at `socket_path`.
    """

    # The reply type of each request (see lmcached/daemon/service.py); any other reply, other
    # than an Error, means the peer does not speak this protocol.
    REPLY_TYPES: dict[type, type] = {
        Hello: HelloReply, protocol.Lookup: protocol.LookupReply,
        protocol.Acquire: protocol.BlocksReply, protocol.Alloc: protocol.AllocReply,
        protocol.Commit: protocol.Ok, protocol.Abort: protocol.Ok,
        protocol.Put: protocol.AllocReply, protocol.Get: protocol.BlocksReply,
        protocol.Delete: protocol.CountReply, protocol.Scan: protocol.KeysReply,
        protocol.Info: protocol.InfoReply, Clients: protocol.ClientsReply,
        protocol.Evict: protocol.CountReply, protocol.Clear: protocol.CountReply,
        protocol.Ping: protocol.Ok, protocol.Shutdown: protocol.Ok,
        protocol.ConfigGet: protocol.InfoReply, protocol.OpenTier: protocol.TierHandle,
        protocol.Subscribe: protocol.SubscribeReply, protocol.Events: protocol.EventsReply,
    }

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock_timeout_s = timeout_s
        try:
            self._sock.connect(socket_path)
        except BaseException:
            self._sock.close()
            raise
        self._header = bytearray(FRAME_LENGTH.size)
        self._broken: str | None = None
        self._awaiting: collections.deque[type] = collections.deque()

    def request(self, message: msgspec.Struct, timeout_s: float | None = None) -> msgspec.Struct:
        """Send one request and return its reply.

        Args:
            message: a request Struct.
            timeout_s: how long the send, and each receive of the reply, may wait, in
                seconds (None: the connection's `timeout_s`). A stopped daemon costs
                one timeout.

        Raises:
            DaemonError: the daemon answered with an Error (the connection stays usable),
                or refused the connection and closed it (e.g. `max_clients`; then not).
            ValueError: the message exceeds MAX_FRAME_BYTES; nothing was sent (the
                connection stays usable).
            TimeoutError: no reply within the timeout; the connection is then unusable.
            ConnectionError: the daemon closed the connection (it stopped or crashed),
                answered with a frame that does not decode or is not this request's
                reply type, or an earlier request on this connection failed half-way.
        """
        return self._exchange(message, timeout_s, 0)[0]

    def request_with_fds(self, message: msgspec.Struct, max_fds: int = 1,
                         timeout_s: float | None = None) -> tuple[msgspec.Struct, list[int]]:
        """`request` for a reply that carries file descriptors (OPEN_TIER's TierHandle):
        they arrive as SCM_RIGHTS ancillary data with the reply's first bytes.

        Returns:
            (reply, fds): the caller owns the descriptors and closes them.

        Raises:
            As `request`; ConnectionError also when the daemon sent more than `max_fds`
            descriptors (MSG_CTRUNC; the connection is then unusable). No descriptor is
            left open when it raises.
        """
        return self._exchange(message, timeout_s, max_fds)

    @property
    def awaiting(self) -> int:
        """Replies of `submit`ted requests not `collect`ed yet."""
        return len(self._awaiting)

    def submit(self, *messages: msgspec.Struct, timeout_s: float | None = None) -> None:
        """Send requests whose replies `collect` reads later, in one write (pipelining:
        the daemon answers a connection's requests in order, so the caller works while
        it does).

        Every submitted reply must be collected, in order, before the next `request`.

        Args:
            messages: request Structs that have a reply.
            timeout_s: how long the send may wait, seconds (None: `timeout_s`).

        Raises:
            As `request` for the send (ValueError: too large or a NO_REPLY_REQUESTS
            message, nothing sent).
        """
        self._check_usable()
        for message in messages:
            if type(message) in NO_REPLY_REQUESTS:
                raise ValueError(f"{type(message).__name__} has no reply: use send()")
        self._send_frame(b"".join([encode_frame(message) for message in messages]), timeout_s)
        self._awaiting.extend(type(message) for message in messages)

    def collect(self, timeout_s: float | None = None) -> msgspec.Struct:
        """The reply of the oldest `submit`ted request not collected yet.

        Raises:
            As `request`'s reply (DaemonError: that request was refused, the connection
            stays usable); ConnectionError also when nothing was submitted.
        """
        self._check_usable()
        if not self._awaiting:
            raise ConnectionError("collect() with no submitted request awaiting its reply")
        self._set_timeout(self.timeout_s if timeout_s is None else timeout_s)
        return self._receive_reply(self._awaiting.popleft(), 0)[0]

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise ConnectionError(
                f"connection to {self.socket_path} is out of step after an earlier failure "
                f"({self._broken}): open a new Connection"
            )

    def _exchange(self, message: msgspec.Struct, timeout_s: float | None,
                  max_fds: int) -> tuple[msgspec.Struct, list[int]]:
        self._check_usable()
        if type(message) in NO_REPLY_REQUESTS:
            raise ValueError(f"{type(message).__name__} has no reply: use send()")
        if self._awaiting:
            self._broken = "a request sent before the replies of submitted ones were collected"
            raise ConnectionError(f"{type(message).__name__} sent while {len(self._awaiting)} "
                                  "submitted replies were not collected: the connection is "
                                  "out of step")
        self._send_frame(encode_frame(message), timeout_s)
        return self._receive_reply(type(message), max_fds)

    def _send_frame(self, frame: bytes, timeout_s: float | None) -> None:
        """Send request frame(s); a failure other than a refusal leaves the connection
        out of step (`_broken`)."""
        self._set_timeout(self.timeout_s if timeout_s is None else timeout_s)
        try:
            self._send_request(frame)
        except BaseException as exc:
            if not isinstance(exc, DaemonError):
                self._broken = f"{type(exc).__name__}: {exc}"
            raise

    def _receive_reply(self, request_type: type,
                       max_fds: int) -> tuple[msgspec.Struct, list[int]]:
        """Read the reply of a request of `request_type` (sent already)."""
        fds: list[int] = []
        try:
            if max_fds:
                fds = self._recv_header_with_fds(max_fds)
            else:
                self._recv_exactly(self._header)
            (length,) = FRAME_LENGTH.unpack(self._header)
            if length > MAX_FRAME_BYTES:
                raise ConnectionError(f"reply frame of {length} bytes exceeds the limit")
            payload = bytearray(length)
            self._recv_exactly(payload)
            try:
                reply = reply_decoder.decode(payload)
            except (msgspec.MsgspecError, ValueError) as exc:  # ValueError: bad UTF-8
                raise ConnectionError(
                    f"undecodable reply from the daemon ({type(exc).__name__}: {exc})"
                ) from None
            if isinstance(reply, Error):
                raise DaemonError(reply.code, reply.message)
            expected = self.REPLY_TYPES.get(request_type)
            if expected is not None and not isinstance(reply, expected):
                raise ConnectionError(
                    f"the daemon answered {request_type.__name__} with "
                    f"{type(reply).__name__}, expected {expected.__name__}"
                )
        except BaseException as exc:
            for fd in fds:
                os.close(fd)
            if not isinstance(exc, DaemonError):
                self._broken = f"{type(exc).__name__}: {exc}"
            raise
        return reply, fds

    def _send_request(self, frame: bytes) -> None:
        """Send a request frame. When the daemon has closed the connection already (a
        refusal at accept, such as `max_clients`, is an Error frame and a close, often
        before the client writes), the send fails with EPIPE while the Error frame waits
        unread: it is read then, and raised as the DaemonError it is, so that the caller
        learns the daemon's reason instead of an errno.

        Raises:
            DaemonError: the daemon's refusal; the connection is over.
            OSError: the send failed for another reason (no refusal is waiting).
        """
        try:
            self._sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError) as exc:
            refusal = self._waiting_refusal()
            if refusal is None:
                raise
            self._broken = f"{type(exc).__name__}: {exc}"
            raise DaemonError(refusal.code, refusal.message) from None

    def _waiting_refusal(self) -> Error | None:
        """The Error frame the daemon sent before closing, if it waits complete in the
        receive queue (read without blocking); None otherwise."""
        data = bytearray()
        try:
            while len(data) < _MAX_REFUSAL_BYTES:
                chunk = self._sock.recv(_MAX_REFUSAL_BYTES - len(data), socket.MSG_DONTWAIT)
                if not chunk:
                    break
                data += chunk
        except OSError:  # nothing more waits (EAGAIN), or the connection is reset
            pass
        if len(data) < FRAME_LENGTH.size:
            return None
        (length,) = FRAME_LENGTH.unpack_from(data)
        if len(data) < FRAME_LENGTH.size + length:
            return None
        try:
            reply = reply_decoder.decode(data[FRAME_LENGTH.size : FRAME_LENGTH.size + length])
        except (msgspec.MsgspecError, ValueError):
            return None
        return reply if isinstance(reply, Error) else None

    def _recv_header_with_fds(self, max_fds: int) -> list[int]:
        """Receive the reply's length prefix and the descriptors sent with it, made
        close-on-exec by the kernel as every descriptor Python opens is (a child the
        client spawns gets none). Not `socket.recv_fds`: it drops its `flags` argument
        (CPython gh-107898)."""
        fd_bytes = struct.calcsize("i")
        data, ancdata, flags, _ = self._sock.recvmsg(
            FRAME_LENGTH.size, socket.CMSG_LEN(max_fds * fd_bytes), socket.MSG_CMSG_CLOEXEC)
        fds: list[int] = []
        for level, kind, cmsg_data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += struct.unpack(f"{len(cmsg_data) // fd_bytes}i",
                                     cmsg_data[: len(cmsg_data) // fd_bytes * fd_bytes])
        if flags & socket.MSG_CTRUNC or len(fds) > max_fds:
            for fd in fds:
                os.close(fd)
            raise ConnectionError(f"the daemon sent more than {max_fds} file descriptors")
        if not data:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the daemon closed the connection")
        self._header[: len(data)] = data
        if len(data) < FRAME_LENGTH.size:
            try:
                with memoryview(self._header) as view:
                    self._recv_exactly(view[len(data):])
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        return fds

    def send(self, message: msgspec.Struct, timeout_s: float | None = None) -> None:
        """Send a request the daemon does not answer (NO_REPLY_REQUESTS), without waiting.

        Args:
            message: a NO_REPLY_REQUESTS Struct.
            timeout_s: how long the send may wait for room in the socket, seconds
                (None: the connection's `timeout_s`).

        Raises:
            ValueError: `message` is a request that has a reply (use `request`), or it
                exceeds MAX_FRAME_BYTES; nothing was sent.
            TimeoutError, ConnectionError: the send failed; the connection is then
                unusable (a part of the frame may have been sent).
        """
        if type(message) not in NO_REPLY_REQUESTS:
            raise ValueError(f"{type(message).__name__} has a reply: use request()")
        if self._broken is not None:
            raise ConnectionError(
                f"connection to {self.socket_path} is out of step after an earlier failure "
                f"({self._broken}): open a new Connection"
            )
        frame = encode_frame(message)
        self._set_timeout(self.timeout_s if timeout_s is None else timeout_s)
        try:
            self._sock.sendall(frame)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise

    def _set_timeout(self, timeout_s: float) -> None:
        if timeout_s != self._sock_timeout_s:  # settimeout costs a syscall: only on change
            self._sock.settimeout(timeout_s)
            self._sock_timeout_s = timeout_s

    def _recv_exactly(self, buf: bytearray) -> None:
        view = memoryview(buf)
        while view:
            n = self._sock.recv_into(view)
            if n == 0:
                raise ConnectionResetError("the daemon closed the connection")
            view = view[n:]

    def close(self) -> None:
        """Close the socket (the daemon then releases this session's pins)."""
        self._sock.close()

    def peer_pid(self) -> int:
        """The daemon's process id, as the kernel saw it connect (SO_PEERCRED)."""
        creds = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        return _UCRED.unpack(creds)[0]

    def peer_closed(self) -> bool:
        """Whether this connection is over: closed here, or by the daemon, with no wait.

        One poll(2) with a zero timeout for POLLHUP / POLLRDHUP / POLLERR, so it never
        reads a byte (a reply another thread waits for stays where it is). The daemon
        closes a session's socket before it releases that session's pins, in one loop
        pass (lmcached/daemon/server.py `_close`), so False after reading pinned blocks means
        the pins held while they were read.
        """
        fd = self._sock.fileno()
        if fd < 0:
            return True
        poller = select.poll()
        poller.register(fd, select.POLLRDHUP)
        return any(events & _PEER_GONE_EVENTS for _, events in poller.poll(0))

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def list_clients(conn: Connection) -> list[dict[str, int | float | str]]:
    """Every session's CLIENTS row, paging through the cursor (`Clients`).

    Raises:
        As `Connection.request`.
    """
    rows, cursor = [], 0
    while True:
        reply = conn.request(Clients(cursor))
        rows.extend(reply.clients)
        if not reply.cursor:
            return rows
        cursor = reply.cursor


def hello(conn: Connection, name: str, layouts: list[Layout] | tuple[Layout, ...] = (),
          devices: list[str] | tuple[str, ...] = ()) -> HelloReply:
    """Open a session on `conn` with one namespace per layout and the device tiers of
    `devices` (see `Hello`)."""
    return conn.request(Hello(PROTOCOL_VERSION, os.getpid(), name, list(layouts),
                              list(devices)))
