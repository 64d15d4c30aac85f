"""One client connection of the daemon: its buffers, frame parsing and limits.

Why this file exists: it is the part of the event loop (`server.py`) that every byte a
client sends goes through, so that its rules can be read and tested in one place:
frames are parsed in place from the connection's buffer, any payload becomes exactly one
reply, or none for a RELEASE or INVALIDATE (`answer_frame` never raises), and the limits after Redis
(`client-query-buffer-limit`, `client-output-buffer-limit`, `timeout`, `maxclients`)
are constants here.
"""

import selectors
import socket
import time

import msgspec

from lmcached.wire.logger import init_logger
from lmcached.wire.frames import encode_frame, request_decoder
from lmcached.wire.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION
from lmcached.daemon.commands import COMMAND_TABLE
from lmcached.daemon.replies import Deferred
from lmcached.daemon.service import CacheService
from lmcached.daemon.session import Session

logger = init_logger(__name__)

# Limits of one connection, after Redis (`client-query-buffer-limit`,
# `client-output-buffer-limit`). The total over every connection is the configured
# `buffer_budget_bytes`.
READ_AHEAD_BYTES = 64 * 1024  # stop reading while this much of complete frames waits
OUTBUF_PAUSE_BYTES = 1 << 20  # stop serving a client while this much of replies is unsent
MAX_OUTBUF_BYTES = 16 << 20  # a client that stops reading its replies is dropped
# Bounded work per client per loop pass (round robin): a request costs its command's
# `cost` (commands.py: 1, more for those cheap to send and costly to serve, INFO), or
# what its handler priced it by the work it did (`CacheService.work_units`: SCAN, CLIENTS).
PASS_BUDGET = 32
PARTIAL_FRAME_TIMEOUT_S = 5.0  # an unfinished frame older than this closes its connection
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that sent no complete frame by then is closed
SILENT_GRACE_S = 1.0  # at max_clients, a connection silent this long may make room
HOUSEKEEPING_INTERVAL_S = 1.0
ACCEPT_BATCH = 64  # connections accepted per loop pass at most
ACCEPT_BACKOFF_S = 0.1  # no accept() for this long after EMFILE / ENFILE


class ClientConnection:
    """A connected client: its socket, session, buffers and loop bookkeeping.

    `inbuf[inpos:]` holds received bytes not yet served; frames are decoded in place
    from a memoryview and the served prefix is dropped once per loop pass.
    """

    __slots__ = ("sock", "session", "inbuf", "inpos", "outbuf", "fd_marks", "closed", "eof",
                 "events", "connected_at", "partial_since", "served_frames", "parked")

    def __init__(self, sock: socket.socket, session: Session) -> None:
        self.sock = sock
        self.session = session
        self.inbuf = bytearray()
        self.inpos = 0
        self.outbuf = bytearray()
        # [offset in outbuf, fds]: a reply whose first byte must carry these descriptors
        # (SCM_RIGHTS; OPEN_TIER). Offsets move down as outbuf is sent.
        self.fd_marks: list[list] = []
        self.closed = False
        self.eof = False  # the client shut down its side: serve what it sent, then close
        self.events = selectors.EVENT_READ  # what the selector watches for it now
        self.connected_at = time.monotonic()
        self.partial_since: float | None = None  # when an unfinished frame began to wait
        self.served_frames = 0
        self.parked: Deferred | None = None  # a request waiting for an L2 fetch

    @property
    def buffered_bytes(self) -> int:
        """Bytes this connection holds in the daemon's memory (input and output)."""
        return len(self.inbuf) + len(self.outbuf)

    def next_frame_end(self) -> int:
        """End offset of the next complete frame in `inbuf`, 0 if none is complete,
        or -1 if its declared length exceeds MAX_FRAME_BYTES."""
        start = self.inpos
        if len(self.inbuf) - start < 4:
            return 0
        length = int.from_bytes(self.inbuf[start : start + 4], "little")
        if length > MAX_FRAME_BYTES:
            return -1
        end = start + 4 + length
        return end if end <= len(self.inbuf) else 0


def answer_frame(service: CacheService, session: Session,
                 payload) -> tuple[bytes | Deferred | None, int]:
    """Decode one request, answer it, and encode the reply frame. Never raises.

    Args:
        service: the daemon's request semantics.
        session: the session the frame arrived on.
        payload: the frame's msgpack bytes (any buffer; not kept).

    Returns:
        (reply frame, cost of the request in PASS_BUDGET units: the service's
        `work_units`, 1 for an undecodable payload). The reply is the handler's, None for a
        request that has no reply (RELEASE, INVALIDATE), `version` for a
        HELLO of another protocol version, `bad_request` for a payload that does not
        decode to a valid request (any exception of the decoder: msgspec's errors, but
        also e.g. UnicodeDecodeError for a str of invalid UTF-8), `internal` when a
        handler or the encoder fails (logged with its traceback), or `too_large` for a
        reply above the frame limit. A `Deferred` instead of a frame for a LOOKUP /
        ACQUIRE that waits for an L2 fetch: the server parks the connection and encodes
        `service.resume`'s reply later with `encode_reply`.
    """
    try:
        request = request_decoder.decode(payload)
    except Exception as exc:  # noqa: BLE001 - no frame may reach the loop as an exception
        reply, cost = _undecodable(service, payload, exc), 1
        if reply is None:
            return None, cost
    else:
        reply = service.handle(session, request)
        cost = service.work_units
        if reply is None or type(reply) is Deferred:
            return reply, cost
    return encode_reply(service, session, reply), cost


def encode_reply(service: CacheService, session: Session, reply) -> bytes:
    """The frame of a reply Struct: `too_large` (and what it handed out withdrawn) when
    it exceeds the frame limit, `internal` when the encoder fails. Never raises."""
    try:
        return encode_frame(reply)
    except ValueError as exc:
        service.withdraw(session, reply)  # its lease or blocks would be held for nothing
        return encode_frame(service.error("too_large", str(exc)))
    except Exception:  # noqa: BLE001 - a reply the encoder rejects is a daemon bug
        logger.exception("cannot encode the reply %r", reply)
        return encode_frame(service.error("internal", "internal error in the daemon (see its log)"))


# Tags of the requests that get no reply (RELEASE, INVALIDATE), even when malformed.
_NO_REPLY_TAGS = frozenset(command.name for command in COMMAND_TABLE if not command.replies)


def _undecodable(service: CacheService, payload, exc: Exception):
    """The Error for a payload that is not a valid request: `version` when it is a HELLO
    of another protocol version (whose fields may differ), None (counted, no reply: its
    sender reads none) for a malformed RELEASE or INVALIDATE, else `bad_request`."""
    try:
        message = msgspec.msgpack.decode(payload)
    except Exception:  # noqa: BLE001 - not even msgpack
        message = None
    if (isinstance(message, list) and message and isinstance(message[0], str)
            and message[0] in _NO_REPLY_TAGS):
        service.error("bad_request", f"undecodable {message[0].upper()}: {exc!r}")
        return None
    if (isinstance(message, list) and len(message) > 1 and message[0] == "hello"
            and isinstance(message[1], int) and message[1] != PROTOCOL_VERSION):
        return service.error(
            "version", f"protocol version {message[1]}; this daemon speaks {PROTOCOL_VERSION}: "
            "use an lmcached client of the daemon's version"
        )
    return service.error("bad_request", f"undecodable request: {exc!r}")

