"""The disk tier's directory: created safe, checked like the socket's, locked by one daemon.

Why this file exists: the slot file holds every prompt the node cached, so whoever may
write its directory may plant records or read them; and two daemons writing one slot
file would overwrite each other's slots. The rules follow the socket directory's
(lmcached/wire/socket_path.py): owned by the daemon's uid (or root), not writable by
group or others, not a symlink; a missing one is created 0700. Ownership of the
directory is an exclusive `flock` on `DIR/lock` (released by the kernel when the daemon
dies, even by SIGKILL), whose content names the holder's pid for the error message.
"""

import errno
import fcntl
import os
import stat

from lmcached.wire.socket_path import describe_user

LOCK_NAME = "lock"
_DIR_MODE = 0o700


class DiskDirectoryError(RuntimeError):
    """The disk directory cannot be used; the message names the cause and the fix."""


def prepare_disk_directory(directory: str) -> str:
    """Create `directory` if missing (0700, parents too) and check that it is the daemon's.

    Args:
        directory: the `--disk-path` as given.

    Returns:
        Its absolute path.

    Raises:
        DiskDirectoryError: a symlink, not a directory, owned by another uid than the
            daemon's or root, or writable by group or others (the message says how to
            fix it), or it cannot be created.
    """
    path = os.path.abspath(directory)
    what = f"--disk-path {directory}"
    if not os.path.lexists(path):
        try:
            os.makedirs(path, _DIR_MODE)
        except FileExistsError:
            pass  # made meanwhile: judged below
        except OSError as exc:
            raise DiskDirectoryError(f"{what}: cannot create the directory: "
                                     f"{exc.strerror or exc}") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise DiskDirectoryError(
            f"{what} is a symlink (to {os.readlink(path)!r}); whoever controls its target "
            f"controls the cached prompts. Give the real directory as --disk-path")
    if not stat.S_ISDIR(st.st_mode):
        raise DiskDirectoryError(f"{what} is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise DiskDirectoryError(
            f"{what} is owned by {describe_user(st.st_uid)}, not by the daemon's user "
            f"{describe_user(os.geteuid())}; its owner could read or plant cached prompts. Use a "
            f"directory of the daemon's user (chown it, or choose another --disk-path)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DiskDirectoryError(
            f"{what} is writable by {'every user' if mode & stat.S_IWOTH else 'its group'} "
            f"(mode 0{mode:o}); they could replace the slot file. Fix it (chmod 0700 {path})")
    return path


class DirectoryLock:
    """An exclusive lock on a disk directory, held for the daemon's life.

    Args:
        directory: the checked directory (`prepare_disk_directory`).

    Raises:
        DiskDirectoryError: another process holds it (the message names its pid), or
            the lock file cannot be opened.
    """

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, LOCK_NAME)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DiskDirectoryError(f"--disk-path {directory}: cannot open its lock file "
                                     f"{path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DiskDirectoryError(
                    f"--disk-path {directory} is used by another lmcached daemon (pid "
                    f"{holder}); two daemons never share a disk tier: give each its own "
                    f"--disk-path") from None
            raise DiskDirectoryError(f"--disk-path {directory}: cannot lock {path}: "
                                     f"{exc.strerror or exc}") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Drop the lock (idempotent); the lock file stays."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
