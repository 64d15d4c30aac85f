"""The daemon's start-up steps, before its loop serves (`server.py` runs them in order).

Why this file exists: each step can fail for a reason the operator must fix (a group
that does not exist, a socket directory others can write, a port in use, /dev/shm
full), and each failure is one `StartupError` whose message says why and what to do;
the CLI prints it as one `Error: ...` line and exits with status 1. Keeping the steps
here leaves `server.py` the loop. The order::

    resolve --allow-group -> check the socket's directory -> refuse if a daemon answers
    on the socket -> raise the file descriptor limit -> bind the metrics port
    (--metrics-port) -> take the lock of <name> (refuse if a daemon of that name runs)
    -> sweep orphans of <name> -> create the arena -> start the L2 tier's threads (--l2)
    -> check and lock the disk tier's directory, open its slot file (--disk-path) -> listen
    -> rebuild the disk tier's index (a thread) while the loop reserves and prefaults the
    arena, answering INFO, PING and the CLI with the `loading` state meanwhile (`server.py`)

The metrics port is bound and the disk directory locked before the daemon listens, so
that a port in use or a disk tier of another daemon stops the start-up at once, not
after minutes of prefault. A stop signal or a SHUTDOWN during the index rebuild or the
prefault ends them (`StartupInterrupted`); the half-built arena is unlinked.
"""

import errno
import grp
import os
import resource
import threading
import time
from collections.abc import Callable

from lmcached.daemon.server_config import ServerConfig
from lmcached.shm.pages import shm_free_bytes
from lmcached.wire.units import echo_size, format_bytes, format_size, size_style
from lmcached.wire.extras import install_hint
from lmcached.wire.logger import init_logger
from lmcached.daemon.jobs import JobRunner
from lmcached.daemon.metrics import MetricsExporter
from lmcached.daemon.progress import STATUS_INTERVAL_S, IndexProgress, PrefaultProgress
from lmcached.shm.arena import Arena
from lmcached.shm.janitor import NameLock, unlink_orphans
from lmcached.wire.socket_path import claim_socket_path, group_can_enter, prepare_socket_directory

logger = init_logger(__name__)

# Descriptors besides clients: listener, wakeup pair, selector, log, and with metrics
# its listener, its MAX_SCRAPE_CONNECTIONS (8) connections and the /proc files a scrape reads.
FD_RESERVE = 32


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to do, in one line."""


class StartupInterrupted(Exception):
    """A stop signal or a SHUTDOWN arrived while the arena was prefaulted or the disk
    tier's index rebuilt; nothing is left behind.

    Args:
        signum: the signal (SIGTERM, SIGINT), or None for a SHUTDOWN request.
    """

    def __init__(self, signum: int | None) -> None:
        super().__init__(f"signal {signum} during start-up" if signum else
                         "SHUTDOWN during start-up")
        self.signum = signum


def resolve_allowed_group(cfg: ServerConfig) -> int | None:
    """The gid of --allow-group, or None without it.

    Raises:
        StartupError: no such group, or the daemon's user is not a member (it could not
            give the socket and the arena to that group).
    """
    if not cfg.allow_group:
        return None
    source = cfg.source_of("allow_group")
    try:
        gid = grp.getgrnam(cfg.allow_group).gr_gid
    except KeyError:
        raise StartupError(f"{source}: no group named {cfg.allow_group!r} (getent group "
                           "lists them)") from None
    if os.geteuid() != 0 and gid not in (os.getegid(), *os.getgroups()):
        raise StartupError(
            f"{source}: {cfg.allow_group}: the daemon's user is not a member of that "
            f"group, so it cannot give it the socket and the arena; add it (usermod "
            f"-aG {cfg.allow_group} USER) or pick one of its groups"
        )
    return gid


def prepare_socket(cfg: ServerConfig, allowed_gid: int | None) -> None:
    """Create or check the socket's directory (`socket_path.py`), warn when the allowed
    group cannot reach the socket or map the arena, and claim the socket path (a stale
    socket is removed).

    Raises:
        StartupError: the directory cannot be created.
        RuntimeError, OSError: the directory is not trusted, or a daemon answers on the
            socket (`claim_socket_path`; `Server.start` turns them into StartupError).
    """
    try:
        prepare_socket_directory(cfg.socket, allowed_gid)
    except OSError as exc:
        raise StartupError(f"cannot create the directory of --socket {cfg.socket}: "
                           f"{exc.strerror or exc}: {exc.filename}") from exc
    if allowed_gid is not None and not group_can_enter(cfg.socket, allowed_gid):
        directory = os.path.dirname(cfg.socket)
        logger.warning("members of group %s cannot enter %s, so they cannot connect: "
                       "chgrp %s %s && chmod 0750 %s", cfg.allow_group, directory,
                       cfg.allow_group, directory, directory)
    if allowed_gid is not None and cfg.shm_mode & 0o060 != 0o060:
        logger.warning("--shm-mode 0%o: members of group %s cannot map the arena "
                       "read-write (use 0660)", cfg.shm_mode, cfg.allow_group)
    claim_socket_path(cfg.socket)


def raise_fd_limit(cfg: ServerConfig) -> None:
    """Raise the soft RLIMIT_NOFILE to max_clients + FD_RESERVE (as Redis does for
    `maxclients`), up to the hard limit; if even that is too low, lower max_clients
    to fit (stored back in `cfg`) and warn."""
    want = cfg.max_clients + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    if soft != infinity and soft < want:
        new_soft = want if hard == infinity else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
            soft = new_soft
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the file descriptor limit from %d to %d: %s",
                           soft, new_soft, exc)
    if soft != infinity and soft < want:
        fitting = max(1, soft - FD_RESERVE)
        logger.warning(
            "the file descriptor limit (soft %d, hard %s) holds only %d clients: "
            "max_clients lowered from %d to %d; raise the hard limit (LimitNOFILE= in "
            "the unit, ulimit -Hn) or lower --max-clients", soft,
            "unlimited" if hard == infinity else hard, fitting, cfg.max_clients, fitting,
        )
        cfg.max_clients = fitting
    logger.info("file descriptor limit %s (hard %s): room for max_clients %d",
                "unlimited" if soft == infinity else soft,
                "unlimited" if hard == infinity else hard, cfg.max_clients)


def start_metrics(host: str, port: int) -> MetricsExporter:
    """Serve Prometheus metrics on host:port (`metrics.py`).

    Raises:
        StartupError: the port is in use, or the address is not one of this machine.
    """
    try:
        return MetricsExporter(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                f"metrics port {port} on {host} is already in use: choose another "
                "--metrics-port, or stop the process that listens there") from exc
        raise StartupError(f"cannot serve metrics on {host} port {port}: "
                           f"{exc.strerror or exc}; check --metrics-host") from exc


def claim_name(name: str) -> NameLock:
    """Take the lock of daemon `name` for the daemon's life (`shm/janitor.py`): it says
    which daemon owns the segments of that name, whatever their bytes say.

    Raises:
        StartupError: another daemon of that name and user runs, or the lock directory
            is not this user's (the message says what to do).
        OSError: the lock file cannot be created.
    """
    try:
        return NameLock.acquire(name)
    except RuntimeError as exc:  # DaemonRunningError, UnsafeLockDirectoryError
        raise StartupError(str(exc)) from None


def sweep(lock: NameLock) -> None:
    """Unlink the segments of dead daemons of `lock`'s name (`shm/janitor.py`): with the
    name's lock held, every one there is an orphan."""
    removed = unlink_orphans(lock)
    if removed:
        logger.warning("removed %d orphaned segment(s) of dead daemons: %s", len(removed), removed)


def create_arena(cfg: ServerConfig, allowed_gid: int | None) -> Arena:
    """Create the arena, not yet prefaulted (`prefault_arena` does that while the daemon
    answers INFO and PING).

    Args:
        cfg: capacity, block size, mode of the arena.
        allowed_gid: group to give the segment (--allow-group), or None.

    Raises:
        StartupError: the segment cannot be created or mapped (the message says which
            limit to raise, or how much /dev/shm has free).
    """
    try:
        return Arena.create(cfg.name, cfg.capacity_bytes, cfg.block_bytes, mode=cfg.shm_mode,
                            prefault=False, gid=allowed_gid)
    except OSError as exc:
        raise _arena_error(cfg, exc) from exc


def prefault_arena(cfg: ServerConfig, arena: Arena, progress: PrefaultProgress,
                   step: Callable[[], None]) -> None:
    """Reserve and prefault the arena (progress on stderr and in `progress`), calling
    `step()` after each step: the daemon answers what arrived meanwhile (the `loading`
    state), and may stop there.

    Raises:
        StartupError: the pages cannot be reserved (/dev/shm full: how much it has free)
            or mapped (a memory limit); the caller unlinks the arena.
        Whatever `step` raises (StartupInterrupted: a stop during the prefault).
    """
    def on_step(done_bytes: int, total_bytes: int) -> None:
        progress(done_bytes, total_bytes)
        step()

    try:
        arena.reserve(on_step)
    except OSError as exc:
        raise _arena_error(cfg, exc) from exc
    logger.info("arena %s ready: %s in %.2f s (%.2f GB/s prefault)", arena.segment_name,
                format_bytes(cfg.capacity_bytes), progress.elapsed_s,
                progress.rate_bytes_per_s / 1e9)


def _arena_error(cfg: ServerConfig, exc: OSError) -> StartupError:
    """Why an arena of --capacity cannot be made, and the limit to raise or the space to
    free."""
    typed = cfg.size_texts.get("capacity")
    capacity = echo_size(typed, cfg.capacity_bytes)
    free = format_size(shm_free_bytes(), size_style(typed))
    no_room = (f"/dev/shm has {free} free (other arenas or files take the rest): free "
               "space there, or lower --capacity")
    hint = {errno.ENOMEM: "this process may not map that much (ulimit -v, a memory "
            "cgroup's MemoryMax=): raise the limit or lower --capacity",
            errno.ENOSPC: no_room,
            errno.EFAULT: "the kernel cannot back its pages: " + no_room}
    return StartupError(f"cannot create a {capacity} arena: {exc.strerror or exc}; "
                        f"{hint.get(exc.errno, 'see the daemon log')}")


L2_SOCKET_TIMEOUT_S = 2.0  # a Redis operation slower than this counts as an outage


def open_spill_tiers(cfg: ServerConfig, arena: Arena, jobs: JobRunner) -> list:
    """The tiers under the arena that `cfg` turns on, in lookup order (arena, then these):
    one line per tier, its setting and how it opens.

    Raises:
        StartupError: a tier cannot open (`create_l2_tier`, `open_disk_tier`); the tiers
            opened before it are closed first.
    """
    openers = (
        (cfg.disk_path, open_disk_tier),
        (cfg.l2_url, create_l2_tier),
    )
    tiers = []
    try:
        for setting, open_tier in openers:
            if setting:
                tiers.append(open_tier(cfg, arena, jobs))
    except BaseException:
        for tier in reversed(tiers):
            tier.close()
        raise
    return tiers


def create_l2_tier(cfg: ServerConfig, arena: Arena, jobs: JobRunner):
    """The L2 tier of `--l2` (docs/l2.md): its threads start; it does not wait for Redis.

    An L2 that is down at start is not a start-up error: the tier backs off, counts it,
    and connects when the servers answer.

    Args:
        cfg: the l2_* settings.
        arena: the daemon's arena.
        jobs: the daemon's background job runner (the tier's threads are its queues).

    Raises:
        StartupError: redis-py is not installed, or the URL is malformed.
    """
    try:
        from lmcached.daemon.l2.redis_store import RedisL2, parse_l2_url
        from lmcached.daemon.l2.tier import L2Tier
    except ImportError as exc:
        raise StartupError(f"--l2 needs redis-py ({exc}): {install_hint('l2')}") from exc
    try:
        addresses = parse_l2_url(cfg.l2_url)
    except ValueError as exc:
        raise StartupError(f"--l2 {cfg.l2_url}: {exc}") from exc
    store = RedisL2(addresses, ttl_s=cfg.l2_ttl_s or None, timeout_s=L2_SOCKET_TIMEOUT_S)
    logger.info("L2 tier on %s (%s, ttl %s, queue %s, fetch wait %g s, %d threads)",
                cfg.l2_url, cfg.l2_policy, f"{cfg.l2_ttl_s:g} s" if cfg.l2_ttl_s else "none",
                format_bytes(cfg.l2_queue_bytes), cfg.l2_fetch_wait_s, cfg.l2_threads)
    return L2Tier(store, arena, url=cfg.l2_url, policy=cfg.l2_policy, ttl_s=cfg.l2_ttl_s,
                  queue_bytes=cfg.l2_queue_bytes, fetch_wait_s=cfg.l2_fetch_wait_s,
                  num_threads=cfg.l2_threads, jobs=jobs)


def disk_free_bytes(directory) -> int:
    """Free bytes of the filesystem of `directory` (a `DiskDirectory`, examined through its
    descriptor), counting the slot file already there as free (a restart keeps the size
    it had)."""
    from lmcached.daemon.disk.slots import FILE_NAME

    fs = os.statvfs(directory.fd)
    free = fs.f_bavail * fs.f_frsize
    try:
        free += os.stat(FILE_NAME, dir_fd=directory.fd, follow_symlinks=False).st_blocks * 512
    except FileNotFoundError:
        pass
    return free


def disk_capacity(cfg: ServerConfig, directory) -> tuple[int, str, float | None]:
    """Bytes of the disk tier: `--disk-capacity` in bytes, or its percentage of the free
    space of the directory's filesystem (`disk_free_bytes`), with how it was derived (for
    messages) and that percentage (None when given in bytes).

    Args:
        directory: the checked `DiskDirectory` (its filesystem is examined through its
            descriptor).

    Raises:
        StartupError: a capacity in bytes larger than that free space (the slot file
            is preallocated: it could not be, and a full disk would drop every spill).
    """
    text = cfg.disk_capacity
    free = disk_free_bytes(directory)
    if text.endswith("%"):
        percent = float(text[:-1])
        return (int(free * percent / 100),
                f"--disk-capacity {text} of the {format_bytes(free)} free in {directory.path}",
                percent)
    capacity = int(text)
    if capacity > free:
        raise StartupError(f"--disk-capacity {format_bytes(capacity)} is more than the "
                           f"{format_bytes(free)} free in {directory.path}: lower "
                           f"--disk-capacity (bytes, or a percentage of the free space, "
                           f"e.g. 50%) or free space there")
    return capacity, f"--disk-capacity {format_bytes(capacity)}", None


def open_disk_tier(cfg: ServerConfig, arena: Arena, jobs: JobRunner):
    """The disk tier of `--disk-path` (docs/operator.md, "The disk tier"), before the
    daemon listens: its directory checked and locked (a second daemon on it fails here,
    at once), its slot file opened. The index of the slots an earlier daemon left is
    not read yet: `rebuild_disk_index` does that (the tier's `needs_rebuild`).

    Args:
        cfg: the disk_* settings.
        arena: the daemon's arena (its block size, when known, sizes the slots).
        jobs: the daemon's background job runner (the tier's threads are its queues).

    Raises:
        StartupError: the directory is unsafe, used by another daemon, or the slot file
            cannot be opened (the message names the cause and the fix).
    """
    from lmcached.daemon.disk.directory import DirectoryLock, DiskDirectoryError, \
        prepare_disk_directory
    from lmcached.daemon.disk.slots import slot_bytes_for
    from lmcached.daemon.disk.tier import DiskTier

    try:
        directory = prepare_disk_directory(cfg.disk_path)
    except DiskDirectoryError as exc:
        raise StartupError(str(exc)) from None
    lock = None
    try:
        lock = DirectoryLock(directory)
        capacity, source, percent = disk_capacity(cfg, directory)
        tier = DiskTier(directory, lock, capacity_bytes=capacity, policy=cfg.disk_policy,
                        fetch_wait_s=cfg.disk_fetch_wait_s, arena=arena, jobs=jobs,
                        capacity_source=source, capacity_percent=percent)
    except BaseException as exc:
        if lock is not None:
            lock.release()
        directory.close()
        if isinstance(exc, DiskDirectoryError):
            raise StartupError(str(exc)) from None
        raise
    try:
        tier.open_file(arena.block_bytes)
    except BaseException as exc:
        tier.close()  # its threads and file; the directory's lock is released
        if isinstance(exc, DiskDirectoryError):
            raise StartupError(str(exc)) from None
        if isinstance(exc, OSError):
            raise _disk_error(cfg, exc) from exc
        raise
    # The block size may come later (the first layout); a capacity that holds not even a
    # slot of the smallest block holds none of any: say so now, not at the first client.
    smallest_slot_bytes = slot_bytes_for(arena.block_bytes or 1)
    if tier.slots is None and tier.turn_off_unless_it_holds(smallest_slot_bytes):
        return tier
    logger.info("disk tier in %s: %s, %s, fetch wait %g s", directory.path,
                format_bytes(capacity), cfg.disk_policy, cfg.disk_fetch_wait_s)
    return tier


def _disk_error(cfg: ServerConfig, exc: OSError) -> StartupError:
    return StartupError(f"--disk-path {cfg.disk_path}: cannot open the disk tier: "
                        f"{exc.strerror or exc}; check the filesystem (read-only? full?) or "
                        f"choose another --disk-path")


class IndexRebuild:
    """The disk tier's index rebuilt on a thread (warm restart) while the daemon's loop
    answers in the `loading` state and prefaults the arena (docs/operator.md, "What a
    restart does"): the scan mostly waits for the disk, the prefault for memory.

    Args:
        cfg: the disk_* settings (for the error message).
        tier: the disk tier `open_disk_tier` opened, with `needs_rebuild`.
        progress: the phase's record, updated by the scan's threads.
        wake: wakes the daemon's loop; called once the rebuild ends.
    """

    def __init__(self, cfg: ServerConfig, tier, progress: IndexProgress,
                 wake: Callable[[], None]) -> None:
        self._cfg = cfg
        self._tier = tier
        self._progress = progress
        self._wake = wake
        self._stopping = False
        self._error: BaseException | None = None
        self._next_log = time.monotonic() + 1.0
        self._thread = threading.Thread(target=self._run, name="lmcached-disk-index",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._tier.rebuild_index(self._on_progress)
            self._progress.report(self._progress.total)
        except BaseException as exc:  # noqa: BLE001 - raised on the loop thread by `wait`
            self._error = exc
        finally:
            self._wake()

    def _on_progress(self, done_slots: int, num_slots: int) -> None:
        if self._stopping:
            raise StartupInterrupted(None)
        self._progress(done_slots, num_slots)
        if time.monotonic() >= self._next_log:
            self._next_log = time.monotonic() + 1.0
            logger.info("disk tier: %d of %d slots scanned", done_slots, num_slots)

    def wait(self, step: Callable[[float], None]) -> None:
        """Call `step(timeout_s)` (a loop pass that waits up to that long) until the
        rebuild ends.

        Raises:
            StartupError: a slot cannot be read (the message names the cause and the fix).
            Whatever `step` raises (StartupInterrupted: a stop during the rebuild).
        """
        while self._thread.is_alive():
            step(STATUS_INTERVAL_S)
        self._thread.join()
        if isinstance(self._error, OSError):
            raise _disk_error(self._cfg, self._error) from self._error
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """Stop the rebuild at the scan's next progress report (within a few thousand
        slots), and wait for its thread. Idempotent; nothing to stop once it ended."""
        self._stopping = True
        self._thread.join()
