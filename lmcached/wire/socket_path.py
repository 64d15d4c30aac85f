"""Where the daemon's Unix socket lives, and whether its directory can be trusted.

Why this file exists: whoever can write the socket's directory can replace the socket
with one of his own, and then reads every client's requests (HELLO, keys) and answers
them. So, as ssh-agent, tmux and PostgreSQL do, the daemon listens only in a directory
that nobody else controls, and clients connect only through such a directory.

A socket directory is trusted when:

- it is a real directory (`lstat`: not a symlink), owned by the daemon's uid or root, and
  writable by its owner only: no group write bit (with `--allow-group` the group may
  enter it, 0750, but a member who could write it could replace the socket), no other
  write bit (a 0777 directory in /tmp is anybody's);
- every directory above it is owned by root or that uid, and writable by nobody else
  unless sticky (/tmp): otherwise someone else could rename the directory away after the
  check and put his own in its place. Symlinks above it are followed and their targets
  checked the same way.

A client (`check_client_socket_directory`) applies the same rules with its own uid,
except that it also accepts a directory of another user (the daemon's) when only root
could have put it there: its parent is owned by root and writable by nobody else, as
`/run/lmcached`, made by systemd for a daemon running as user `lmcached`. In /tmp, where
anybody can make a directory, the directory must be the client's own (or root's).

The daemon creates a missing directory itself (`prepare_socket_directory`): 0700, or
0750 and the allowed group with `--allow-group`.

Where the daemon listens (`default_socket_path`) depends on its environment; a client
(the CLI in an operator's shell, a worker) does not share it, so it looks in every place
a daemon of that name may listen, in a fixed order (`client_socket_paths`), as redis-cli
finds a packaged server with no options. Every client (the CLI, `CacheEngine`, the vLLM
connector, the demo) follows one rule: `daemon_socket_paths` says where to look,
`connect_first` connects to the first place a daemon answers, and its `NoDaemonError`
lists every place it looked.
"""

import errno
import grp
import os
import pwd
import socket
import stat
from collections.abc import Callable
from typing import TypeVar

from lmcached.wire import envs
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

DEFAULT_NAME = "default"
# RuntimeDirectory=lmcached of the systemd units (systemd/): the units' daemons listen
# here, and an operator's shell has no $RUNTIME_DIRECTORY that says so. Tests point it
# at a directory of their own.
RUN_DIRECTORY = "/run/lmcached"
MAX_SUN_PATH = 107  # bytes of a Unix socket path (sockaddr_un.sun_path, less the NUL)
_DIR_MODE = 0o700
_GROUP_DIR_MODE = 0o750


class UnsafeSocketPathError(ValueError):
    """The socket path or its directory could be controlled by another user.

    The message says what is wrong and how to fix it.
    """


def default_socket_path(name: str) -> str:
    """Where the daemon `name` listens when no socket is given.

    `$LMCACHED_SOCKET`, else `$RUNTIME_DIRECTORY/<name>.sock` under systemd (the
    default instance is `lmcached.sock`), else `$XDG_RUNTIME_DIR/lmcached/<name>.sock`,
    else `/tmp/lmcached-<uid>/<name>.sock`. The path is not checked here: the daemon
    (`prepare_socket_directory`) and clients (`check_client_socket_directory`) check
    its directory before they use it.
    """
    explicit = envs.get("LMCACHED_SOCKET")
    if explicit:
        return explicit
    runtime_dir = envs.get("RUNTIME_DIRECTORY")
    if runtime_dir:
        # systemd may list several directories separated by ':'; ours is the first.
        return _runtime_socket(runtime_dir.split(":")[0], name)
    return _user_socket_paths(name)[0]


def _runtime_socket(directory: str, name: str) -> str:
    """A systemd runtime directory's socket of daemon `name` (the default instance's is
    `lmcached.sock`, as the units name it)."""
    return os.path.join(directory, "lmcached.sock" if name == DEFAULT_NAME else f"{name}.sock")


def _user_socket_paths(name: str) -> list[str]:
    """`$XDG_RUNTIME_DIR/lmcached/<name>.sock` when that is set, then
    `/tmp/lmcached-<uid>/<name>.sock`."""
    xdg = envs.get("XDG_RUNTIME_DIR")
    paths = [os.path.join(xdg, "lmcached", f"{name}.sock")] if xdg else []
    return paths + [os.path.join(f"/tmp/lmcached-{os.getuid()}", f"{name}.sock")]


def client_socket_paths(name: str) -> list[str]:
    """Where a client looks for daemon `name` when it is given no socket, in order.

    `$LMCACHED_SOCKET` alone when it is set (an explicit path, as --socket); else
    `/run/lmcached/<name>.sock` (the systemd units' RUNTIME_DIRECTORY), then
    `$RUNTIME_DIRECTORY/<name>.sock` (a client running under systemd itself), then
    `$XDG_RUNTIME_DIR/lmcached/<name>.sock`, then `/tmp/lmcached-<uid>/<name>.sock`: the
    places `default_socket_path` chooses in the environments a daemon runs in. The
    default instance's file in a runtime directory is `lmcached.sock`. No path is
    checked here (`check_client_socket_directory` does that before connecting).

    Args:
        name: the daemon's name (--name, $LMCACHED_NAME, "default").

    Returns:
        One path or more, without duplicates.
    """
    explicit = envs.get("LMCACHED_SOCKET")
    if explicit:
        return [explicit]
    paths = [_runtime_socket(RUN_DIRECTORY, name)]
    runtime_dir = envs.get("RUNTIME_DIRECTORY")
    if runtime_dir:
        paths.append(_runtime_socket(runtime_dir.split(":")[0], name))
    paths += _user_socket_paths(name)
    return list(dict.fromkeys(paths))


CLI_HINT = "give --socket, or --name if the daemon has another name"
API_HINT = ("give socket=, or name= if the daemon has another name (or set LMCACHED_SOCKET, "
            "LMCACHED_NAME)")


def no_daemon_message(paths: list[str], hint: str = CLI_HINT) -> str:
    """The "no daemon" error of a client that looked in `paths` (in that order); `hint`
    says how to point it elsewhere, in the caller's terms (CLI options or arguments)."""
    if len(paths) == 1:
        return f"no daemon is running on {paths[0]}"
    return f"no daemon is running on {', '.join(paths)} (looked there in this order; {hint})"


class NoDaemonError(FileNotFoundError):
    """No daemon answered in any place a client looked (`connect_first`).

    A FileNotFoundError (callers that catch "no daemon" that way still do), whose message
    lists every place, in order.

    Attributes:
        paths: the sockets tried, in order.
    """

    def __init__(self, paths: list[str], hint: str = CLI_HINT) -> None:
        super().__init__(errno.ENOENT, no_daemon_message(paths, hint))
        self.paths = list(paths)

    def __str__(self) -> str:
        return self.strerror


def daemon_name(name: str | None = None) -> str:
    """The daemon a client looks for: `name` (--name, `name=`), else $LMCACHED_NAME, else
    "default"."""
    return name or envs.get("LMCACHED_NAME") or DEFAULT_NAME


def daemon_socket_paths(socket_path: str | None = None, name: str | None = None) -> list[str]:
    """Where a client looks for its daemon, in order: the one rule of every client.

    Args:
        socket_path: an explicit socket (--socket, `socket=`): the only place, if given.
        name: the daemon's name (`daemon_name`: else $LMCACHED_NAME, else "default").

    Returns:
        `[socket_path]`, else `client_socket_paths(daemon_name(name))` ($LMCACHED_SOCKET
        alone when set; else /run/lmcached, $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/lmcached,
        /tmp/lmcached-<uid>).
    """
    if socket_path:
        return [socket_path]
    return client_socket_paths(daemon_name(name))


_Conn = TypeVar("_Conn")


def connect_first(paths: list[str], connect: Callable[[str], _Conn],
                  hint: str = CLI_HINT) -> _Conn:
    """`connect(path)` for the first of `paths` where a daemon answers, each socket's
    directory checked first (`check_client_socket_directory`).

    A missing socket, or one nobody listens on (a stale file), is skipped: the next place
    may have the daemon. A socket this process may not open is remembered and skipped (a
    daemon of another user may come first, this user's later).

    Args:
        paths: `daemon_socket_paths(...)`.
        connect: opens a connection to one socket path; raises OSError when none.
        hint: how to point the client elsewhere, for `NoDaemonError`'s message.

    Returns:
        What `connect` returned.

    Raises:
        UnsafeSocketPathError: a directory another user could have placed the socket in.
        PermissionError: the first socket that refused this process, when no later one
            answered (its `filename` is that path).
        NoDaemonError: no daemon in any of `paths` (the message lists them).
        Whatever else `connect` raises (another OSError: a daemon that does not answer).
    """
    denied: PermissionError | None = None
    for path in paths:
        check_client_socket_directory(path)
        try:
            return connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            continue  # no daemon there (or a stale socket): the next place
        except PermissionError as exc:
            if denied is None:
                denied = PermissionError(exc.errno, exc.strerror or str(exc), path)
    if denied is not None:
        raise denied
    raise NoDaemonError(paths, hint)


def describe_user(uid: int) -> str:
    """`uid N (name)`, or `uid N` for a uid without a passwd entry: how errors name a user."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"group {grp.getgrgid(gid).gr_name}"
    except KeyError:
        return f"gid {gid}"


def _owners(uids: set[int]) -> str:
    return " or ".join(describe_user(uid) for uid in sorted(uids, reverse=True))


def check_ancestors(directory: str, trusted_uids: set[int], what: str, *,
                    held: str = "the socket", option: str = "--socket",
                    example: str = ", e.g. under $XDG_RUNTIME_DIR or /run") -> None:
    """Check every directory above `directory` (lexically and after resolving symlinks):
    owned by a trusted uid and writable by nobody else unless sticky (/tmp). Otherwise
    someone else could rename `directory` away after a check and put his own in its place.
    The socket's directory and the disk tier's (lmcached/daemon/disk/directory.py) both
    use it.

    Args:
        directory: the directory whose parents are checked (it need not exist).
        trusted_uids: the uids that may own a parent (the daemon's and root).
        what: the start of the error message (which setting is refused).
        held: what the directory holds, for the message ("the socket").
        option: the option that chooses another place ("--socket").
        example: said after the option in the message's fix.

    Raises:
        UnsafeSocketPathError: the first parent that fails, who could change it, and how
            to fix it.
        OSError: a parent cannot be examined (stat).
    """
    checked = set()
    for path in (os.path.abspath(directory), os.path.realpath(directory)):
        parent = os.path.dirname(path)
        while parent not in checked:
            checked.add(parent)
            st = os.stat(parent)  # follows a symlink: checks the directory it leads to
            if st.st_uid not in trusted_uids:
                raise UnsafeSocketPathError(
                    f"{what}: {parent} is owned by {describe_user(st.st_uid)}, who could replace "
                    f"the directories below it; put {held} in a directory whose parents "
                    f"belong to {_owners(trusted_uids)} ({option}{example})"
                )
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
                raise UnsafeSocketPathError(
                    f"{what}: {parent} is writable by "
                    f"{'every user' if st.st_mode & stat.S_IWOTH else _group(st.st_gid)} "
                    f"(mode 0{stat.S_IMODE(st.st_mode):o}, not sticky), who could replace the "
                    f"directories below it; fix it (chmod go-w {parent}) or choose another "
                    f"{option}"
                )
            parent = os.path.dirname(parent)


def _is_shared(st: os.stat_result) -> bool:
    """A directory others are meant to write (sticky, as /tmp and /dev/shm, or not ours):
    its mode is not ours to change, a private subdirectory is the fix."""
    return bool(st.st_mode & stat.S_ISVTX) or st.st_uid != os.geteuid()


def _check_directory(directory: str, trusted_uids: set[int], what: str) -> None:
    """The socket's own directory: a real directory, trusted owner, no group/other write."""
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeSocketPathError(
            f"{what}: {directory} is a symlink (to {os.readlink(directory)!r}) made by "
            f"{describe_user(st.st_uid)}; whoever controls its target controls the socket. "
            f"{_way_out(directory, st.st_uid, 'rm')}"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketPathError(f"{what}: {directory} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in trusted_uids:
        raise UnsafeSocketPathError(
            f"{what}: {directory} is owned by {describe_user(st.st_uid)}, not by "
            f"{_owners(trusted_uids)}; its owner could replace the socket (a leftover, or "
            f"made first by that user to take the socket). {_way_out(directory, st.st_uid, 'rm -r')}"
        )
    if mode & (stat.S_IWOTH | stat.S_IWGRP) and _is_shared(st):
        raise UnsafeSocketPathError(
            f"{what}: {directory} is a shared directory, writable by "
            f"{'every user' if mode & stat.S_IWOTH else _group(st.st_gid)} (mode 0{mode:o}); "
            f"anybody who may write it could replace the socket. Never change its mode: use a "
            f"private subdirectory, which the daemon creates 0700 (e.g. --socket "
            f"{os.path.join(directory, f'lmcached-{os.geteuid()}', 'NAME.sock')})"
        )
    if mode & stat.S_IWOTH:
        raise UnsafeSocketPathError(
            f"{what}: {directory} is writable by every user (mode 0{mode:o}); anybody could "
            f"replace the socket. Fix it (chmod 0700 {directory}) or remove it"
        )
    if mode & stat.S_IWGRP:
        raise UnsafeSocketPathError(
            f"{what}: {directory} is writable by {_group(st.st_gid)} (mode 0{mode:o}); a "
            f"member could replace the socket. Make it 0750 (chmod 0750 {directory}): "
            f"--allow-group needs the group to enter the directory, never to write it"
        )


def _way_out(directory: str, owner_uid: int, remove: str) -> str:
    """The fix of a socket directory (or symlink) that the daemon may not use: remove it
    (as root when another user made it: in a sticky directory such as /tmp only its owner
    and root may), or use another directory. For the default /tmp/lmcached-<uid>, which
    any local user can make first, the other directories are --socket and
    $XDG_RUNTIME_DIR (`default_socket_path`)."""
    if owner_uid == os.geteuid():
        removal = f"Remove it ({remove} {directory})"
    else:
        removal = f"Remove it as root (sudo {remove} {directory})"
    if directory != os.path.dirname(_user_socket_paths(DEFAULT_NAME)[-1]):
        return f"{removal} and let the daemon create the directory, or choose another --socket"
    return (f"{removal} and let the daemon create the directory, or give the daemon and its "
            f"clients another directory: --socket PATH, or set XDG_RUNTIME_DIR (they then use "
            f"$XDG_RUNTIME_DIR/lmcached; a login session has /run/user/{os.getuid()})")


def check_socket_directory(socket_path: str) -> None:
    """Check that the directory of the daemon's socket is the daemon's alone.

    The same rules hold with --allow-group: its members need to enter the directory
    (0750, see `group_can_enter`), never to write it.

    Args:
        socket_path: the socket the daemon will listen on.

    Raises:
        UnsafeSocketPathError: a symlink, not a directory, owned by another uid than the
            daemon's or root, writable by group or others, or below a directory someone
            else could change (the message says which and how to fix it).
        FileNotFoundError: the directory does not exist (see `prepare_socket_directory`).
    """
    directory = os.path.dirname(os.path.abspath(socket_path))
    trusted = {0, os.geteuid()}
    what = f"unsafe socket directory for {socket_path}"
    _check_directory(directory, trusted, what)
    check_ancestors(directory, trusted, what)


def group_can_enter(socket_path: str, gid: int) -> bool:
    """True when members of group `gid` may search the socket's directory."""
    st = os.stat(os.path.dirname(os.path.abspath(socket_path)))
    return bool(st.st_mode & stat.S_IXOTH or (st.st_gid == gid and st.st_mode & stat.S_IXGRP))


def prepare_socket_directory(socket_path: str, allow_group_gid: int | None = None) -> None:
    """Create the socket's directory if missing, then check it (daemon start-up).

    Missing directories are made one at a time, 0700 (0750 and group `allow_group_gid`
    with --allow-group), and each is re-opened with O_NOFOLLOW and checked to be ours
    before its mode is set, so a directory someone else slipped in is refused.

    Args:
        socket_path: the socket the daemon will listen on.
        allow_group_gid: gid of the `--allow-group` group, or None.

    Raises:
        UnsafeSocketPathError: see `check_socket_directory`.
        OSError: a directory cannot be created (e.g. no permission).
    """
    directory = os.path.dirname(os.path.abspath(socket_path))
    missing = []
    path = directory
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    what = f"unsafe socket directory for {socket_path}"
    if missing:  # never create anything below a directory someone else controls
        check_ancestors(missing[-1], {0, os.geteuid()}, what)
    for path in reversed(missing):
        try:
            os.mkdir(path, _DIR_MODE)
        except FileExistsError:
            continue  # made by someone else meanwhile: the check below judges it
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                raise UnsafeSocketPathError(f"{what}: {path} was replaced while being created")
            if allow_group_gid is not None:
                os.fchown(fd, -1, allow_group_gid)
                os.fchmod(fd, _GROUP_DIR_MODE)
            else:
                os.fchmod(fd, _DIR_MODE)  # whatever the umask
        finally:
            os.close(fd)
    check_socket_directory(socket_path)


def check_client_socket_directory(socket_path: str) -> None:
    """Check, before connecting, that nobody but the daemon's user could have put the
    socket there (a client's side of `check_socket_directory`).

    Trusted owners of the directory: this process's uid, root, and any user when the
    directory's parent is root's and writable by root only (so only root could have made
    it, e.g. systemd's RuntimeDirectory /run/lmcached of a daemon running as `lmcached`).

    Args:
        socket_path: the daemon's socket.

    Raises:
        UnsafeSocketPathError: the directory is a symlink, writable by group or others,
            owned by an untrusted user, or below a directory someone else could change.
            A missing directory is not an error here (connecting then fails with
            FileNotFoundError, as for any daemon that is not running).
    """
    directory = os.path.dirname(os.path.abspath(socket_path))
    trusted = {0, os.geteuid()}
    what = f"not connecting to {socket_path}: unsafe socket directory"
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    if not stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
        parent = os.stat(os.path.dirname(directory))
        if parent.st_uid == 0 and not parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            trusted = trusted | {st.st_uid}  # only root could have made it: the daemon's
    _check_directory(directory, trusted, what)
    check_ancestors(directory, {0, os.geteuid()}, what)


def claim_socket_path(path: str) -> None:
    """Refuse a socket path that is too long, is not a socket, or has a daemon
    listening; remove a stale socket (one nobody listens on: its daemon is gone).

    Raises:
        RuntimeError: the reason, and what to do about it.
    """
    if len(path.encode()) > MAX_SUN_PATH:
        raise RuntimeError(f"socket path is longer than {MAX_SUN_PATH} bytes: {path}")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        kind = ("a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a regular file" if stat.S_ISREG(mode) else "not a socket")
        raise RuntimeError(
            f"{path} exists and is {kind}, not a socket: refusing to remove it; move it "
            f"away or choose another --socket"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # stale: nobody listens, its daemon is gone
        logger.info("removed stale socket %s", path)
    except OSError as exc:
        raise RuntimeError(
            f"cannot tell whether a daemon listens on {path} ({exc}); remove the socket "
            f"if none does"
        ) from None
    else:
        raise RuntimeError(f"another lmcached daemon is listening on {path}")
    finally:
        probe.close()
