"""The daemon's event loop: one thread, `selectors` over non-blocking Unix sockets.

Why this file exists: it moves frames between sockets and `CacheService` and owns the
process life cycle (signals, READY, graceful stop); the start-up steps before it serves
are in `startup.py`. No asyncio: a selectors loop answers a round trip several times
faster than asyncio (docs/architecture.md, "Performance rules").

Life cycle::

    catch SIGTERM/SIGINT/SIGHUP -> start-up steps (startup.py: socket directory, metrics
    port, the name's lock, sweep, create and prefault the arena) -> listen -> READY=1 ->
    serve -> SIGTERM/SIGINT or SHUTDOWN -> STOPPING=1 -> close clients, unlink socket
    and arena, drop the name's lock -> exit 0

Whatever stops the start-up is one `StartupError` whose message says why and what to do;
the CLI prints it as one `Error: ...` line and exits with status 1. A stop signal during
the start-up stops it cleanly (exit 0, nothing left in /dev/shm).
"""

import errno
import os
import pwd
import selectors
import signal
import socket
import struct
import time

from lmcached.daemon.server_config import ServerConfig
from lmcached.wire.logger import configure_logging, init_logger
from lmcached.daemon.notify import SystemdNotifier
from lmcached.daemon.connection import (
    ACCEPT_BACKOFF_S,
    ACCEPT_BATCH,
    HANDSHAKE_TIMEOUT_S,
    HOUSEKEEPING_INTERVAL_S,
    MAX_OUTBUF_BYTES,
    OUTBUF_PAUSE_BYTES,
    PARTIAL_FRAME_TIMEOUT_S,
    PASS_BUDGET,
    READ_AHEAD_BYTES,
    SILENT_GRACE_S,
    ClientConnection,
    RateLimitedLog,
    answer_frame,
    encode_reply,
)
from lmcached.daemon.metrics import MetricsExporter, take_snapshot
from lmcached.wire.frames import encode_frame
from lmcached.wire.protocol import MAX_FRAME_BYTES
from lmcached.daemon.service import CacheService, Deferred
from lmcached.shm.arena import Arena
from lmcached.shm.janitor import NameLock
from lmcached.wire.units import format_bytes
from lmcached.daemon.startup import (
    StartupError,
    StartupInterrupted,
    claim_name,
    create_arena,
    create_l2_tier,
    prepare_socket,
    raise_fd_limit,
    resolve_allowed_group,
    start_metrics,
    sweep,
)

logger = init_logger(__name__)

RECV_BYTES = 256 * 1024
_UCRED = struct.Struct("3i")  # pid, uid, gid


class Server:
    """One lmcached daemon.

    Args:
        config: effective configuration (`lmcached.config` resolves it).

    Raises (from `start`):
        StartupError: the socket path is bad or taken, the metrics port is in use, the
            arena cannot be created, ... (`startup.py`).
        StartupInterrupted: SIGTERM/SIGINT during the prefault (`run_server` exits 0).
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.notifier = SystemdNotifier()
        self.arena: Arena | None = None
        self.service: CacheService | None = None
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._device_memories: list = []  # device tier memories (shm/device_memory.py)
        self._wakeup_r: socket.socket | None = None
        self._wakeup_w: socket.socket | None = None
        self._connections: dict[int, ClientConnection] = {}
        self._stop_signal: int | None = None
        self._reload_requested = False
        self._allowed_gid: int | None = None
        self._old_handlers: dict[int, object] = {}
        self._name_lock: NameLock | None = None  # held until the arena is unlinked
        # One receive buffer for every connection: sock.recv(RECV_BYTES) would allocate
        # (mmap, mremap, munmap: 3 syscalls) a fresh 256 KiB bytes object per request.
        self._recv_buf = bytearray(RECV_BYTES)
        self._recv_view = memoryview(self._recv_buf)
        self._ready: dict[ClientConnection, None] = {}  # complete frames waiting, in order
        self._silent: dict[ClientConnection, None] = {}  # no request yet, oldest first
        self._parked: dict[ClientConnection, None] = {}  # a request waits for an L2 fetch
        self._buffered_bytes = 0  # input + output buffers of every connection
        self._accept_paused_until = 0.0
        self._accept_log = RateLimitedLog()
        self._drop_log = RateLimitedLog()
        self._metrics: MetricsExporter | None = None

    # ----------------------------------------------------------------- start-up
    def start(self) -> None:
        """Catch the stop signals, run the start-up steps (`startup.py`), listen, then
        notify READY.

        Raises:
            StartupError: why the daemon cannot start; what it made is removed.
            StartupInterrupted: a stop signal arrived during the prefault; what it made
                is removed.
        """
        try:
            self._start()
        except BaseException as exc:
            self._teardown()
            if isinstance(exc, (RuntimeError, ValueError, OSError)) and not isinstance(
                    exc, StartupError):
                raise StartupError(str(exc)) from exc
            raise

    def _start(self) -> None:
        cfg = self.config
        self._install_signals()  # first: a stop during the start-up is a clean stop
        self._allowed_gid = resolve_allowed_group(cfg)
        prepare_socket(cfg, self._allowed_gid)
        raise_fd_limit(cfg)
        if cfg.metrics_port is not None:
            self._metrics = start_metrics(cfg.metrics_host, cfg.metrics_port)
        self._name_lock = claim_name(cfg.name)
        sweep(self._name_lock)
        self.arena = create_arena(cfg, self._allowed_gid, self.notifier,
                                  lambda: self._stop_signal)
        self._device_memories = self._open_device_tiers()
        self.service = CacheService(cfg, self.arena, self._device_memories)
        self.service.wake = self._wake
        if cfg.l2_url:
            self.service.attach_l2(create_l2_tier(cfg, self.arena, self._wake))
        self._listen(cfg.socket)
        self.notifier.notify("READY=1", f"STATUS=serving on {cfg.socket}", f"MAINPID={os.getpid()}")
        logger.info("lmcached %s listening on %s (pid %d)", cfg.name, cfg.socket, os.getpid())

    def _open_device_tiers(self) -> list:
        """Allocate and export the device tiers of `--gpu-capacity` (CUDA libraries are
        imported only then); [] without it."""
        if not self.config.gpu_capacity_bytes:
            return []
        from lmcached.shm.device_memory import open_device_tiers

        return open_device_tiers(self.config, self.config.name, self.arena.generation)

    def _wake(self) -> None:
        """Wake the loop from another thread (a scrape waiting for a snapshot)."""
        wakeup = self._wakeup_w
        if wakeup is not None:
            try:
                wakeup.send(b"\0")
            except OSError:  # full: the loop wakes anyway; closed: it is stopping
                pass

    def _listen(self, path: str) -> None:
        """Bind the socket (0600; 0660 and the allowed group with --allow-group) in the
        directory `prepare_socket_directory` checked, and register it."""
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

    def _install_signals(self) -> None:
        """SIGTERM/SIGINT set the stop flag and SIGHUP the reload flag, both waking the
        loop through the wakeup socket; installed before the start-up steps, so that a
        signal during the prefault ends it cleanly instead of killing the process (which
        would leave the arena in /dev/shm)."""
        self._wakeup_r, self._wakeup_w = socket.socketpair()
        self._wakeup_r.setblocking(False)
        self._wakeup_w.setblocking(False)
        self._selector.register(self._wakeup_r, selectors.EVENT_READ, "wakeup")
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
        scrapes = ()  # metrics: scrapes waiting for a snapshot (SnapshotChannel.pending)
        if self._metrics is not None:
            channel = self._metrics.channel
            channel.attach(lambda: take_snapshot(service), self._wake)
            scrapes = channel.pending
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
                    if self._parked:
                        wake_at.append(min(c.parked.deadline for c in self._parked))
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
                if self._parked:
                    self._resume_parked(time.monotonic())
                for conn in list(self._ready):
                    self._serve(conn)
                if scrapes:  # between two requests: a consistent snapshot
                    channel.serve_pending()
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
        if self.service.l2 is not None:  # L2 threads wake the loop when they finish work
            self.service.l2.process_completions(self.service.pool)
        self.service.process_completions()  # demotions

    def _reload(self) -> None:
        """SIGHUP: re-read the log level from the environment and the config file."""
        if self.config.reread is None:
            logger.warning("SIGHUP: this configuration has no sources to re-read")
            return
        try:
            fresh = self.config.reread(self.config)
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
            if conn.next_frame_end() == 0 and conn.parked is None:
                self._close_at_eof(conn)
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
        if conn.parked is not None:  # a request waits for an L2 fetch; the next ones too
            self._ready.pop(conn, None)
            return
        service, session = self.service, conn.session
        replies = []
        with_fds = False  # some reply carries descriptors: (frame, fds) among the frames
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
                conn.inpos = end
                conn.served_frames += 1
                budget -= cost
                if type(frame) is Deferred:
                    conn.parked = frame
                    self._parked[conn] = None
                    break
                if session.reply_fds:  # OPEN_TIER: the descriptor goes with this reply
                    replies.append((frame, session.reply_fds))
                    session.reply_fds = []
                    with_fds = True
                elif frame is not None:
                    replies.append(frame)
        if conn.served_frames:
            self._silent.pop(conn, None)
        if conn.inpos:
            del conn.inbuf[: conn.inpos]
            self._buffered_bytes -= conn.inpos
            conn.inpos = 0
        if replies:
            if with_fds:
                self._send_replies(conn, replies)
            else:  # the hot path: one send of every reply of this pass
                self._send(conn, replies[0] if len(replies) == 1 else b"".join(replies))
            if conn.closed:
                return
        has_frame = conn.next_frame_end() != 0
        conn.partial_since = (
            None if has_frame or not conn.inbuf else (conn.partial_since or time.monotonic())
        )
        if not has_frame or len(conn.outbuf) >= OUTBUF_PAUSE_BYTES or conn.parked is not None:
            self._ready.pop(conn, None)
        if conn.eof and not has_frame and not conn.outbuf and conn.parked is None:
            self._close_at_eof(conn)
            return
        self._update_events(conn)

    def _resume_parked(self, now: float) -> None:
        """Answer the parked requests whose L2 fetch ended or whose wait passed, then
        serve what their clients sent after them."""
        for conn in list(self._parked):
            deferred = conn.parked
            if deferred is None:  # closed while an earlier one was resumed (buffer budget)
                self._parked.pop(conn, None)
                continue
            if not deferred.job.done and now < deferred.deadline:
                continue
            del self._parked[conn]
            conn.parked = None
            reply = self.service.resume(conn.session, deferred)
            if reply is not None:
                self._send(conn, encode_reply(self.service, conn.session, reply))
                if conn.closed:
                    continue
            has_frame = conn.next_frame_end() != 0
            if has_frame and len(conn.outbuf) < OUTBUF_PAUSE_BYTES:
                self._ready[conn] = None
            if conn.eof and not has_frame and not conn.outbuf:
                self._close_at_eof(conn)
                continue
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

    def _send_replies(self, conn: ClientConnection, replies: list) -> None:
        """Send reply frames in order, one `_send` each; a (frame, fds) entry sends its
        descriptors with the frame's first byte."""
        for reply in replies:
            if type(reply) is tuple:
                self._send(conn, *reply)
            else:
                self._send(conn, reply)
            if conn.closed:
                return

    def _send(self, conn: ClientConnection, data: bytes, fds: list[int] | None = None) -> None:
        """Send `data` now as far as the socket takes it, and buffer the rest; `fds` go
        with its first byte (the daemon keeps its own copies)."""
        if not conn.outbuf:
            try:
                sent = socket.send_fds(conn.sock, [data], fds) if fds else conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent == len(data):
                return
            if sent:
                fds = None  # they went with the first bytes
            data = memoryview(data)[sent:]
        if fds:
            conn.fd_marks.append([len(conn.outbuf), fds])
        conn.outbuf += data
        self._buffered_bytes += len(data)
        if len(conn.outbuf) > MAX_OUTBUF_BYTES:
            self._drop(conn, "output_buffer", "does not read its replies")
        elif self._buffered_bytes > self.config.buffer_budget_bytes:
            self._enforce_buffer_budget()

    def _flush(self, conn: ClientConnection) -> None:
        """Send buffered replies as far as the socket takes them. Descriptors go with
        the first byte of their reply: a sendmsg that carries them starts there and ends
        before the next reply with descriptors, so a client that reads reply by reply
        receives them with that reply's first read, never with an earlier one's."""
        marks = conn.fd_marks
        try:
            if not marks:
                sent = conn.sock.send(conn.outbuf)
            elif marks[0][0]:  # send up to the reply that carries descriptors
                with memoryview(conn.outbuf)[: marks[0][0]] as chunk:
                    sent = conn.sock.send(chunk)
            else:  # that reply, with its descriptors, up to the next such reply
                end = marks[1][0] if len(marks) > 1 else len(conn.outbuf)
                with memoryview(conn.outbuf)[:end] as chunk:
                    sent = socket.send_fds(conn.sock, [chunk], marks[0][1])
                if sent:  # any byte sent took the descriptors with it
                    marks.pop(0)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        for mark in marks:
            mark[0] -= sent
        del conn.outbuf[:sent]
        self._buffered_bytes -= sent
        has_frame = conn.next_frame_end() != 0
        if len(conn.outbuf) < OUTBUF_PAUSE_BYTES and has_frame:
            self._ready[conn] = None
        if conn.eof and not has_frame and not conn.outbuf and conn.parked is None:
            self._close_at_eof(conn)
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

    # ----------------------------------------------------------------- teardown
    def _teardown(self) -> None:
        """Stop the metrics endpoint, close clients, unlink the socket and the arena,
        then drop the name's lock (another daemon of the name may start and sweep), then
        restore the signal handlers: a second SIGTERM or SIGINT during the stop is caught
        (recorded) until the arena is unlinked. Idempotent."""
        self.notifier.notify("STOPPING=1", "STATUS=stopping")
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
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
        if self.service is not None and self.service.l2 is not None:
            self.service.l2.close(self.service.pool)  # its threads read the arena
        if self.service is not None:
            self.service.close()  # the demotion thread reads device tiers and the arena
        for memory in self._device_memories:
            memory.close()
        self._device_memories = []
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self._name_lock is not None:
            self._name_lock.release()
            self._name_lock = None
        # Only now: a stop signal that came during the stop (the L2 drain, the demoter's
        # join) would otherwise kill the process with the arena still in /dev/shm.
        if self._wakeup_r is not None:
            signal.set_wakeup_fd(-1)
            for signum, handler in self._old_handlers.items():
                signal.signal(signum, handler)
            self._old_handlers.clear()
            self._selector.unregister(self._wakeup_r)
            self._wakeup_r.close()
            self._wakeup_w.close()
            self._wakeup_r = self._wakeup_w = None
        self.notifier.close()


def run_server(config: ServerConfig) -> int:
    """Run a daemon in this process until it is stopped (also during its start-up).
    Returns the exit status (0).

    Raises:
        StartupError: it could not start (see `Server.start`).
    """
    server = Server(config)
    try:
        server.start()
    except StartupInterrupted as exc:
        logger.info("received %s during start-up: stopped", signal.Signals(exc.signum).name)
        return 0
    server.serve_forever()
    logger.info("stopped")
    return 0
