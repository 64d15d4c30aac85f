"""The `lmcached` admin CLI against a real daemon, and without one (one line, exit 1)."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from lmcached import config, envs
from lmcached.cli import main
from lmcached.protocol import Alloc, Commit, Connection, Layout, hello

MiB = 1 << 20
LAYOUT = Layout("tiny-llama", 1, 0, "vllm", "bfloat16", 2, 2, 4, 16, 1000)
LMCACHED = os.path.join(os.path.dirname(sys.executable), "lmcached")
ADMIN_COMMANDS = [
    ["info"], ["clients"], ["ping"], ["evict", "--lru", "1"], ["clear", "--yes"], ["stop"],
    ["config"],
]
FIELD_LINE = re.compile(r"^[a-z][a-z0-9_]*:\S*$")


def run_cli(*args: str, env: dict | None = None, input: str | None = None):
    """Invoke the CLI in-process; an exception other than SystemExit fails the test."""
    result = CliRunner(env=env).invoke(main, list(args), input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"`lmcached {' '.join(args)}` raised") from result.exception
    return result


def hashes(*ids: int) -> bytes:
    return b"".join(i.to_bytes(16, "little") for i in ids)


def store_chunks(daemon, ids) -> Connection:
    """Store chunks `ids` through a fresh session, left open (the caller closes it)."""
    conn = Connection(daemon.socket)
    ns = hello(conn, "writer", LAYOUT).ns
    reply = conn.request(Alloc(ns, hashes(*ids), [1000] * len(ids)))
    conn.request(Commit(reply.block_ids))
    return conn


def info_json(daemon) -> dict:
    result = run_cli("info", "--json", "--socket", daemon.socket)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ------------------------------------------------------------------------------ info
def test_info_prints_sections_and_field_lines(daemon):
    result = run_cli("info", "--socket", daemon.socket)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    headers = [line for line in lines if line.startswith("# ")]
    assert headers == ["# Server", "# Memory", "# Blocks", "# Clients", "# Stats"]
    fields = [line for line in lines if line and not line.startswith("# ")]
    assert fields and all(FIELD_LINE.match(line) for line in fields), fields
    assert f"capacity_bytes:{64 * MiB}" in lines
    assert "capacity_human:64.00M" in lines
    assert "used_human:0B" in lines
    assert f"pid:{daemon.proc.pid}" in lines


def test_info_section_prints_only_that_section(daemon):
    result = run_cli("info", "memory", "--socket", daemon.socket)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "# Memory"
    assert [line for line in lines if line.startswith("#")] == ["# Memory"]
    assert "block_bytes:1048576" in lines and not any(x.startswith("pid:") for x in lines)


def test_info_json_is_machine_readable(daemon):
    store_chunks(daemon, [1, 2]).close()
    sections = info_json(daemon)
    assert list(sections) == ["server", "memory", "blocks", "clients", "stats"]
    assert sections["memory"]["capacity_bytes"] == 64 * MiB
    assert sections["memory"]["used_bytes"] == 2 * MiB  # two 1 MiB blocks
    assert sections["blocks"]["cached_values"] == 2
    assert sections["server"]["name"] == daemon.name


def test_info_unknown_section_fails_with_one_line(daemon):
    result = run_cli("info", "nosuch", "--socket", daemon.socket)
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "nosuch" in lines[0] and lines[0].startswith("lmcached:")


# ------------------------------------------------------------------ clients and ping
def test_clients_prints_one_line_per_client(daemon):
    workers = [Connection(daemon.socket) for _ in range(2)]
    for i, conn in enumerate(workers):
        hello(conn, f"worker-{i}", LAYOUT)
    try:
        result = run_cli("clients", "--socket", daemon.socket)
    finally:
        for conn in workers:
            conn.close()
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 3  # the two workers and the CLI's own session
    pid = os.getpid()
    assert all(re.match(rf"^id=\d+ pid={pid} name=\S+ ", line) for line in lines), lines
    assert sorted(re.search(r" name=(\S+)", line).group(1) for line in lines) == [
        "lmcached-cli", "worker-0", "worker-1"
    ]
    assert all(" pinned_blocks=0 " in line and " age_s=" in line for line in lines)


def test_clients_json_lists_sessions(daemon):
    result = run_cli("clients", "--json", "--socket", daemon.socket)
    assert result.exit_code == 0, result.output
    clients = json.loads(result.stdout)
    assert [c["name"] for c in clients] == ["lmcached-cli"]


def test_ping_prints_pong(daemon):
    result = run_cli("ping", "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (0, "PONG\n")


# ------------------------------------------------------------------- evict and clear
def test_evict_lru_and_key(daemon):
    conn = store_chunks(daemon, [1, 2, 3])
    conn.close()
    result = run_cli("evict", "--lru", "1", "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (0, "evicted 1\n")
    key = (1).to_bytes(16, "little").hex()  # the LRU victim was chunk 3 (tail first)
    result = run_cli("evict", "--key", key, "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (0, "evicted 1\n")
    result = run_cli("evict", "--key", key, "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (0, "evicted 0\n")  # already gone
    assert info_json(daemon)["blocks"]["cached_values"] == 1


@pytest.mark.parametrize(
    "args", [[], ["--lru", "1", "--key", "k"], ["--lru", "0"], ["--lru", "many"]]
)
def test_evict_needs_exactly_one_of_lru_or_key(daemon, args):
    store_chunks(daemon, [1]).close()
    result = run_cli("evict", *args, "--socket", daemon.socket)
    assert result.exit_code == 2
    assert "Usage:" in result.stderr
    assert info_json(daemon)["blocks"]["cached_values"] == 1  # nothing evicted


def test_clear_yes_evicts_everything_unpinned(daemon):
    store_chunks(daemon, [1, 2, 3]).close()
    result = run_cli("clear", "--yes", "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (0, "evicted 3\n")
    assert info_json(daemon)["blocks"]["cached_values"] == 0


def test_clear_asks_first_and_keeps_the_cache_when_refused(daemon):
    store_chunks(daemon, [1, 2]).close()
    result = run_cli("clear", "--socket", daemon.socket, input="n\n")
    assert result.exit_code == 1 and "Aborted" in result.stderr
    assert info_json(daemon)["blocks"]["cached_values"] == 2


# ------------------------------------------------------------------- config and stop
def test_config_shows_the_effective_configuration(daemon):
    result = run_cli("config", "--socket", daemon.socket)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "# Config"
    assert f"capacity_bytes:{64 * MiB}" in lines and "block_bytes:1048576" in lines
    assert f"socket:{daemon.socket}" in lines and "shm_mode:0600" in lines
    assert "prefault:1" in lines
    result = run_cli("config", "--json", "--socket", daemon.socket)
    assert json.loads(result.stdout)["name"] == daemon.name


def test_stop_stops_the_daemon_gracefully(daemon):
    result = run_cli("stop", "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (0, "stopping\n")
    assert daemon.proc.wait(timeout=15) == 0
    assert not os.path.exists(daemon.socket)


# ------------------------------------------------------------- finding the socket
def test_socket_comes_from_lmcached_socket(daemon):
    result = run_cli("ping", env={"LMCACHED_SOCKET": daemon.socket})
    assert (result.exit_code, result.stdout) == (0, "PONG\n")


def test_name_finds_the_socket_in_the_runtime_directory(daemon, short_tmp):
    """As under systemd: --name NAME means $RUNTIME_DIRECTORY/NAME.sock."""
    runtime_dir = os.path.join(short_tmp, "run")
    os.mkdir(runtime_dir)
    os.symlink(daemon.socket, os.path.join(runtime_dir, f"{daemon.name}.sock"))
    env = {"LMCACHED_SOCKET": None, "RUNTIME_DIRECTORY": runtime_dir}
    result = run_cli("ping", "--name", daemon.name, env=env)
    assert (result.exit_code, result.stdout) == (0, "PONG\n")
    result = run_cli("ping", "--name", "someone-else", env=env)
    assert result.exit_code == 1 and "someone-else.sock" in result.stderr


# -------------------------------------------------------------- the console script
def test_console_script_talks_to_the_daemon(daemon):
    proc = subprocess.run(
        [LMCACHED, "info", "server", "--socket", daemon.socket],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "# Server"
    assert f"name:{daemon.name}" in proc.stdout.splitlines()


# ------------------------------------------------------------------- no daemon
@pytest.fixture(params=["missing", "stale"])
def dead_socket(request, short_tmp) -> str:
    """A socket path where no daemon runs: no file at all, or a stale socket file."""
    path = os.path.join(short_tmp, "dead.sock")
    if request.param == "stale":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.close()  # the file stays; connecting is refused
    return path


@pytest.mark.parametrize("command", ADMIN_COMMANDS, ids=lambda c: c[0])
def test_admin_command_without_daemon_prints_one_line_and_exits_1(command, dead_socket):
    result = run_cli(*command, "--socket", dead_socket)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == f"lmcached: no daemon is running on {dead_socket}\n"


@pytest.mark.parametrize("command", ADMIN_COMMANDS, ids=lambda c: c[0])
def test_console_script_without_daemon_has_no_traceback(command, short_tmp):
    path = os.path.join(short_tmp, "dead.sock")
    proc = subprocess.run(
        [LMCACHED, *command, "--socket", path], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [f"lmcached: no daemon is running on {path}"]


# ------------------------------------------------------------------------------ help
def test_help_lists_the_commands_and_version():
    result = run_cli("--help")
    assert result.exit_code == 0
    for command in ("serve", "info", "clients", "ping", "evict", "clear", "stop", "config"):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.MULTILINE), command
    assert "--version" in result.stdout
    result = run_cli("--version")
    assert result.exit_code == 0 and re.search(r"\d+\.\d+\.\d+", result.stdout)


def test_admin_help_names_socket_options_and_environment():
    result = run_cli("info", "--help")
    assert result.exit_code == 0
    for needle in ("SECTION", "--json", "--socket", "LMCACHED_SOCKET", "--name"):
        assert needle in result.stdout, needle


def test_serve_help_names_every_option_and_environment_variable():
    proc = subprocess.run([LMCACHED, "serve", "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    for option in ("--config", "--name", "--socket", "--capacity", "--block-size",
                   "--shm-mode", "--log-level", "--allow-group", "--max-clients",
                   "--idle-timeout", "--buffer-budget"):
        assert option in proc.stdout, option
    daemon_vars = ["LMCACHED_CONFIG", *(f"LMCACHED_{key.upper()}"
                                        for key in config.Settings.__struct_fields__)]
    for name in daemon_vars:
        assert name in envs.ENV_VARS, name
        assert name in proc.stdout, name
