"""Local security: the socket's directory, --allow-group with a real second uid, admin
requests, orphans of a SIGKILLed daemon, and the file descriptor limit.

Real daemon processes throughout. The tests that need another uid (chown, useradd) run
as root and are skipped otherwise, with the reason.
"""

import grp
import json
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import psutil
import pytest

from conftest import start_daemon
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Clear, ConfigGet, Ping
from lmcached.shm.arena import SEGMENT_HEADER, Arena
from lmcached.shm.janitor import list_segments
from test_engine_multiprocess import run_worker
from lmcached.wire.socket_path import (
    UnsafeSocketPathError,
    check_client_socket_directory,
    check_socket_directory,
    default_socket_path,
    prepare_socket_directory,
)

OTHER_UID = 54321  # a uid nobody on the machine is expected to use
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root: chown to another uid")
DEADLINE_S = 15.0


def serve_expecting_failure(name: str, sock: str, *args: str) -> subprocess.CompletedProcess:
    """Run `lmcached serve`, which must exit at once with status 1."""
    proc = subprocess.run(
        [sys.executable, "-m", "lmcached.cli", "serve", "--name", name, "--socket", sock,
         "--capacity", "16MiB", *args],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return proc


def wait_for(predicate, what: str, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# ------------------------------------------------------------- the socket's directory
@needs_root
def test_daemon_refuses_a_directory_owned_by_another_uid(unique_name, short_tmp):
    directory = os.path.join(short_tmp, "theirs")
    os.mkdir(directory, 0o700)
    os.chown(directory, OTHER_UID, -1)
    proc = serve_expecting_failure(unique_name, os.path.join(directory, "d.sock"))
    assert f"{directory} is owned by uid {OTHER_UID}" in proc.stderr
    assert os.listdir(directory) == [] and list_segments(unique_name) == []


@pytest.mark.parametrize(("mode", "message"), [
    (0o777, "is writable by every user (mode 0777)"),
    (0o770, "a member could replace the socket. Make it 0750"),
])
def test_daemon_refuses_a_directory_others_can_write(unique_name, short_tmp, mode, message):
    directory = os.path.join(short_tmp, "open")
    os.mkdir(directory)
    os.chmod(directory, mode)
    proc = serve_expecting_failure(unique_name, os.path.join(directory, "d.sock"))
    assert message in proc.stderr
    assert os.listdir(directory) == []


def test_daemon_refuses_a_symlinked_directory(unique_name, short_tmp):
    target = os.path.join(short_tmp, "target")
    os.mkdir(target, 0o700)  # a fine directory: the symlink is what is refused
    link = os.path.join(short_tmp, "link")
    os.symlink(target, link)
    proc = serve_expecting_failure(unique_name, os.path.join(link, "d.sock"))
    assert f"{link} is a symlink" in proc.stderr
    assert os.listdir(target) == []


@pytest.mark.parametrize("exists", [True, False])
def test_daemon_refuses_a_directory_below_a_world_writable_one(unique_name, short_tmp, exists):
    """Someone who can write a parent could swap the directory after the check; and the
    daemon creates nothing there."""
    parent = os.path.join(short_tmp, "public")
    os.mkdir(parent)
    os.chmod(parent, 0o777)  # not sticky, unlike /tmp
    directory = os.path.join(parent, "mine")
    if exists:
        os.mkdir(directory, 0o700)
    proc = serve_expecting_failure(unique_name, os.path.join(directory, "d.sock"))
    assert f"{parent} is writable by every user (mode 0777, not sticky)" in proc.stderr
    assert os.listdir(parent) == (["mine"] if exists else [])


def test_daemon_never_removes_a_file_that_is_not_a_socket(unique_name, short_tmp):
    path = os.path.join(short_tmp, "d.sock")
    with open(path, "w") as f:
        f.write("precious")
    proc = serve_expecting_failure(unique_name, path)
    assert "is a regular file, not a socket: refusing to remove it" in proc.stderr
    with open(path) as f:
        assert f.read() == "precious"
    assert list_segments(unique_name) == []


def test_daemon_removes_a_stale_socket_and_starts(daemon_factory, short_tmp):
    path = os.path.join(short_tmp, "0.sock")  # where daemon_factory puts its first daemon
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # nobody listens; the file stays
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "1MiB")
    assert daemon.socket == path
    assert "removed stale socket" in daemon.log()
    with Connection(path) as conn:
        conn.request(Ping())


def test_daemon_refuses_a_socket_path_where_a_daemon_listens(daemon, unique_name):
    proc = serve_expecting_failure(unique_name + "-2", daemon.socket)
    assert "another lmcached daemon is listening" in proc.stderr
    with Connection(daemon.socket) as conn:
        conn.request(Ping())


def test_daemon_creates_missing_directories_0700(short_tmp, unique_name):
    sock = os.path.join(short_tmp, "a", "b", "d.sock")
    daemon = start_daemon(unique_name, sock, os.path.join(short_tmp, "d.log"),
                          "--capacity", "16MiB")
    try:
        for directory in (os.path.join(short_tmp, "a"), os.path.join(short_tmp, "a", "b")):
            st = os.lstat(directory)
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
            assert st.st_uid == os.geteuid()
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    finally:
        daemon.stop()


@needs_root
@pytest.mark.parametrize("attack", ["world_writable", "symlink", "other_owner"])
def test_tmp_fallback_of_a_user_is_refused_when_prepared_by_someone_else(monkeypatch, attack):
    """/tmp/lmcached-<uid>: the default socket directory without systemd or XDG_RUNTIME_DIR,
    the one another local user can make first. Checked as the daemon of uid OTHER_UID."""
    for name in ("LMCACHED_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "getuid", lambda: OTHER_UID)
    monkeypatch.setattr(os, "geteuid", lambda: OTHER_UID)
    sock = default_socket_path("llama")
    directory = os.path.dirname(sock)
    assert directory == f"/tmp/lmcached-{OTHER_UID}"
    if os.path.lexists(directory):
        pytest.skip(f"{directory} exists on this machine")
    decoy = tempfile.mkdtemp(prefix="lmc-decoy-", dir="/tmp")
    try:
        if attack == "world_writable":  # the user's own uid, but 0777
            os.mkdir(directory)
            os.chmod(directory, 0o777)
            os.chown(directory, OTHER_UID, -1)
            expected = "writable by every user"
        elif attack == "symlink":  # to a directory that the user even owns
            os.chown(decoy, OTHER_UID, -1)
            os.symlink(decoy, directory)
            expected = "is a symlink"
        else:
            os.mkdir(directory, 0o700)
            os.chown(directory, OTHER_UID + 1, -1)
            expected = f"owned by uid {OTHER_UID + 1}"
        with pytest.raises(UnsafeSocketPathError, match=expected):
            prepare_socket_directory(sock)
        with pytest.raises(UnsafeSocketPathError, match=expected):
            check_client_socket_directory(sock)
        assert os.listdir(decoy) == []
    finally:
        if os.path.islink(directory):
            os.unlink(directory)
        elif os.path.isdir(directory):
            shutil.rmtree(directory)
        shutil.rmtree(decoy, ignore_errors=True)


@needs_root
@pytest.mark.parametrize("attack", ["other_owner", "symlink"])
def test_a_squatted_tmp_fallback_names_its_owner_and_the_ways_out(monkeypatch, attack):
    """Another user made /tmp/lmcached-<uid> first (a directory, or a symlink): in sticky
    /tmp only he or root can remove it. The refusal names him (uid and name) and the ways
    out: remove it as root, or another directory (--socket, XDG_RUNTIME_DIR)."""
    import pwd

    squatter = pwd.getpwnam("nobody")
    for name in ("LMCACHED_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "getuid", lambda: OTHER_UID)
    monkeypatch.setattr(os, "geteuid", lambda: OTHER_UID)
    sock = default_socket_path("default")
    directory = os.path.dirname(sock)
    if os.path.lexists(directory):
        pytest.skip(f"{directory} exists on this machine")
    try:
        if attack == "other_owner":
            os.mkdir(directory, 0o700)
            os.chown(directory, squatter.pw_uid, -1)
        else:
            os.symlink(tempfile.gettempdir(), directory)
            os.lchown(directory, squatter.pw_uid, -1)
        for check in (prepare_socket_directory, check_client_socket_directory):
            with pytest.raises(UnsafeSocketPathError) as refused:
                check(sock)
            message = str(refused.value)
            assert f"uid {squatter.pw_uid} (nobody)" in message, message
            for way_out in (f"Remove it as root (sudo rm", f" {directory})", "--socket PATH",
                            "set XDG_RUNTIME_DIR"):
                assert way_out in message, message
    finally:
        if os.path.islink(directory):
            os.unlink(directory)
        elif os.path.isdir(directory):
            shutil.rmtree(directory)


@needs_root
def test_client_trusts_another_users_directory_only_where_only_root_could_make_it(short_tmp):
    """/run/lmcached (root's parent, 0755) of a daemon running as `lmcached` is fine;
    the same directory in a sticky world-writable parent (/tmp) could be anybody's."""
    root_only = os.path.join(short_tmp, "run")  # owned by root, 0755: like /run
    os.mkdir(root_only, 0o755)
    directory = os.path.join(root_only, "lmcached")
    os.mkdir(directory, 0o750)
    os.chown(directory, OTHER_UID, -1)
    check_client_socket_directory(os.path.join(directory, "d.sock"))
    with pytest.raises(UnsafeSocketPathError, match="owned by uid"):
        check_socket_directory(os.path.join(directory, "d.sock"))  # not the daemon's own

    sticky = os.path.join(short_tmp, "tmp")
    os.mkdir(sticky)
    os.chmod(sticky, 0o1777)
    theirs = os.path.join(sticky, "lmcached-0")
    os.mkdir(theirs, 0o750)
    os.chown(theirs, OTHER_UID, -1)
    with pytest.raises(UnsafeSocketPathError, match=f"owned by uid {OTHER_UID}"):
        check_client_socket_directory(os.path.join(theirs, "d.sock"))
    mine = os.path.join(sticky, "mine")
    os.mkdir(mine, 0o700)
    check_client_socket_directory(os.path.join(mine, "d.sock"))


def test_client_check_passes_a_missing_directory_and_refuses_a_symlink(short_tmp):
    check_client_socket_directory(os.path.join(short_tmp, "absent", "d.sock"))
    os.symlink(short_tmp, os.path.join(short_tmp, "link"))
    with pytest.raises(UnsafeSocketPathError, match="is a symlink"):
        check_client_socket_directory(os.path.join(short_tmp, "link", "d.sock"))


@pytest.mark.parametrize(
    ("mode", "check", "problem", "fix"),
    [
        (0o777, check_socket_directory, "writable by every user", "chmod 0700 {dir}"),
        (0o770, check_socket_directory, "mode 0770", "chmod 0750 {dir}"),
        (0o777, check_client_socket_directory, "writable by every user", "chmod 0700 {dir}"),
        ("symlink", check_socket_directory, "is a symlink", "rm {dir}"),
        ("symlink", check_client_socket_directory, "is a symlink", "rm {dir}"),
    ],
    ids=["daemon-0777", "daemon-0770", "client-0777", "daemon-symlink", "client-symlink"],
)
def test_an_unsafe_socket_directory_is_a_value_error_naming_the_path_and_the_fix(
        short_tmp, mode, check, problem, fix):
    # Callers (config, CLI, DaemonLink.connect) catch ValueError: the error must be one.
    directory = os.path.join(short_tmp, "sockets")
    if mode == "symlink":
        os.mkdir(os.path.join(short_tmp, "target"), 0o700)
        os.symlink(os.path.join(short_tmp, "target"), directory)
    else:
        os.mkdir(directory)
        os.chmod(directory, mode)
    sock = os.path.join(directory, "d.sock")
    with pytest.raises(ValueError) as excinfo:
        check(sock)
    message = str(excinfo.value)
    assert sock in message and problem in message, message
    assert fix.format(dir=directory) in message, message


@pytest.mark.parametrize("check", [check_socket_directory, check_client_socket_directory])
@pytest.mark.parametrize("where", ["/tmp", "sticky 1777 of ours"])
def test_a_socket_in_a_shared_directory_is_refused_with_a_private_subdirectory_as_the_fix(
        short_tmp, check, where):
    """/tmp itself (root's, 1777) or any sticky world-writable directory: the advice is a
    private subdirectory, never a change to the shared directory's mode."""
    directory = "/tmp"
    if where != "/tmp":
        directory = os.path.join(short_tmp, "shared")
        os.mkdir(directory)
        os.chmod(directory, 0o1777)
    sock = os.path.join(directory, f"lmc-test-{os.getpid()}.sock")
    with pytest.raises(UnsafeSocketPathError) as excinfo:
        check(sock)
    message = str(excinfo.value)
    assert f"{directory} is a shared directory, writable by every user (mode 01777)" in message
    assert "Never change its mode: use a private subdirectory" in message, message
    assert f"--socket {directory}/lmcached-{os.geteuid()}/NAME.sock" in message, message
    assert "chmod" not in message, message


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("LMCACHED_SOCKET", "{tmp}/explicit/x.sock", "{tmp}/explicit/x.sock"),
        ("RUNTIME_DIRECTORY", "{tmp}/run:{tmp}/other", "{tmp}/run/llama.sock"),
        ("XDG_RUNTIME_DIR", "{tmp}/xdg", "{tmp}/xdg/lmcached/llama.sock"),
    ],
    ids=["LMCACHED_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"],
)
def test_daemon_client_and_cli_find_the_same_default_socket(monkeypatch, short_tmp, variable,
                                                            value, expected):
    from click.testing import CliRunner

    from lmcached.cli import main
    from lmcached.client.daemon_link import DaemonLink
    from lmcached.config import load_config
    from lmcached.wire import socket_path

    for name in ("LMCACHED_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket_path, "RUN_DIRECTORY", os.path.join(short_tmp, "run-lmcached"))
    monkeypatch.setenv(variable, value.format(tmp=short_tmp))
    expected = expected.format(tmp=short_tmp)
    daemon_side = load_config({"name": "llama", "capacity": "1MiB"}, check_shm_free=False)
    assert daemon_side.socket == expected
    looked = socket_path.client_socket_paths("llama")  # the client looks there too
    assert expected in looked and (looked == [expected]) == (variable == "LMCACHED_SOCKET")
    result = CliRunner().invoke(main, ["ping", "--name", "llama"])  # no daemon there
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: no daemon is running on {', '.join(looked)}")
    os.makedirs(os.path.dirname(expected), 0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(expected)  # a daemon's socket there: a client given no path finds it
        listener.listen(1)  # accepts, never answers the HELLO
        link = DaemonLink(None, "llama", timeout_s=0.3)
        assert not link.try_connect() and link.socket_path == expected
        link.close()


# -------------------------------------------------- --allow-group with a real second uid
@pytest.fixture
def second_user():
    """A fresh user (own primary group) who is a member of a fresh group; both removed
    after the test. Skipped when not root or without useradd/groupadd."""
    if not IS_ROOT:
        pytest.skip("needs root to create a second user (useradd)")
    for tool in ("useradd", "groupadd", "userdel", "groupdel"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    tag = uuid.uuid4().hex[:8]
    group, user = f"lmcg{tag}", f"lmcu{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    try:
        subprocess.run(["useradd", "--no-create-home", "--user-group", "--groups", group,
                        "--shell", "/usr/sbin/nologin", user], check=True, capture_output=True)
        try:
            import pwd

            entry = pwd.getpwnam(user)
            yield {"user": user, "uid": entry.pw_uid, "gid": entry.pw_gid, "group": group,
                   "group_gid": grp.getgrnam(group).gr_gid}
        finally:
            subprocess.run(["userdel", user], check=False, capture_output=True)
    finally:
        subprocess.run(["groupdel", group], check=False, capture_output=True)


# Runs as root until everything is imported (the interpreter's own files may be out of
# the other user's reach, e.g. under /root), then becomes the other user for good:
# setgroups/setgid/setuid, as login would. Prints one JSON line.
CLIENT_AS_OTHER_USER = textwrap.dedent("""
    import json, os, sys
    import torch
    from lmcached.client import CacheEngine, KVLayout
    from lmcached.wire.connection import Connection, DaemonError, hello
    from lmcached.wire.protocol import Clear, Evict, Info, Ping, Shutdown

    sock, uid, gid, groups, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \\
        [int(g) for g in sys.argv[4].split(",") if g], sys.argv[5]
    layout = KVLayout("security-llama", num_layers=2, num_kv_heads=2, head_size=16,
                      chunk_size=16)
    tokens = list(range(1000, 1064))
    kv = torch.randn(layout.chunk_shape(len(tokens)), generator=torch.Generator().manual_seed(7))
    kv = kv.to(layout.torch_dtype)
    torch.equal(kv, kv.clone())
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    out = {"uid": os.getuid(), "euid": os.geteuid(), "groups": sorted(os.getgroups())}
    if mode.startswith("forge:"):  # overwrite the arena's header (magic, generation...), then use
        with open(mode.removeprefix("forge:"), "r+b") as f:
            f.write(bytes([255]) * 48)
        mode = "use"
    if mode == "use":
        with CacheEngine.connect(layout, socket=sock, strict=True) as engine:
            out["stored"] = engine.store(tokens, kv)
            got, ret_mask = engine.retrieve(tokens, return_tuple=False)
            out["hit_tokens"] = int(ret_mask.sum())
            out["bytes_equal"] = got is not None and torch.equal(got, kv)
        with Connection(sock) as conn:
            hello(conn, "member-admin")
            out["info_ok"] = bool(conn.request(Info()).sections)
            for request in (Shutdown(), Clear(), Evict(lru=1)):
                try:
                    conn.request(request)
                    out[type(request).__name__] = "allowed"
                except DaemonError as exc:
                    out[type(request).__name__] = exc.code
            conn.request(Ping())
            out["ping_after"] = True
    else:
        try:
            with Connection(sock, timeout_s=5) as conn:
                conn.request(Ping())
            out["connect"] = "answered"
        except OSError as exc:
            out["connect"] = type(exc).__name__
    print(json.dumps(out))
""")


def run_as(user: dict, sock: str, mode: str, groups: list[int]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT_AS_OTHER_USER, sock, str(user["uid"]), str(user["gid"]),
         ",".join(map(str, groups)), mode],
        capture_output=True, text=True, timeout=120, cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


CLI_AS_OTHER_USER = textwrap.dedent("""
    import os, sys
    from lmcached.cli import main  # imported first: the checkout may be root's alone
    os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1]))
    main(sys.argv[3:], prog_name="lmcached")
""")


def cli_as(user: dict, *args: str) -> str:
    """Run `lmcached ARGS` as `user`; returns its stderr (it must exit with status 1)."""
    proc = subprocess.run(
        [sys.executable, "-c", CLI_AS_OTHER_USER, str(user["uid"]), str(user["gid"]), *args],
        capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 1, proc.stderr
    return proc.stderr.strip()


@pytest.fixture
def group_socket_dir():
    """A socket directory the daemon creates itself, directly in /tmp (so that the other
    user can reach it); removed after."""
    parent = f"/tmp/lmc-sec-{uuid.uuid4().hex[:10]}"
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.slow
def test_allow_group_member_uses_the_cache_but_may_not_administer_it(
    second_user, group_socket_dir, unique_name, short_tmp
):
    group, group_gid = second_user["group"], second_user["group_gid"]
    sock = os.path.join(group_socket_dir, "d.sock")
    daemon = start_daemon(unique_name, sock, os.path.join(short_tmp, "d.log"),
                          "--capacity", "32MiB", "--allow-group", group)
    try:
        dir_st = os.lstat(group_socket_dir)
        assert (stat.S_IMODE(dir_st.st_mode), dir_st.st_gid) == (0o750, group_gid)
        sock_st = os.stat(sock)
        assert (stat.S_IMODE(sock_st.st_mode), sock_st.st_gid) == (0o660, group_gid)
        (segment,) = list_segments(unique_name)
        seg_st = os.stat(f"/dev/shm/{segment}")
        assert (stat.S_IMODE(seg_st.st_mode), seg_st.st_gid) == (0o660, group_gid)

        # A member who overwrites the arena's header first locks nobody out.
        out = run_as(second_user, sock, f"forge:/dev/shm/{segment}", [group_gid])
        assert out["uid"] == out["euid"] == second_user["uid"] != 0
        assert out["stored"] == 4 and out["hit_tokens"] == 64 and out["bytes_equal"]
        assert out["info_ok"] and out["ping_after"]
        assert (out["Shutdown"], out["Clear"], out["Evict"]) == ("forbidden",) * 3

        with Connection(sock) as conn:  # the daemon's own uid may: it still serves
            hello(conn, "owner")
            assert conn.request(ConfigGet()).sections["config"]["allow_group"] == group
            assert conn.request(Clear()).count == 4
        assert daemon.info()["errors_forbidden"] == 3
        assert daemon.proc.poll() is None
        assert list_segments(unique_name) == [segment]
    finally:
        assert daemon.stop() == 0


@pytest.mark.slow
def test_without_allow_group_another_user_cannot_connect(
    second_user, group_socket_dir, unique_name, short_tmp
):
    sock = os.path.join(group_socket_dir, "d.sock")
    daemon = start_daemon(unique_name, sock, os.path.join(short_tmp, "d.log"),
                          "--capacity", "16MiB")
    try:
        assert stat.S_IMODE(os.stat(group_socket_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        groups = [second_user["group_gid"]]
        assert run_as(second_user, sock, "ping", groups)["connect"] == "PermissionError"
        assert cli_as(second_user, "ping", "--socket", sock) == (
            f"Error: permission denied on {sock}: connect as the daemon's user or root, or "
            "as a member of the group the daemon allows (--allow-group)")
        # Even past the file permissions, the daemon itself refuses the peer (SO_PEERCRED).
        os.chmod(group_socket_dir, 0o755)
        os.chmod(sock, 0o666)
        refused = run_as(second_user, sock, "ping", groups)["connect"]
        assert refused in ("ConnectionResetError", "ConnectionError", "BrokenPipeError",
                           "ConnectionAbortedError"), refused
        assert cli_as(second_user, "ping", "--socket", sock) == (
            f"Error: the daemon on {sock} closed the connection without answering: it is "
            "stopping, or it does not accept this user (see its log)")
        assert f"uid {second_user['uid']}" in daemon.log()
        with Connection(sock) as conn:
            conn.request(Ping())
    finally:
        assert daemon.stop() == 0


# A member of --allow-group subscribes to the event feed of its layout's namespace and
# pages all of it (snapshot, then the ring from 1), token ids asked for; it also tries to
# open the arena's segment. Prints one JSON line.
EVENTS_AS_OTHER_USER = textwrap.dedent("""
    import json, os, sys
    from lmcached.client import KVLayout
    from lmcached.wire.connection import Connection, hello
    from lmcached.wire.protocol import Events, Subscribe

    sock, uid, gid, groups, segment = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \\
        [int(g) for g in sys.argv[4].split(",") if g], sys.argv[5]
    layout = KVLayout("security-llama", num_layers=2, num_kv_heads=2, head_size=16,
                      chunk_size=16)
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    out = {"uid": os.getuid(), "events": []}
    try:
        with open(segment, "rb"):
            out["open_segment"] = "ok"
    except OSError as exc:
        out["open_segment"] = type(exc).__name__
    with Connection(sock) as conn:
        hello(conn, "member-events", [layout.to_wire()])
        conn.request(Subscribe([], 1, True))
        cursor = 1
        while True:
            reply = conn.request(Events(cursor, 0, True))
            out["events"] += [[e.seq, e.kind, e.chunk_hash.hex(), e.token_ids.hex()]
                              for e in reply.events]
            if not reply.events and not reply.snapshot_left and reply.cursor == cursor:
                break
            cursor = reply.cursor
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.parametrize("shm_mode", ["0600", "0660"])
def test_an_allow_group_member_gets_token_ids_only_if_it_can_read_the_arena(
    second_user, group_socket_dir, unique_name, short_tmp, shm_mode
):
    """With --shm-mode 0600 a member of --allow-group cannot open the arena, so the
    event feed gives it its namespace's events (snapshot and ring) without a byte of
    token ids, prompt content written by the daemon's user, and the daemon logs why;
    with 0660 it can, and each stored event carries exactly its chunk's token ids."""
    import numpy as np
    import torch

    from lmcached.client import CacheEngine, KVLayout
    from lmcached.wire.record_format import ROOT_HASH, hash_block_tokens

    group, group_gid = second_user["group"], second_user["group_gid"]
    sock = os.path.join(group_socket_dir, "d.sock")
    daemon = start_daemon(unique_name, sock, os.path.join(short_tmp, "d.log"),
                          "--capacity", "32MiB", "--allow-group", group, "--shm-mode", shm_mode)
    try:
        layout = KVLayout("security-llama", num_layers=2, num_kv_heads=2, head_size=16,
                          chunk_size=16)
        tokens = list(range(1000, 1064))
        kv = torch.zeros(layout.chunk_shape(len(tokens))).to(layout.torch_dtype)
        with CacheEngine.connect(layout, socket=sock, strict=True) as engine:
            assert engine.store(tokens, kv) == 4
        chunk_tokens, parent = {}, ROOT_HASH
        for start in range(0, 64, 16):
            ids = np.arange(1000 + start, 1016 + start, dtype=np.int64)
            parent = hash_block_tokens(parent, ids)
            chunk_tokens[parent.hex()] = ids.tobytes().hex()
        (segment,) = list_segments(unique_name)
        proc = subprocess.run(
            [sys.executable, "-c", EVENTS_AS_OTHER_USER, sock, str(second_user["uid"]),
             str(second_user["gid"]), str(group_gid), f"/dev/shm/{segment}"],
            capture_output=True, text=True, timeout=120, cwd="/")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["uid"] == second_user["uid"] != 0
        reads = shm_mode == "0660"
        assert out["open_segment"] == ("ok" if reads else "PermissionError")
        stored = [(seq > 0, chunk_hash) for seq, kind, chunk_hash, _ in out["events"]
                  if kind == "stored"]
        assert sorted(stored) == sorted((ring, h) for ring in (False, True)
                                        for h in chunk_tokens)
        assert [token_ids for _, _, _, token_ids in out["events"]] == [
            chunk_tokens[chunk_hash] if reads else "" for _, _, chunk_hash, _ in out["events"]]
        logged = "cannot read the arena's segment (--shm-mode): its events carry no token ids"
        assert (logged in daemon.log()) == (not reads)
    finally:
        assert daemon.stop() == 0


# ------------------------------------------------------------------------ orphans
SWEEP_AS_OTHER_USER = textwrap.dedent("""
    import json, os, sys
    from lmcached.shm.janitor import list_segments, sweep_orphans

    name, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    print(json.dumps({"removed": sweep_orphans(name),
                      "left": list_segments(name)}))
""")


def test_sweep_leaves_another_users_unreadable_segment_alone(second_user, unique_name):
    """A daemon of another user with the same name: its 0600 segment cannot be read (no
    header) nor unlinked by this user; the sweep must neither remove nor crash on it."""
    with Arena.create(unique_name, 4 << 20, 1 << 20, prefault=False) as arena:
        proc = subprocess.run(
            [sys.executable, "-c", SWEEP_AS_OTHER_USER, unique_name, str(second_user["uid"]),
             str(second_user["gid"])], capture_output=True, text=True, timeout=60, cwd="/",
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out == {"removed": [], "left": [arena.segment_name.lstrip("/")]}


def forge_owner(segment: str, pid: int, create_time: float) -> None:
    """Overwrite a segment's header as any client can: magic, generation, owner, sizes."""
    with open(f"/dev/shm/{segment}", "r+b") as f:
        f.write(SEGMENT_HEADER.pack(b"FORGED!!", 1, pid, create_time, 1 << 40, 64))


@pytest.mark.slow
def test_a_client_writing_the_arena_header_changes_nothing_for_others_or_the_daemon(
        unique_name, short_tmp):
    """A forged header (a dead owner pid among others) neither locks a new engine out nor
    lets a second daemon of the name take the live segment for an orphan."""
    sock = os.path.join(short_tmp, "d.sock")
    daemon = start_daemon(unique_name, sock, os.path.join(short_tmp, "d.log"),
                          "--capacity", "16MiB")
    try:
        assert run_worker("store", sock, 0, 64, 0, 1) == {"stored": 4}
        (segment,) = list_segments(unique_name)
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()  # reaped: its pid names no process
        forge_owner(segment, gone.pid, 0.0)
        assert run_worker("retrieve", sock, 0, 64, 0, 1) == {"hit": 64, "mismatches": 0}
        proc = serve_expecting_failure(unique_name, os.path.join(short_tmp, "other.sock"))
        assert (f"Error: another lmcached daemon named {unique_name} is already running "
                f"(pid {daemon.proc.pid}, it holds") in proc.stderr
        assert list_segments(unique_name) == [segment]
        assert run_worker("retrieve", sock, 0, 64, 0, 1) == {"hit": 64, "mismatches": 0}
        fields = daemon.info()
        assert (fields["hits"], fields["errors"]) == (8, 0)
    finally:
        assert daemon.stop() == 0
    assert list_segments(unique_name) == []


def test_restart_right_after_kill_9_removes_the_zombie_daemons_segment(unique_name, short_tmp):
    """The killed daemon is not reaped (this test is its parent): psutil still lists it,
    as a zombie. A new daemon of the same name, started at once, removes its segment,
    even when a client made its header name a live owner (this process)."""
    sock = os.path.join(short_tmp, "d.sock")
    first = start_daemon(unique_name, sock, os.path.join(short_tmp, "1.log"),
                         "--capacity", "16MiB")
    second = None
    try:
        (old_segment,) = list_segments(unique_name)
        os.kill(first.proc.pid, signal.SIGKILL)  # no wait(): it stays a zombie
        wait_for(lambda: psutil.Process(first.proc.pid).status() == psutil.STATUS_ZOMBIE,
                 "the killed daemon to become a zombie")
        me = psutil.Process()
        forge_owner(old_segment, me.pid, me.create_time())
        assert old_segment in list_segments(unique_name)
        second = start_daemon(unique_name, sock, os.path.join(short_tmp, "2.log"),
                              "--capacity", "16MiB")
        assert psutil.Process(first.proc.pid).status() == psutil.STATUS_ZOMBIE  # still
        segments = list_segments(unique_name)
        assert old_segment not in segments and len(segments) == 1
        assert "removed orphaned arena segment" in second.log()
        with Connection(sock) as conn:
            conn.request(Ping())
    finally:
        first.proc.wait(timeout=10)  # reap the zombie
        if second is not None:
            assert second.stop() == 0


# --------------------------------------------------------------- file descriptor limit
def _nofile(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_daemon_raises_its_soft_fd_limit_for_max_clients(daemon_factory):
    hard = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    if hard < 232:
        pytest.skip(f"the hard fd limit here is {hard}")
    daemon = daemon_factory("--capacity", "16MiB", "--max-clients", "200",
                            preexec_fn=_nofile(64, hard))
    assert psutil.Process(daemon.proc.pid).rlimit(psutil.RLIMIT_NOFILE) == (200 + 32, hard)
    with Connection(daemon.socket) as conn:
        assert conn.request(ConfigGet()).sections["config"]["max_clients"] == 200


def test_daemon_lowers_max_clients_to_what_the_hard_fd_limit_holds(daemon_factory):
    daemon = daemon_factory("--capacity", "16MiB", preexec_fn=_nofile(128, 256))
    assert psutil.Process(daemon.proc.pid).rlimit(psutil.RLIMIT_NOFILE) == (256, 256)
    with Connection(daemon.socket) as conn:
        assert conn.request(ConfigGet()).sections["config"]["max_clients"] == 256 - 32
    assert "max_clients lowered from 1024 to 224" in daemon.log()
