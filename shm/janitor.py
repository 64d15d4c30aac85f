"""The janitor: which daemon owns the arena segments of a name, and the unlinking of the
segments whose daemon died.

Why this file exists: a daemon killed by SIGKILL (or the OOM killer) never unlinks its
arena, and a POSIX shared-memory segment outlives every process that mapped it: it keeps
its memory until someone removes its file in /dev/shm. Only the owner unlinks a live
segment (`Arena.close`), so the cleaning up after crashes lives here, apart from the
segment itself, as CPython keeps `resource_tracker.py` apart from `shared_memory.py`.

Ownership is the daemon's own state, never bytes in the segment: every client maps the
segment read-write, so its header says whatever the last client wrote there. A daemon
holds an exclusive `flock` on `/dev/shm/.lmcached-<uid>/<name>.lock` (`NameLock`) from
before it creates its arena until after it unlinks it. The directory is the daemon
user's, mode 0700: no client, an `--allow-group` member included, can enter it, create
the file or lock it. The kernel drops the lock when the daemon dies, however it dies, so:

- a daemon that cannot take the lock refuses to start: another daemon of that name and
  user runs, whatever socket it listens on;
- whoever holds the lock owns every segment `lmcached.<name>.*` of its user: the ones that
  exist before it creates its own are orphans of a dead daemon (`unlink_orphans`).

The lock lives in /dev/shm, beside the segments, because that is their namespace: a
container with its own /dev/shm has its own daemons, and systemd units with
`PrivateTmp=` share /dev/shm but not /tmp. The daemon sweeps at start-up (`startup.py`);
`launcher.py` sweeps after stopping a daemon it started (`sweep_orphans`).
"""

import errno
import fcntl
import os
import stat

import posix_ipc

from lmcached.wire.logger import init_logger

from .segment import SEGMENT_PREFIX

logger = init_logger(__name__)

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments as files
LOCK_DIR_PREFIX = ".lmcached-"  # /dev/shm/.lmcached-<uid>: no segment name starts so
_LOCK_DIR_MODE = 0o700
_LOCK_FILE_MODE = 0o600
_LOCK_ATTEMPTS = 8  # a holder unlinking the file between our open and our flock


class DaemonRunningError(RuntimeError):
    """Another daemon of this name and user holds the name's lock; the message names its
    pid and what to do."""


class UnsafeLockDirectoryError(RuntimeError):
    """The lock directory is not this user's own private directory; the message says how
    to fix it."""


def lock_directory() -> str:
    """The directory of this user's name locks: `/dev/shm/.lmcached-<euid>`."""
    return os.path.join(SHM_DIR, f"{LOCK_DIR_PREFIX}{os.geteuid()}")


def _open_lock_directory() -> int:
    """Create (0700) or open this user's lock directory; return an O_DIRECTORY fd of it.

    Raises:
        UnsafeLockDirectoryError: it is a symlink, not a directory, or another user's.
    """
    path = lock_directory()
    try:
        os.mkdir(path, _LOCK_DIR_MODE)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeLockDirectoryError(
                f"{path} is not a directory (a symlink or a file): whoever made it could "
                f"decide which daemon owns an arena; remove it (rm {path}) and start again"
            ) from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeLockDirectoryError(
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): its "
            f"owner could decide which daemon owns an arena; remove it (as root: rm -r {path}) "
            f"and start again"
        )
    if stat.S_IMODE(st.st_mode) != _LOCK_DIR_MODE:
        os.fchmod(fd, _LOCK_DIR_MODE)  # ours: whatever the umask or a chmod made it
    return fd


class NameLock:
    """The exclusive lock of a daemon name, held for the daemon's life.

    After the pid files of ssh-agent or PostgreSQL's postmaster.pid, but decided by
    `flock` (released by the kernel when the holder dies), not by a pid that may be stale
    or reused. The holder writes its pid in the file, for the refusal message only.

    Use `NameLock.acquire` (a daemon) or `NameLock.try_acquire` (a sweep); `release`
    unlinks the file, then drops the lock.

    Attributes:
        name: the daemon name.
        path: the lock file.
    """

    def __init__(self, name: str, path: str, fd: int) -> None:
        self.name = name
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def try_acquire(cls, name: str) -> "NameLock | None":
        """Take the lock of daemon `name`, or return None when a live process holds it.

        Raises:
            UnsafeLockDirectoryError: see `_open_lock_directory`.
            OSError: the directory or the file cannot be created (e.g. /dev/shm missing).
        """
        dir_fd = _open_lock_directory()
        file_name = f"{name}.lock"
        try:
            for _ in range(_LOCK_ATTEMPTS):
                fd = os.open(file_name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             _LOCK_FILE_MODE, dir_fd=dir_fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    return None
                try:  # the holder before us may have unlinked the file since our open
                    now = os.stat(file_name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    now = None
                held = os.fstat(fd)
                if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                    return cls(name, os.path.join(lock_directory(), file_name), fd)
                os.close(fd)
            raise AssertionError(f"bug: the lock file of {name} kept changing under us")
        finally:
            os.close(dir_fd)

    @classmethod
    def acquire(cls, name: str) -> "NameLock":
        """Take the lock of daemon `name` (a daemon's start-up).

        Raises:
            DaemonRunningError: another daemon of that name and user runs.
            UnsafeLockDirectoryError, OSError: see `try_acquire`.
        """
        lock = cls.try_acquire(name)
        if lock is None:
            path = os.path.join(lock_directory(), f"{name}.lock")
            try:
                with open(path) as f:
                    holder = f"pid {int(f.read().strip())}"
            except (OSError, ValueError):
                holder = "its pid unknown"
            raise DaemonRunningError(
                f"another lmcached daemon named {name} is already running ({holder}, it "
                f"holds {path}): stop it first, or start this one with another --name"
            )
        return lock

    def release(self) -> None:
        """Unlink the lock file, then drop the lock (after the arena is unlinked).
        Safe to call twice."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still held: a waiter re-checks the inode
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "NameLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def list_segments(name: str | None = None) -> list[str]:
    """File names in /dev/shm of arena segments (of daemon `name`, or of any daemon)."""
    prefix = SEGMENT_PREFIX + (f"{name}." if name else "")
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if e.startswith(prefix))


def unlink_orphans(lock: NameLock) -> list[str]:
    """Unlink every segment of `lock.name` of this user: while its lock is held, no other
    daemon of that name runs, so each one is an orphan of a dead daemon. Call it before
    the holder creates its own arena. Another user's segment (this process may not judge
    nor, /dev/shm being sticky, unlink it) is left alone.

    Returns:
        The names (in /dev/shm) of the segments unlinked.
    """
    removed = []
    for entry in list_segments(lock.name):
        try:
            if os.lstat(os.path.join(SHM_DIR, entry)).st_uid != os.geteuid():
                logger.debug("segment %s is another user's: left alone", entry)
                continue
            posix_ipc.unlink_shared_memory("/" + entry)
        except (FileNotFoundError, posix_ipc.ExistentialError):
            continue
        except posix_ipc.PermissionsError:
            logger.debug("cannot remove segment %s", entry)
            continue
        logger.warning("removed orphaned arena segment %s (its daemon is gone)", entry)
        removed.append(entry)
    return removed


def sweep_orphans(name: str) -> list[str]:
    """Unlink the segments of dead daemons named `name`, unless a live process holds the
    name's lock (then every segment of the name is its own: left alone).

    Returns:
        The names (in /dev/shm) of the segments unlinked.

    Raises:
        UnsafeLockDirectoryError, OSError: see `NameLock.try_acquire`.
    """
    lock = NameLock.try_acquire(name)
    if lock is None:
        return []
    with lock:
        return unlink_orphans(lock)
