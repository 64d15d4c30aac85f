"""The daemon's event loop: one thread, `selectors` over non-blocking Unix sockets.

Why this file exists: it moves frames between sockets and `CacheService` and owns the
process life cycle (signals, READY, graceful stop); the start-up steps before it serves
are in `startup.py`. Reading and answering a connection is `server_io.py`; admitting,
limiting and dropping connections is `server_clients.py` (parts of `Server`). No
asyncio: a selectors loop answers a round trip several times faster than asyncio (docs/architecture.md, "Performance rules").

Life cycle::

    catch SIGTERM/SIGINT/SIGHUP -> start-up steps (startup.py: socket directory, metrics
    port, the name's lock, sweep, create the arena, open the disk tier) -> listen ->
    rebuild the disk tier's index and prefault the arena, answering with the `loading`
    state (`_load`) -> READY=1 -> serve -> SIGTERM/SIGINT
    or SHUTDOWN -> STOPPING=1 -> unlink the socket, close clients, unlink the arena,
    drop the name's lock -> exit 0

Whatever stops the start-up is one `StartupError` whose message says why and what to do;
the CLI prints it as one `Error: ...` line and exits with status 1. A stop signal during
the start-up stops it cleanly (exit 0, nothing left in /dev/shm).
"""

import os
import selectors
import signal
import socket
import time

from lmcached.daemon.server_config import ServerConfig
from lmcached.wire.logger import configure_logging, init_logger
from lmcached.daemon.notify import SystemdNotifier
from lmcached.daemon.progress import IndexProgress, Loading, PrefaultProgress
from lmcached.daemon.connection import HOUSEKEEPING_INTERVAL_S, ClientConnection
from lmcached.daemon.connection import logger as connection_logger
from lmcached.daemon.ratelimit import RateLimitedLog
from lmcached.daemon.jobs import JobRunner
from lmcached.daemon.metrics import MetricsExporter, take_snapshot
from lmcached.daemon.service import CacheService
from lmcached.shm.arena import Arena
from lmcached.shm.janitor import NameLock
from lmcached.daemon.server_clients import ClientAccounting
from lmcached.daemon.server_io import ClientIO
from lmcached.daemon.startup import (
    IndexRebuild,
    StartupError,
    StartupInterrupted,
    claim_name,
    create_arena,
    open_spill_tiers,
    prefault_arena,
    prepare_socket,
    raise_fd_limit,
    resolve_allowed_group,
    start_metrics,
    sweep,
)

logger = init_logger(__name__)

RECV_BYTES = 256 * 1024


class Server(ClientIO, ClientAccounting):
    """One lmcached daemon.

    Args:
        config: effective configuration (`lmcached.config` resolves it).

    Raises (from `start`):
        StartupError: the socket path is bad or taken, the metrics port is in use, the
            arena cannot be created, ... (`startup.py`).
        StartupInterrupted: SIGTERM/SIGINT during the index rebuild or the prefault
            (`run_server` exits 0).
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
        # Accepts, refusals and drops are the connections' limits: their logger's.
        self._accept_log = RateLimitedLog(connection_logger)
        self._drop_log = RateLimitedLog(connection_logger)
        self._metrics: MetricsExporter | None = None

    # ----------------------------------------------------------------- start-up
    def start(self) -> None:
        """Catch the stop signals, run the start-up steps (`startup.py`), listen, then
        notify READY.

        Raises:
            StartupError: why the daemon cannot start; what it made is removed.
            StartupInterrupted: a stop signal arrived during the index rebuild or the
                prefault; what it made is removed.
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
        self.arena = create_arena(cfg, self._allowed_gid)
        self._device_memories = self._open_device_tiers()
        self.service = CacheService(cfg, self.arena, self._device_memories,
                                    JobRunner(self._wake))
        for tier in open_spill_tiers(cfg, self.arena, self.service.jobs):
            self.service.attach_tier(tier)
        self._listen(cfg.socket)
        self._load()
        self.notifier.notify("READY=1", f"STATUS=serving on {cfg.socket}", f"MAINPID={os.getpid()}")
        logger.info("lmcached %s listening on %s (pid %d)", cfg.name, cfg.socket, os.getpid())

    def _load(self) -> None:
        """Rebuild the disk tier's index (a warm restart, on a thread: `IndexRebuild`)
        and prefault the arena at once, while answering clients (after Redis's LOADING
        state): between two prefault steps (64 MiB, tens of ms), or every second while
        only the rebuild runs, one loop pass answers INFO, CLIENTS and CONFIG GET,
        refuses the other requests with `loading` (the phases, their progress and time
        left: clients take it as a miss), updates systemd's STATUS=, and a stop signal
        or a SHUTDOWN ends the start-up. Both at once: the scan waits for the disk, the
        prefault for memory (docs/operator.md, "What a restart does", measured).

        Raises:
            StartupError: the arena cannot be reserved (`prefault_arena`), or a slot
                cannot be read.
            StartupInterrupted: a stop signal or a SHUTDOWN arrived.
        """
        disk = self.service.spill_tier("disk")
        index = IndexProgress(disk.slots.num_slots) if disk and disk.needs_rebuild else None
        prefault = PrefaultProgress(self.config.capacity_bytes) if self.config.prefault else None
        phases = [p for p in (index, prefault) if p is not None]
        if not phases:
            return
        loading = Loading(phases)
        self.service.start_loading(loading)
        self.notifier.notify(f"STATUS={loading.describe()}")

        def step(timeout_s: float = 0.0) -> None:
            self._loop_pass(timeout_s)
            if loading.status_due():
                self.notifier.notify(f"STATUS={loading.describe()}")
            if self._stop_signal is not None or self.service.stop_requested:
                raise StartupInterrupted(self._stop_signal)

        rebuild = IndexRebuild(self.config, disk, index, self._wake) if index else None
        try:
            if prefault is not None:
                prefault_arena(self.config, self.arena, prefault, step)
            if rebuild is not None:
                rebuild.wait(step)
        finally:
            if rebuild is not None:
                rebuild.stop()
        self.service.loading = None

    def _open_device_tiers(self) -> list:
        """Allocate and export the device tiers of `--gpu-capacity` (CUDA libraries are
        imported only then); [] without it."""
        if not self.config.gpu_capacity_bytes:
            return []
        from lmcached.shm.device_memory import open_device_tiers

        return open_device_tiers(self.config, self.config.name, self.arena.generation)

    def _wake(self) -> None:
        """Wake the loop from another thread (a scrape waiting for a snapshot, a
        background job's completion)."""
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
                self._loop_pass(timeout)
                if scrapes:  # between two requests: a consistent snapshot
                    channel.serve_pending()
            if self._stop_signal is not None:
                logger.info("received %s: stopping", signal.Signals(self._stop_signal).name)
        finally:
            self._teardown()

    def _loop_pass(self, timeout: float | None) -> None:
        """Wait up to `timeout` seconds for sockets (None: until one is ready), accept,
        read and flush what they say, then serve every client with waiting frames up to
        PASS_BUDGET (round robin)."""
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

    def _drain_wakeup(self) -> None:
        try:
            while self._wakeup_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        if self._reload_requested:
            self._reload_requested = False
            self._reload()
        self.service.jobs.process_completions()  # demotions, L2 writes and fetches

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

    # ----------------------------------------------------------------- teardown
    def _teardown(self) -> None:
        """Unlink the socket, stop the metrics endpoint, close clients, unlink the arena,
        then drop the name's lock (another daemon of the name may start and sweep), then
        restore the signal handlers: a second SIGTERM or SIGINT during the stop is caught
        (recorded) until the arena is unlinked. Idempotent."""
        self.notifier.notify("STOPPING=1", "STATUS=stopping")
        if self._listener is not None:  # first: a client that comes now finds no daemon
            if not self._accept_paused_until:
                self._selector.unregister(self._listener)
            try:
                os.unlink(self.config.socket)
            except FileNotFoundError:
                pass
            self._listener.close()
            self._listener = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        for conn in list(self._connections.values()):
            self._close(conn)
        disk = self.service.spill_tier("disk") if self.service is not None else None
        if disk is not None:
            # No client can change the arena now: its hot chunks go to disk first.
            disk.save_on_stop(self.config.disk_save_on_stop_s, self.notifier.notify)
        if self.service is not None:  # their threads read and write the arena
            for tier in reversed(self.service.spill_tiers):
                tier.close()
            self.service.spill_tiers.clear()
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
        logger.info("received %s during start-up: stopped",
                    signal.Signals(exc.signum).name if exc.signum else "SHUTDOWN")
        return 0
    server.serve_forever()
    logger.info("stopped")
    return 0
