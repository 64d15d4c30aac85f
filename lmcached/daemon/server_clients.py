"""Which connections the daemon keeps: accept, authorize, limits, timeouts, drops.

Why this file exists: admitting a connection (SO_PEERCRED, --allow-group, max_clients,
shedding silent ones, pausing accept when out of descriptors) and dropping one (buffer
budget, timeouts, EOF) is the daemon's defence against hostile or broken clients,
apart from how bytes move (`server_io.py`) and the life cycle (`server.py`).
`ClientAccounting` is a part of `Server`: its state is the server's.
"""

import errno
import os
import selectors
import socket
import struct
import time

from lmcached.wire.logger import init_logger
from lmcached.daemon.connection import (
    ACCEPT_BACKOFF_S,
    ACCEPT_BATCH,
    HANDSHAKE_TIMEOUT_S,
    PARTIAL_FRAME_TIMEOUT_S,
    SILENT_GRACE_S,
    ClientConnection,
)
from lmcached.daemon.peers import is_member
from lmcached.wire.frames import encode_frame
from lmcached.wire.units import format_bytes

logger = init_logger(__name__)

_UCRED = struct.Struct("3i")  # pid, uid, gid


class ClientAccounting:
    """Admitting, limiting and dropping connections for `Server` (a part of it)."""

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):  # bounded work per pass; the listener stays readable
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if exc.errno == errno.EMFILE and self._shed_silent():
                        continue  # one descriptor is free again
                    self._pause_accept(exc)
                else:
                    self._accept_log.warning("accept failed: %s", exc)
                return
            try:
                pid, uid, gid = _UCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                )
            except OSError:  # the peer is already gone
                sock.close()
                continue
            if not self._authorized(uid, gid):
                logger.warning("refused connection from pid %d uid %d gid %d", pid, uid, gid)
                self.service.error("unauthorized", f"uid {uid}")
                sock.close()
                continue
            if len(self._connections) >= self.config.max_clients and not self._shed_silent():
                self._refuse(sock, "max_clients", f"max number of clients reached "
                             f"({self.config.max_clients}; see --max-clients)")
                continue
            sock.setblocking(False)
            conn = ClientConnection(sock, self.service.open_session(pid, uid, gid))
            self._connections[sock.fileno()] = conn
            self._silent[conn] = None
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _pause_accept(self, exc: OSError) -> None:
        """Out of file descriptors: stop accepting for ACCEPT_BACKOFF_S (never spin)."""
        self._accept_log.warning(
            "accept failed: %s: not accepting for %.0f ms (%d clients; raise LimitNOFILE or "
            "lower --max-clients)", exc, ACCEPT_BACKOFF_S * 1000, len(self._connections),
        )
        self.service.error("accept_" + (errno.errorcode.get(exc.errno) or "error").lower(), str(exc))
        self._selector.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF_S

    def _resume_accept(self) -> None:
        self._accept_paused_until = 0.0
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")

    def _shed_silent(self) -> bool:
        """At max_clients or out of descriptors: close the oldest connection that never
        sent a complete frame and is older than SILENT_GRACE_S (a real client sends HELLO
        at once), so that idle connections cannot lock real clients out. False if there
        is none."""
        oldest = next(iter(self._silent), None)
        if oldest is None or time.monotonic() - oldest.connected_at < SILENT_GRACE_S:
            return False
        self._drop(oldest, "max_clients_silent_dropped",
                   "at max_clients: dropped the oldest connection that never sent a request")
        return True

    def _refuse(self, sock: socket.socket, code: str, message: str) -> None:
        """Answer a connection we do not take with one Error frame (best effort), close it."""
        self._accept_log.warning("refused a connection: %s", message)
        try:
            sock.setblocking(False)
            sock.send(encode_frame(self.service.error(code, message)))
        except OSError:
            pass
        sock.close()

    def _authorized(self, uid: int, gid: int) -> bool:
        """May a peer (SO_PEERCRED) connect: root, the daemon's uid, and with
        --allow-group a member of that group (its primary gid or the group database)."""
        if uid in (0, os.geteuid()):
            return True
        return self._allowed_gid is not None and is_member(uid, gid, self._allowed_gid)

    def _enforce_buffer_budget(self) -> None:
        """Over the total buffer budget: drop the clients holding the most bytes."""
        budget = self.config.buffer_budget_bytes
        while self._buffered_bytes > budget and self._connections:
            victim = max(self._connections.values(), key=lambda c: c.buffered_bytes)
            self._drop(victim, "buffer_budget", f"holds {format_bytes(victim.buffered_bytes)} of "
                       f"buffers; all clients together exceed --buffer-budget "
                       f"{format_bytes(budget)}")

    def _housekeeping(self, now: float) -> None:
        """Drop connections with an unfinished frame, no first request, or no request for
        longer than their timeout (Redis: `timeout`); start demotions a device tier
        needs."""
        self.service.housekeeping()
        idle_timeout_s = self.config.idle_timeout_s
        for conn in list(self._connections.values()):
            if conn.parked is not None:  # waits for the daemon (an L2 fetch), not the client
                continue
            if conn.partial_since is not None and now - conn.partial_since > PARTIAL_FRAME_TIMEOUT_S:
                self._drop(conn, "partial_frame_timeout",
                           f"left a frame unfinished for more than {PARTIAL_FRAME_TIMEOUT_S:.0f} s")
            elif not conn.served_frames and now - conn.connected_at > HANDSHAKE_TIMEOUT_S:
                self._drop(conn, "handshake_timeout",
                           f"sent no request within {HANDSHAKE_TIMEOUT_S:.0f} s")
            elif idle_timeout_s and now - conn.session.last_request_at > idle_timeout_s:
                self._drop(conn, "idle_timeout", f"idle for more than {idle_timeout_s:g} s "
                           "(--idle-timeout)")

    def _drop(self, conn: ClientConnection, code: str, why: str) -> None:
        """Close a connection the daemon refuses to keep; counted as errors_<code>."""
        self.service.error(code, why)
        self._drop_log.warning("closing session %d (pid %d): %s",
                               conn.session.session_id, conn.session.pid, why)
        self._close(conn)

    def _close_at_eof(self, conn: ClientConnection) -> None:
        """Close a client that shut down its side once it is served; a frame it left
        unfinished is counted as errors_truncated_frame (its request was never seen)."""
        if len(conn.inbuf) > conn.inpos:
            self.service.error("truncated_frame", f"EOF after {len(conn.inbuf) - conn.inpos} "
                               "bytes of an unfinished frame")
        self._close(conn)

    def _close(self, conn: ClientConnection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._connections.pop(conn.sock.fileno(), None)
        self._ready.pop(conn, None)
        self._silent.pop(conn, None)
        self._parked.pop(conn, None)
        conn.parked = None
        self._buffered_bytes -= conn.buffered_bytes
        conn.inbuf = conn.outbuf = bytearray()
        if conn.events:
            self._selector.unregister(conn.sock)
            conn.events = 0
        conn.sock.close()
        self.service.close_session(conn.session)
