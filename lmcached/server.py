"""The daemon's event loop: one thread, `selectors` over non-blocking Unix sockets.

Why this file exists: it moves frames between sockets and `CacheService` and owns the
process life cycle (start-up sweep, arena prefault, READY, signals, graceful stop).
No asyncio: measured here, a selectors loop answers in ~33 us where asyncio takes
56-160 us (../shared/limits/RESULTS.md).

Life cycle::

    sweep orphans of <name> -> refuse if a daemon answers on the socket -> create and
    prefault the arena (progress) -> listen -> READY=1 -> serve -> SIGTERM/SIGINT or
    SHUTDOWN -> STOPPING=1 -> close clients, unlink socket and arena -> exit 0
"""

import errno
import grp
import os
import pwd
import selectors
import signal
import socket
import struct
import sys
import time

from lmcached.config import ServerConfig, format_bytes, load_config
from lmcached.logger import configure_logging, init_logger
from lmcached.notify import SystemdNotifier
from lmcached.protocol import MAX_FRAME_BYTES, Clients, Info, encode_frame, request_decoder
from lmcached.service import CacheService
from lmcached.session import Session
from lmcached.shm.arena import Arena, sweep_orphans

logger = init_logger(__name__)

RECV_BYTES = 256 * 1024
_UCRED = struct.Struct("3i")  # pid, uid, gid
_MAX_SUN_PATH = 107

# Limits of one connection, after Redis (`client-query-buffer-limit`,
# `client-output-buffer-limit`). The total over every connection is the configured
# `buffer_budget_bytes`.
READ_AHEAD_BYTES = 64 * 1024  # stop reading while this much of complete frames waits
OUTBUF_PAUSE_BYTES = 1 << 20  # stop serving a client while this much of replies is unsent
MAX_OUTBUF_BYTES = 16 << 20  # a client that stops reading its replies is dropped
# Bounded work per client per loop pass (round robin): a request costs 1, except those
# cheap to send and costly to serve.
PASS_BUDGET = 32
REQUEST_COST = {Info: 8, Clients: 16}
PARTIAL_FRAME_TIMEOUT_S = 5.0  # an unfinished frame older than this closes its connection
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that sent no complete frame by then is closed
HOUSEKEEPING_INTERVAL_S = 1.0
ACCEPT_BATCH = 64  # connections accepted per loop pass at most
ACCEPT_BACKOFF_S = 0.1  # no accept() for this long after EMFILE / ENFILE
LOG_INTERVAL_S = 10.0  # a repeated warning is logged at most once per interval


class ClientConnection:
    """A connected client: its socket, session, buffers and loop bookkeeping.

    `inbuf[inpos:]` holds received bytes not yet served; frames are decoded in place
    from a memoryview and the served prefix is dropped once per loop pass.
    """

    __slots__ = ("sock", "session", "inbuf", "inpos", "outbuf", "closed", "eof", "events",
                 "connected_at", "partial_since", "served_frames")

    def __init__(self, sock: socket.socket, session: Session) -> None:
        self.sock = sock
        self.session = session
        self.inbuf = bytearray()
        self.inpos = 0
        self.outbuf = bytearray()
        self.closed = False
        self.eof = False  # the client shut down its side: serve what it sent, then close
        self.events = selectors.EVENT_READ  # what the selector watches for it now
        self.connected_at = time.monotonic()
        self.partial_since: float | None = None  # when an unfinished frame began to wait
        self.served_frames = 0

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


def answer_frame(service: CacheService, session: Session, payload) -> tuple[bytes, int]:
    """Decode one request, answer it, and encode the reply frame. Never raises.

    Args:
        service: the daemon's request semantics.
        session: the session the frame arrived on.
        payload: the frame's msgpack bytes (any buffer; not kept).

    Returns:
        (reply frame, cost of the request in PASS_BUDGET units). The reply is the
        handler's, or `bad_request` for a payload that does not decode to a valid request
        (any exception of the decoder: msgspec's errors, but also e.g. UnicodeDecodeError
        for a str of invalid UTF-8), `internal` when a handler or the encoder fails
        (logged with its traceback), or `too_large` for a reply above the frame limit.
    """
    try:
        request = request_decoder.decode(payload)
    except Exception as exc:  # noqa: BLE001 - no frame may reach the loop as an exception
        reply, cost = service.error("bad_request", f"undecodable request: {exc!r}"), 1
    else:
        reply, cost = service.handle(session, request), REQUEST_COST.get(type(request), 1)
    try:
        return encode_frame(reply), cost
    except ValueError as exc:
        return encode_frame(service.error("too_large", str(exc))), cost
    except Exception:  # noqa: BLE001 - a reply the encoder rejects is a daemon bug
        logger.exception("cannot encode the reply %r", reply)
        return encode_frame(service.error("internal", "internal error in the daemon (see its log)")), cost


class _RateLimitedLog:
    """Logs a repeated condition at most once per LOG_INTERVAL_S, with a repeat count."""

    def __init__(self) -> None:
        self.next_at = 0.0
        self.suppressed = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.suppressed += 1
            return
        if self.suppressed:
            message += " (%d more since the last report)"
            args = (*args, self.suppressed)
        logger.warning(message, *args)
        self.suppressed = 0
        self.next_at = now + LOG_INTERVAL_S


class Server:
    """One lmcached daemon.

    Args:
        config: effective configuration (see `lmcached.config.load_config`).

    Raises (from `start`):
        RuntimeError: another daemon answers on the socket, or the socket path is bad.
        OSError: the arena cannot be created (e.g. /dev/shm full).
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.notifier = SystemdNotifier()
        self.arena: Arena | None = None
        self.service: CacheService | None = None
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wakeup_r: socket.socket | None = None
        self._wakeup_w: socket.socket | None = None
        self._connections: dict[int, ClientConnection] = {}
        self._stop_signal: int | None = None
        self._reload_requested = False
        self._allowed_gid: int | None = None
        self._old_handlers: dict[int, object] = {}
        # One receive buffer for every connection: sock.recv(RECV_BYTES) would allocate
        # (mmap, mremap, munmap: 3 syscalls) a fresh 256 KiB bytes object per request.
        self._recv_buf = bytearray(RECV_BYTES)
        self._recv_view = memoryview(self._recv_buf)
        self._ready: dict[ClientConnection, None] = {}  # complete frames waiting, in order
        self._silent: dict[ClientConnection, None] = {}  # no request yet, oldest first
        self._buffered_bytes = 0  # input + output buffers of every connection
        self._accept_paused_until = 0.0
        self._accept_log = _RateLimitedLog()
        self._drop_log = _RateLimitedLog()

    # ----------------------------------------------------------------- start-up
    def start(self) -> None:
        """Sweep, create and prefault the arena, listen, then notify READY."""
        cfg = self.config
        if cfg.allow_group:
            try:
                self._allowed_gid = grp.getgrnam(cfg.allow_group).gr_gid
            except KeyError:
                raise RuntimeError(f"--allow-group: no group named {cfg.allow_group!r}") from None
        self._check_socket_free(cfg.socket)
        removed = sweep_orphans(cfg.name)
        if removed:
            logger.warning("removed %d orphaned segment(s) of dead daemons: %s", len(removed), removed)
        self.notifier.notify(f"STATUS=prefaulting {format_bytes(cfg.capacity_bytes)} arena")
        started = time.monotonic()
        self.arena = Arena.create(
            cfg.name,
            cfg.capacity_bytes,
            cfg.block_bytes,
            mode=cfg.shm_mode,
            prefault=cfg.prefault,
            progress=_PrefaultProgress(cfg.capacity_bytes),
        )
        try:
            elapsed = time.monotonic() - started
            logger.info(
                "arena %s ready: %s in %.2f s (%.2f GB/s prefault)",
                self.arena.segment_name, format_bytes(cfg.capacity_bytes), elapsed,
                cfg.capacity_bytes / max(elapsed, 1e-9) / 1e9,
            )
            self.service = CacheService(cfg, self.arena)
            self._listen(cfg.socket)
            self._install_signals()
        except BaseException:
            self._teardown()
            raise
        self.notifier.notify("READY=1", f"STATUS=serving on {cfg.socket}", f"MAINPID={os.getpid()}")
        logger.info("lmcached %s listening on %s (pid %d)", cfg.name, cfg.socket, os.getpid())

    @staticmethod
    def _check_socket_free(path: str) -> None:
        if len(path.encode()) > _MAX_SUN_PATH:
            raise RuntimeError(f"socket path is longer than {_MAX_SUN_PATH} bytes: {path}")
        if not os.path.exists(path):
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: its daemon is gone
            logger.info("removed stale socket %s", path)
        else:
            raise RuntimeError(f"another lmcached daemon is listening on {path}")
        finally:
            probe.close()

    def _listen(self, path: str) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o750 if self._allowed_gid is not None else 0o700)
            if self._allowed_gid is not None:
                os.chown(directory, -1, self._allowed_gid)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177 if self._allowed_gid is None else 0o117)
        try:
            listener.bind(path)
        finally:
            os.umask(old_umask)
        if self._allowed_gid is not None:
            os.chown(path, -1, self._allowed_gid)
            os.chmod(path, 0o660)
        else:
            os.chmod(path, 0o600)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "listener")
        self._wakeup_r, self._wakeup_w = socket.socketpair()
        self._wakeup_r.setblocking(False)
        self._wakeup_w.setblocking(False)
        self._selector.register(self._wakeup_r, selectors.EVENT_READ, "wakeup")

    def _install_signals(self) -> None:
        signal.set_wakeup_fd(self._wakeup_w.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[signum] = signal.signal(signum, self._on_stop_signal)
        self._old_handlers[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hup)

    def _on_stop_signal(self, signum, frame) -> None:
        self._stop_signal = signum

    def _on_hup(self, signum, frame) -> None:
        self._reload_requested = True

    # --------------------------------------------------------------------- loop
    def serve_forever(self) -> None:
        """Serve until SIGTERM/SIGINT or SHUTDOWN, then stop gracefully.

        One loop pass: wait for sockets (not at all while some client has complete
        frames waiting), accept, read what arrived, then serve every client with waiting
        frames up to PASS_BUDGET (round robin), and once a second drop connections that
        overstayed a timeout.
        """
        watchdog_s = self.notifier.watchdog_interval_s
        next_watchdog = time.monotonic()
        next_housekeeping = time.monotonic() + HOUSEKEEPING_INTERVAL_S
        service = self.service
        try:
            while self._stop_signal is None and not service.stop_requested:
                now = time.monotonic()
                if watchdog_s is not None and now >= next_watchdog:
                    self.notifier.notify("WATCHDOG=1")
                    next_watchdog = now + watchdog_s
                if now >= next_housekeeping:
                    self._housekeeping(now)
                    next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
                if self._accept_paused_until and now >= self._accept_paused_until:
                    self._resume_accept()
                if self._ready:
                    timeout = 0.0
                else:
                    wake_at = [next_housekeeping] if self._connections else []
                    if watchdog_s is not None:
                        wake_at.append(next_watchdog)
                    if self._accept_paused_until:
                        wake_at.append(self._accept_paused_until)
                    timeout = max(0.0, min(wake_at) - now) if wake_at else None
                for key, mask in self._selector.select(timeout):
                    data = key.data
                    if data == "listener":
                        self._accept()
                    elif data == "wakeup":
                        self._drain_wakeup()
                    else:
                        if mask & selectors.EVENT_WRITE:
                            self._flush(data)
                        if mask & selectors.EVENT_READ and not data.closed:
                            self._on_readable(data)
                for conn in list(self._ready):
                    self._serve(conn)
            if self._stop_signal is not None:
                logger.info("received %s: stopping", signal.Signals(self._stop_signal).name)
        finally:
            self._teardown()

    def _drain_wakeup(self) -> None:
        try:
            while self._wakeup_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        if self._reload_requested:
            self._reload_requested = False
            self._reload()

    def _reload(self) -> None:
        """SIGHUP: re-read the log level from the environment and the config file."""
        try:
            fresh = load_config(
                {**self.config.cli_options, "capacity": self.config.capacity_bytes},
                self.config.config_file,
                check_shm_free=False,  # our own arena already takes that space
            )
        except (ValueError, OSError) as exc:
            logger.error("SIGHUP: config not reloaded: %s", exc)
            return
        configure_logging(fresh.log_level)
        self.config.log_level = fresh.log_level
        logger.info("SIGHUP: log level is %s", fresh.log_level)

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
        """At max_clients: close the oldest connection that never sent a complete frame,
        so that idle connections cannot lock real clients out. False if there is none."""
        oldest = next(iter(self._silent), None)
        if oldest is None:
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
        if uid in (0, os.getuid()):
            return True
        if self._allowed_gid is None:
            return False
        if gid == self._allowed_gid:
            return True
        try:
            user = pwd.getpwuid(uid).pw_name
            return self._allowed_gid in os.getgrouplist(user, gid)
        except KeyError:
            return False

    def _on_readable(self, conn: ClientConnection) -> None:
        try:
            num_bytes = conn.sock.recv_into(self._recv_buf)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        if not num_bytes:  # EOF: the client closed or died; answer what it sent first
            if conn.next_frame_end() == 0:
                self._close(conn)
            else:
                conn.eof = True
                self._update_events(conn)
            return
        conn.inbuf += self._recv_view[:num_bytes]
        self._buffered_bytes += num_bytes
        if self._buffered_bytes > self.config.buffer_budget_bytes:
            self._enforce_buffer_budget()
            if conn.closed:
                return
        self._ready[conn] = None

    def _serve(self, conn: ClientConnection) -> None:
        """Answer up to PASS_BUDGET of `conn`'s waiting frames, in order, then update
        what the selector watches for it."""
        if conn.closed:  # dropped earlier in this pass (e.g. over the buffer budget)
            return
        service, session = self.service, conn.session
        replies = []
        budget = PASS_BUDGET
        with memoryview(conn.inbuf) as view:
            while budget > 0 and len(conn.outbuf) < OUTBUF_PAUSE_BYTES:
                end = conn.next_frame_end()
                if end == 0:
                    break
                if end < 0:
                    length = int.from_bytes(view[conn.inpos : conn.inpos + 4], "little")
                    view.release()
                    self._drop(conn, "frame_too_large",
                               f"sent a {length}-byte frame (limit {MAX_FRAME_BYTES})")
                    return
                with view[conn.inpos + 4 : end] as payload:
                    frame, cost = answer_frame(service, session, payload)
                replies.append(frame)
                conn.inpos = end
                conn.served_frames += 1
                budget -= cost
        if conn.served_frames:
            self._silent.pop(conn, None)
        if conn.inpos:
            del conn.inbuf[: conn.inpos]
            self._buffered_bytes -= conn.inpos
            conn.inpos = 0
        if replies:
            self._send(conn, replies[0] if len(replies) == 1 else b"".join(replies))
            if conn.closed:
                return
        has_frame = conn.next_frame_end() != 0
        conn.partial_since = (
            None if has_frame or not conn.inbuf else (conn.partial_since or time.monotonic())
        )
        if not has_frame or len(conn.outbuf) >= OUTBUF_PAUSE_BYTES:
            self._ready.pop(conn, None)
        if conn.eof and not has_frame and not conn.outbuf:
            self._close(conn)
            return
        self._update_events(conn)

    def _update_events(self, conn: ClientConnection) -> None:
        """Watch for input only while the client has room (few frames waiting, replies
        flowing): a client that pipelines without reading is throttled by its own socket,
        not by the daemon's memory. Watch for output while replies are unsent."""
        unread = len(conn.inbuf) - conn.inpos
        want_read = not conn.eof and len(conn.outbuf) < OUTBUF_PAUSE_BYTES and (
            unread < READ_AHEAD_BYTES or conn.next_frame_end() == 0
        )
        events = (selectors.EVENT_READ if want_read else 0) | (
            selectors.EVENT_WRITE if conn.outbuf else 0
        )
        if events == conn.events:
            return
        if not events:
            self._selector.unregister(conn.sock)
        elif not conn.events:
            self._selector.register(conn.sock, events, conn)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    def _send(self, conn: ClientConnection, data: bytes) -> None:
        if not conn.outbuf:
            try:
                sent = conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
        conn.outbuf += data
        self._buffered_bytes += len(data)
        if len(conn.outbuf) > MAX_OUTBUF_BYTES:
            self._drop(conn, "output_buffer", "does not read its replies")
        elif self._buffered_bytes > self.config.buffer_budget_bytes:
            self._enforce_buffer_budget()

    def _flush(self, conn: ClientConnection) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        del conn.outbuf[:sent]
        self._buffered_bytes -= sent
        has_frame = conn.next_frame_end() != 0
        if len(conn.outbuf) < OUTBUF_PAUSE_BYTES and has_frame:
            self._ready[conn] = None
        if conn.eof and not has_frame and not conn.outbuf:
            self._close(conn)
            return
        self._update_events(conn)

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
        longer than their timeout (Redis: `timeout`)."""
        idle_timeout_s = self.config.idle_timeout_s
        for conn in list(self._connections.values()):
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

    def _close(self, conn: ClientConnection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._connections.pop(conn.sock.fileno(), None)
        self._ready.pop(conn, None)
        self._silent.pop(conn, None)
        self._buffered_bytes -= conn.buffered_bytes
        conn.inbuf = conn.outbuf = bytearray()
        if conn.events:
            self._selector.unregister(conn.sock)
            conn.events = 0
        conn.sock.close()
        self.service.close_session(conn.session)

    # ----------------------------------------------------------------- teardown
    def _teardown(self) -> None:
        """Close clients, unlink the socket and the arena. Idempotent."""
        self.notifier.notify("STOPPING=1", "STATUS=stopping")
        for conn in list(self._connections.values()):
            self._close(conn)
        if self._listener is not None:
            if not self._accept_paused_until:
                self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.config.socket)
            except FileNotFoundError:
                pass
        if self._wakeup_r is not None:
            signal.set_wakeup_fd(-1)
            for signum, handler in self._old_handlers.items():
                signal.signal(signum, handler)
            self._old_handlers.clear()
            self._selector.unregister(self._wakeup_r)
            self._wakeup_r.close()
            self._wakeup_w.close()
            self._wakeup_r = self._wakeup_w = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.notifier.close()


class _PrefaultProgress:
    """Prefault progress: a bar on a terminal, else a log line every ~10%."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.tty = sys.stderr.isatty()
        self.next_pct = 10
        self.started = time.monotonic()

    def __call__(self, done_bytes: int, total_bytes: int) -> None:
        pct = 100 * done_bytes // total_bytes
        if self.tty:
            filled = pct * 30 // 100
            sys.stderr.write(
                f"\rprefaulting arena [{'#' * filled}{' ' * (30 - filled)}] {pct:3d}% "
                f"{format_bytes(done_bytes)}/{format_bytes(total_bytes)}"
            )
            if done_bytes >= total_bytes:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif pct >= self.next_pct:
            logger.info(
                "prefaulting arena: %d%% (%s of %s, %.1f s)", pct, format_bytes(done_bytes),
                format_bytes(total_bytes), time.monotonic() - self.started,
            )
            self.next_pct = (pct // 10 + 1) * 10


def run_server(config: ServerConfig) -> int:
    """Run a daemon in this process until it is stopped. Returns the exit status."""
    server = Server(config)
    try:
        server.start()
    except (RuntimeError, ValueError, OSError) as exc:
        logger.error("cannot start: %s", exc)
        return 1
    server.serve_forever()
    logger.info("stopped")
    return 0
