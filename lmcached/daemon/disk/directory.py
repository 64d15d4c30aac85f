"""The disk tier's directory: created safe, checked like the socket's, held open, locked
by one daemon.

Why this file exists: the slot file holds every prompt the node cached, so whoever may
write its directory, or any directory above it, may plant records or read them; and two
daemons writing one slot file would overwrite each other's slots. The rules are the
socket directory's (lmcached/wire/socket_path.py, after OpenSSH's StrictModes): the
directory owned by the daemon's uid (or root), not writable by group or others, not a
symlink; every directory above it owned by that uid or root and writable by nobody else
unless sticky (`socket_path.check_ancestors`, the same code). A missing one is created
0700.

A check by path holds only for the directory that was there when it ran: someone who
could swap it for a symlink afterwards would get the files the daemon opens next. So the
directory is opened once (O_DIRECTORY | O_NOFOLLOW) and judged through that descriptor
(`DiskDirectory`), and every file in it is opened relative to the descriptor, never by
path (`DiskDirectory.open_file`: openat with O_NOFOLLOW and O_NONBLOCK, then fstat: a
regular file of the daemon's uid, mode 0600). Ownership of the directory is an
exclusive `flock` on `DIR/lock` (released by the kernel when the daemon dies, even by
SIGKILL), whose content names the holder's pid for the error message.
"""

import errno
import fcntl
import os
import stat

from lmcached.wire.logger import init_logger
from lmcached.wire.socket_path import UnsafeSocketPathError, check_ancestors, describe_user

logger = init_logger(__name__)

LOCK_NAME = "lock"
FILE_MODE = 0o600
_DIR_MODE = 0o700
_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class DiskDirectoryError(RuntimeError):
    """The disk directory or a file in it cannot be used; the message names the cause and
    the fix."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


class DiskDirectory:
    """A checked disk directory, held open: its files are opened relative to `fd`.

    Made by `prepare_disk_directory`; the disk tier closes it when it stops.

    Attributes:
        path: the directory's absolute path, for messages only (never opened again).
        fd: the directory's descriptor (O_DIRECTORY | O_NOFOLLOW), -1 once closed.
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    def file_path(self, name: str) -> str:
        """`name`'s path, for messages."""
        return os.path.join(self.path, name)

    def open_file(self, name: str, flags: int, *, create: bool = False) -> int:
        """Open the file `name` of the directory, relative to its descriptor, and check it.

        The entry is looked at first (fstatat, no symlink followed) and refused unless it
        is a regular file, so that nothing else is ever opened; then it is opened with
        O_NOFOLLOW | O_NONBLOCK (a FIFO put there meanwhile never blocks) and judged again
        through its descriptor (fstat): a regular file of the daemon's uid. A mode other
        than 0600 is set to 0600 (fchmod; logged). O_NONBLOCK is cleared before return.

        Args:
            name: a file name in the directory (no slash).
            flags: os.open flags (O_RDONLY, O_RDWR, O_DIRECT...); O_NOFOLLOW, O_NONBLOCK
                and O_CLOEXEC are added.
            create: create the file (mode 0600) when it is missing.

        Returns:
            The open descriptor (the caller closes it).

        Raises:
            DiskDirectoryError: the entry is a symlink, a FIFO, a device, a directory or
                a socket, or belongs to another uid (the message says what and how to fix
                it).
            FileNotFoundError: the file is missing and `create` is false.
            OSError: the file cannot be opened (EINVAL for an O_DIRECT that the
                filesystem refuses) or examined.
        """
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            if not create:
                raise
        else:
            self._check_entry(name, st)
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                     | (os.O_CREAT if create else 0), FILE_MODE, dir_fd=self.fd)
        try:
            st = os.fstat(fd)
            self._check_entry(name, st)
            if stat.S_IMODE(st.st_mode) != FILE_MODE:
                os.fchmod(fd, FILE_MODE)
                logger.warning("disk tier: %s had mode 0%o: set to 0%o (the daemon's user "
                               "only: it holds cached prompts)", self.file_path(name),
                               stat.S_IMODE(st.st_mode), FILE_MODE)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_entry(self, name: str, st: os.stat_result) -> None:
        path = self.file_path(name)
        if not stat.S_ISREG(st.st_mode):
            raise DiskDirectoryError(
                f"--disk-path {self.path}: {path} is {_kind(st.st_mode)}, not a regular file; "
                f"the daemon never opens it (a symlink would lead elsewhere, a FIFO would "
                f"block the start). Remove it (rm {path}) if it is not yours, then start "
                f"again: the daemon creates the file")
        if st.st_uid != os.geteuid():
            raise DiskDirectoryError(
                f"--disk-path {self.path}: {path} is owned by {describe_user(st.st_uid)}, not "
                f"by the daemon's user {describe_user(os.geteuid())}. Remove it (rm {path}) or "
                f"chown it to the daemon's user")

    def close(self) -> None:
        """Close the directory's descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def prepare_disk_directory(directory: str) -> DiskDirectory:
    """Create `directory` if missing (0700, parents too), check it and every directory
    above it, and open it.

    Args:
        directory: the `--disk-path` as given.

    Returns:
        The directory, held open (the caller closes it, `DiskDirectory.close`).

    Raises:
        DiskDirectoryError: a symlink, not a directory, owned by another uid than the
            daemon's or root, writable by group or others, or below a directory that
            another uid owns or may write (not sticky); or it cannot be created (the
            message says which and how to fix it).
    """
    path = os.path.abspath(directory)
    what = f"--disk-path {directory}"
    if os.path.islink(path):
        raise _symlink_error(path, what)
    try:
        missing = []
        top = path
        while not os.path.lexists(top):
            missing.append(top)
            top = os.path.dirname(top)
        # Never create anything below a directory someone else controls.
        check_ancestors(missing[-1] if missing else path, {0, os.geteuid()}, what,
                        held="the disk directory", option="--disk-path", example="")
        for made in reversed(missing):
            _make_directory(made, what)
        if missing:
            check_ancestors(path, {0, os.geteuid()}, what, held="the disk directory",
                            option="--disk-path", example="")
    except UnsafeSocketPathError as exc:
        raise DiskDirectoryError(str(exc)) from None
    except OSError as exc:
        raise DiskDirectoryError(f"{what}: cannot examine or create the directory: "
                                 f"{exc.strerror or exc}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise _symlink_error(path, what) from None
        if exc.errno == errno.ENOTDIR:
            raise DiskDirectoryError(f"{what} is not a directory") from None
        raise DiskDirectoryError(f"{what}: cannot open the directory: "
                                 f"{exc.strerror or exc}") from None
    try:
        _check_opened(fd, path, what)
    except BaseException:
        os.close(fd)
        raise
    return DiskDirectory(path, fd)


def _symlink_error(path: str, what: str) -> DiskDirectoryError:
    return DiskDirectoryError(
        f"{what} is a symlink (to {os.readlink(path)!r}); whoever controls its target "
        f"controls the cached prompts. Give the real directory as --disk-path")


def _make_directory(path: str, what: str) -> None:
    """mkdir `path` 0700 whatever the umask; one made meanwhile is judged by the caller."""
    try:
        os.mkdir(path, _DIR_MODE)
    except FileExistsError:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise DiskDirectoryError(f"{what}: {path} was replaced while being created")
        os.fchmod(fd, _DIR_MODE)
    finally:
        os.close(fd)


def _check_opened(fd: int, path: str, what: str) -> None:
    """The opened directory itself: a trusted owner, no group or other write bit."""
    st = os.fstat(fd)
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


class DirectoryLock:
    """An exclusive lock on a disk directory, held for the daemon's life.

    Args:
        directory: the checked directory (`prepare_disk_directory`); its `lock` file is
            opened relative to it (`DiskDirectory.open_file`).

    Raises:
        DiskDirectoryError: another process holds it (the message names its pid), or
            the lock file cannot be used (not a regular file of ours) or opened.
    """

    def __init__(self, directory: DiskDirectory) -> None:
        path = directory.file_path(LOCK_NAME)
        where = f"--disk-path {directory.path}"
        try:
            self._fd = directory.open_file(LOCK_NAME, os.O_RDWR, create=True)
        except OSError as exc:
            raise DiskDirectoryError(f"{where}: cannot open its lock file "
                                     f"{path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DiskDirectoryError(
                    f"{where} is used by another lmcached daemon (pid "
                    f"{holder}); two daemons never share a disk tier: give each its own "
                    f"--disk-path") from None
            raise DiskDirectoryError(f"{where}: cannot lock {path}: "
                                     f"{exc.strerror or exc}") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Drop the lock (idempotent); the lock file stays."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
