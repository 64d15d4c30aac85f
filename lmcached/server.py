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

import grp
import os
import pwd
import selectors
import signal
import socket
import struct
import sys
import time

import msgspec

from lmcached.config import ServerConfig, format_bytes, load_config
from lmcached.logger import configure_logging, init_logger
from lmcached.notify import SystemdNotifier
from lmcached.protocol import MAX_FRAME_BYTES, encode_frame, request_decoder
from lmcached.service import CacheService
from lmcached.session import Session
from lmcached.shm.arena import Arena, sweep_orphans

logger = init_logger(__name__)

RECV_BYTES = 256 * 1024
MAX_OUTBUF_BYTES = 16 << 20  # a client that stops reading its replies is dropped
_UCRED = struct.Struct("3i")  # pid, uid, gid
_MAX_SUN_PATH = 107


class ClientConnection:
    """A connected client: its socket, session and buffered bytes."""

    __slots__ = ("sock", "session", "inbuf", "outbuf", "closed")

    def __init__(self, sock: socket.socket, session: Session) -> None:
        self.sock = sock
        self.session = session
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.closed = False


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
        """Serve until SIGTERM/SIGINT or SHUTDOWN, then stop gracefully."""
        watchdog_s = self.notifier.watchdog_interval_s
        next_watchdog = time.monotonic()
        service = self.service
        try:
            while self._stop_signal is None and not service.stop_requested:
                timeout = None
                if watchdog_s is not None:
                    now = time.monotonic()
                    if now >= next_watchdog:
                        self.notifier.notify("WATCHDOG=1")
                        next_watchdog = now + watchdog_s
                    timeout = max(0.0, next_watchdog - now)
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
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                logger.warning("accept failed: %s", exc)
                return
            pid, uid, gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            if not self._authorized(uid, gid):
                logger.warning("refused connection from pid %d uid %d gid %d", pid, uid, gid)
                self.service.error("unauthorized", f"uid {uid}")
                sock.close()
                continue
            sock.setblocking(False)
            conn = ClientConnection(sock, self.service.open_session(pid, uid, gid))
            self._connections[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

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
        if not num_bytes:  # EOF: the client closed or died
            self._close(conn)
            return
        inbuf = conn.inbuf
        inbuf += self._recv_view[:num_bytes]
        service = self.service
        while len(inbuf) >= 4:
            length = int.from_bytes(inbuf[:4], "little")
            if length > MAX_FRAME_BYTES:
                logger.error(
                    "session %d (pid %d) sent a %d-byte frame (limit %d): closing it",
                    conn.session.session_id, conn.session.pid, length, MAX_FRAME_BYTES,
                )
                service.error("frame_too_large", str(length))
                self._close(conn)
                return
            end = 4 + length
            if len(inbuf) < end:
                return
            payload = bytes(inbuf[4:end])
            del inbuf[:end]
            try:
                request = request_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                reply = service.error("bad_request", f"undecodable request: {exc}")
            else:
                reply = service.handle(conn.session, request)
            try:
                frame = encode_frame(reply)
            except ValueError as exc:
                frame = encode_frame(service.error("too_large", str(exc)))
            self._send(conn, frame)
            if conn.closed:
                return

    def _send(self, conn: ClientConnection, frame: bytes) -> None:
        if not conn.outbuf:
            try:
                sent = conn.sock.send(frame)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent == len(frame):
                return
            frame = frame[sent:]
            self._selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        conn.outbuf += frame
        if len(conn.outbuf) > MAX_OUTBUF_BYTES:
            logger.error("session %d does not read its replies: closing it", conn.session.session_id)
            self._close(conn)

    def _flush(self, conn: ClientConnection) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        del conn.outbuf[:sent]
        if not conn.outbuf:
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _close(self, conn: ClientConnection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._connections.pop(conn.sock.fileno(), None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        self.service.close_session(conn.session)

    # ----------------------------------------------------------------- teardown
    def _teardown(self) -> None:
        """Close clients, unlink the socket and the arena. Idempotent."""
        self.notifier.notify("STOPPING=1", "STATUS=stopping")
        for conn in list(self._connections.values()):
            self._close(conn)
        if self._listener is not None:
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
