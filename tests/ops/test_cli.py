"""The `lmcached` admin CLI against a real daemon, and without one; every error one
`Error: ...` line and exit status 1, start-up errors of `lmcached serve` included."""

import importlib.metadata
import json
import os
import re
import resource
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from lmcached import config
from conftest import start_daemon
from lmcached.wire import envs
from lmcached.wire import socket_path as socket_paths
from lmcached.cli import main
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Alloc, Commit, Layout
from lmcached.shm.janitor import list_segments
from lmcached.daemon.admin_handlers import MAX_CLIENTS_PER_PAGE

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
    ns = hello(conn, "writer", [LAYOUT]).namespaces[0]
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
    assert headers == ["# Server", "# Memory", "# Blocks", "# Clients", "# Stats", "# L2",
                       "# Disk", "# Tenants"]
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
    assert list(sections) == ["server", "memory", "blocks", "clients", "stats", "l2", "disk",
                              "tenants"]
    assert sections["memory"]["capacity_bytes"] == 64 * MiB
    assert sections["memory"]["used_bytes"] == 2 * MiB  # two 1 MiB blocks
    assert sections["blocks"]["cached_values"] == 2
    assert sections["server"]["name"] == daemon.name


def test_info_unknown_section_is_a_usage_error_before_any_request(daemon):
    """Checked by the CLI (exit status 2, the sections listed), so a typo never reaches
    the daemon's error counters (the dashboard's error panel)."""
    connections = info_json(daemon)["stats"]["connections_received"]
    result = run_cli("info", "nosuch", "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (2, "")
    assert ("Invalid value for '[SECTION]': 'nosuch' is not one of 'server', 'memory', "
            "'blocks', 'clients', 'stats', 'l2', 'disk', 'tenants'.") in result.stderr
    stats = info_json(daemon)["stats"]
    assert stats["errors"] == 0 and "errors_bad_request" not in stats
    assert stats["connections_received"] == connections + 1  # info_json's: none between
    result = run_cli("info", "MEMORY", "--socket", daemon.socket)  # as INFO: any case
    assert result.exit_code == 0 and result.stdout.splitlines()[0] == "# Memory"


BLOCKS_NOTE = ("note: block_bytes and num_blocks are 0 because no client has sent a layout "
               "yet. The arena is allocated, but without --block-size it is cut into blocks "
               "when the first layout arrives (block size: that layout's chunk record, "
               "rounded up to 4 KiB, or cut in equal pieces where the arena would hold fewer "
               "than 16). Start the daemon with --block-size to cut it at start.\n")


def test_info_before_any_layout_says_why_there_are_no_blocks(daemon_factory):
    daemon = daemon_factory("--capacity", "8MiB")  # no --block-size
    for args in ([], ["memory"], ["blocks"]):
        result = run_cli("info", *args, "--socket", daemon.socket)
        assert result.exit_code == 0, result.output
        assert "num_blocks:0" in result.stdout or "block_bytes:0" in result.stdout
        assert result.stderr == BLOCKS_NOTE, args
    result = run_cli("info", "server", "--socket", daemon.socket)  # shows neither field
    assert (result.exit_code, result.stderr) == (0, "")
    assert json.loads(run_cli("info", "--json", "--socket", daemon.socket).stdout)
    assert run_cli("info", "--json", "--socket", daemon.socket).stderr == ""
    store_chunks(daemon, [1]).close()  # the first layout cuts the arena
    result = run_cli("info", "--socket", daemon.socket)
    assert result.exit_code == 0 and result.stderr == ""
    assert "block_bytes:4096" in result.stdout.splitlines()


def test_info_with_block_size_has_blocks_from_the_start(daemon):
    result = run_cli("info", "--socket", daemon.socket)
    assert result.exit_code == 0 and result.stderr == ""
    assert "num_blocks:63" in result.stdout.splitlines()  # (64 MiB - 4 KiB) // 1 MiB


# ------------------------------------------------------------------ clients and ping
def test_clients_prints_one_line_per_client(daemon):
    # More workers than one CLIENTS page holds: the CLI pages through the cursor.
    workers = [Connection(daemon.socket) for _ in range(MAX_CLIENTS_PER_PAGE + 2)]
    for i, conn in enumerate(workers):
        hello(conn, f"worker-{i}", [LAYOUT])
    try:
        result = run_cli("clients", "--socket", daemon.socket)
    finally:
        for conn in workers:
            conn.close()
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == len(workers) + 1  # the workers and the CLI's own session
    pid = os.getpid()
    assert all(re.match(rf"^id=\d+ pid={pid} name=\S+ ", line) for line in lines), lines
    assert sorted(re.search(r" name=(\S+)", line).group(1) for line in lines) == sorted(
        ["lmcached-cli"] + [f"worker-{i}" for i in range(len(workers))])
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


def test_clear_yes_evicts_everything(daemon):
    store_chunks(daemon, [1, 2, 3]).close()
    result = run_cli("clear", "--yes", "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (0, "evicted 3\n")
    assert info_json(daemon)["blocks"]["cached_values"] == 0


def test_clear_asks_first_and_keeps_the_cache_when_refused(daemon, monkeypatch):
    store_chunks(daemon, [1, 2]).close()
    monkeypatch.setattr("lmcached.cli._stdin_is_terminal", lambda: True)
    result = run_cli("clear", "--socket", daemon.socket, input="n\n")
    assert result.exit_code == 1 and "Aborted" in result.stderr
    assert info_json(daemon)["blocks"]["cached_values"] == 2


def test_clear_without_a_terminal_says_to_pass_yes(daemon):
    """In a script (no tty to ask on) clear printed only `Aborted!`."""
    store_chunks(daemon, [1, 2]).close()
    result = run_cli("clear", "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.endswith("Error: clear asks for confirmation on a terminal, and "
                                  "stdin is not one: pass --yes to clear without asking\n")
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


def test_stop_returns_once_the_daemon_has_exited(daemon):
    """`stop` waits for the daemon's exit: when it returns, the process is gone, its
    socket and arena removed, and the next command says there is no daemon (it printed
    `[Errno 104] Connection reset by peer` while the daemon was stopping)."""
    result = run_cli("stop", "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (0, "stopping\nstopped\n")
    assert daemon.proc.poll() == 0  # exited already (reaped here, not waited for)
    assert not os.path.exists(daemon.socket)
    assert not [s for s in list_segments() if s.startswith(f"lmcached.{daemon.name}.")]
    result = run_cli("ping", "--socket", daemon.socket)
    assert (result.exit_code, result.stderr) == (
        1, f"Error: no daemon is running on {daemon.socket}\n")


def test_stop_no_wait_returns_at_once(daemon):
    result = run_cli("stop", "--no-wait", "--socket", daemon.socket)
    assert (result.exit_code, result.stdout) == (0, "stopping\n")
    assert daemon.proc.wait(timeout=15) == 0
    assert not os.path.exists(daemon.socket)


# ------------------------------------------------------------- finding the socket
@pytest.fixture
def run_directory(monkeypatch, short_tmp) -> str:
    """A directory standing in for /run/lmcached (the systemd units' runtime directory),
    not created; no socket variable of the caller's environment leaks in."""
    path = os.path.join(short_tmp, "run-lmcached")
    monkeypatch.setattr(socket_paths, "RUN_DIRECTORY", path)
    for name in ("LMCACHED_SOCKET", "LMCACHED_NAME", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_name_alone_finds_the_daemon_the_units_start(run_directory, unique_name, short_tmp):
    """A unit's daemon listens on /run/lmcached/NAME.sock; an operator's shell has no
    $RUNTIME_DIRECTORY. `--name NAME` alone finds it, before /tmp/lmcached-<uid>."""
    os.mkdir(run_directory, 0o700)
    daemon = start_daemon(unique_name, os.path.join(run_directory, f"{unique_name}.sock"),
                          os.path.join(short_tmp, "units.log"), "--capacity", "8MiB")
    try:
        result = run_cli("info", "server", "--name", unique_name)
        assert result.exit_code == 0, result.output
        assert f"socket:{daemon.socket}" in result.stdout.splitlines()
        assert run_cli("ping", "--name", unique_name).stdout == "PONG\n"
    finally:
        assert daemon.stop() == 0
    assert not os.path.exists(daemon.socket)


def test_no_daemon_lists_every_place_it_looked_in_order(run_directory, monkeypatch, short_tmp):
    runtime_dir = os.path.join(short_tmp, "rt")
    monkeypatch.setenv("RUNTIME_DIRECTORY", runtime_dir)
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.path.join(short_tmp, "xdg"))
    result = run_cli("ping", "--name", "llama")
    assert (result.exit_code, result.stdout) == (1, "")
    looked = [os.path.join(run_directory, "llama.sock"), os.path.join(runtime_dir, "llama.sock"),
              os.path.join(short_tmp, "xdg", "lmcached", "llama.sock"),
              f"/tmp/lmcached-{os.getuid()}/llama.sock"]
    assert result.stderr == (f"Error: no daemon is running on {', '.join(looked)} (looked "
                             "there in this order; give --socket, or --name if the daemon "
                             "has another name)\n")


def test_a_stale_socket_on_the_way_is_passed_over(daemon, run_directory, monkeypatch):
    """A socket left in /run/lmcached by a dead daemon does not hide the live one."""
    os.mkdir(run_directory, 0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(os.path.join(run_directory, "lmcached.sock"))
    stale.close()
    monkeypatch.setenv("RUNTIME_DIRECTORY", os.path.dirname(daemon.socket))
    os.symlink(daemon.socket, os.path.join(os.path.dirname(daemon.socket), "lmcached.sock"))
    result = run_cli("ping")
    assert (result.exit_code, result.stdout) == (0, "PONG\n")


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
    assert result.stderr == f"Error: no daemon is running on {dead_socket}\n"


@pytest.mark.parametrize("command", ADMIN_COMMANDS, ids=lambda c: c[0])
def test_console_script_without_daemon_has_no_traceback(command, short_tmp):
    path = os.path.join(short_tmp, "dead.sock")
    proc = subprocess.run(
        [LMCACHED, *command, "--socket", path], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [f"Error: no daemon is running on {path}"]


# ------------------------------------------------------- version and unknown input
def test_version_is_the_installed_distributions():
    proc = subprocess.run([LMCACHED, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"lmcached, version {importlib.metadata.version('lmcached')}\n"


def test_an_unknown_command_is_a_usage_error_that_names_it():
    result = run_cli("infos")
    assert result.exit_code == 2 and result.stdout == ""
    assert "No such command 'infos'" in result.stderr


# ------------------------------------------ every admin command finds the socket alike
SOCKET_SOURCES = ["--socket", "LMCACHED_SOCKET", "--name", "LMCACHED_NAME", "default"]


@pytest.mark.parametrize("source", SOCKET_SOURCES)
@pytest.mark.parametrize("command", ADMIN_COMMANDS, ids=lambda c: c[0])
def test_admin_command_finds_the_socket_from_each_source(command, source, short_tmp,
                                                         run_directory):
    """Each admin command resolves its socket the same way: --socket, else
    $LMCACHED_SOCKET, else NAME (--name or $LMCACHED_NAME, default "default") in
    /run/lmcached, $RUNTIME_DIRECTORY, /tmp/lmcached-<uid>. No daemon runs: the error
    line names the paths it tried."""
    runtime_dir = os.path.join(short_tmp, "run")
    os.mkdir(runtime_dir, 0o700)
    explicit = os.path.join(short_tmp, "explicit.sock")
    env = {"LMCACHED_SOCKET": None, "LMCACHED_NAME": None, "RUNTIME_DIRECTORY": runtime_dir,
           "XDG_RUNTIME_DIR": None}
    args = []

    def looked(file: str, name: str) -> str:
        return (f"{os.path.join(run_directory, file)}, {os.path.join(runtime_dir, file)}, "
                f"/tmp/lmcached-{os.getuid()}/{name}.sock (looked there in this order; give "
                "--socket, or --name if the daemon has another name)")

    expected = {
        "--socket": explicit,
        "LMCACHED_SOCKET": explicit,
        "--name": looked("llama.sock", "llama"),
        "LMCACHED_NAME": looked("llama.sock", "llama"),
        "default": looked("lmcached.sock", "default"),
    }[source]
    if source == "--socket":
        args = ["--socket", explicit]
    elif source == "LMCACHED_SOCKET":
        env["LMCACHED_SOCKET"] = explicit
    elif source == "--name":
        args = ["--name", "llama"]
    elif source == "LMCACHED_NAME":
        env["LMCACHED_NAME"] = "llama"
    result = run_cli(*command, *args, env=env)
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == f"Error: no daemon is running on {expected}\n"


def test_socket_option_wins_over_lmcached_socket(daemon, short_tmp):
    dead = os.path.join(short_tmp, "dead.sock")
    result = run_cli("ping", "--socket", daemon.socket, env={"LMCACHED_SOCKET": dead})
    assert (result.exit_code, result.stdout) == (0, "PONG\n")


def test_lmcached_socket_wins_over_the_name(daemon, short_tmp):
    env = {"LMCACHED_SOCKET": daemon.socket, "RUNTIME_DIRECTORY": short_tmp}
    result = run_cli("ping", "--name", "someone-else", env=env)
    assert (result.exit_code, result.stdout) == (0, "PONG\n")


def test_serve_help_shows_each_option_with_its_environment_variable():
    proc = subprocess.run([LMCACHED, "serve", "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    options = ["--config", *(f"--{key.replace('_', '-')}"
                             for key in config.Settings.__struct_fields__
                             if not config.SETTINGS[key].hidden)]
    assert "--gpu-backend" not in proc.stdout  # hidden: for tests
    help_text = " ".join(proc.stdout.split())  # undo click's wrapping
    start = 0
    for i, option in enumerate(options):
        # this option's entry: from its name to the next option's, each looked for after
        # the entry before it (an entry's help may name another option)
        start = help_text.index(f" {option} ", start)
        end = (help_text.index(f" {options[i + 1]} ", start + 1) if i + 1 < len(options)
               else None)
        entry = help_text[start:end]
        name = "LMCACHED_" + option[2:].replace("-", "_").upper()
        assert name in envs.ENV_VARS, name
        assert f"[env var: {name}" in entry, entry
    config_entry = help_text[help_text.index(" --config "):help_text.index(" --name ")]
    assert "read from --config, else from $LMCACHED_CONFIG" in config_entry


# --------------------------------------------------- serve: where each setting comes from
DAEMON_VARS = [config.CONFIG_ENVVAR, *map(config.envvar_name, config.SETTINGS)]


@pytest.fixture
def started(monkeypatch):
    """`lmcached serve` with the daemon left out: the ServerConfigs it would have run.

    No LMCACHED_* or runtime directory variable of the caller's environment leaks in.
    """
    configs = []
    monkeypatch.setattr("lmcached.daemon.server.run_server", lambda cfg: configs.append(cfg) or 0)
    monkeypatch.setattr("lmcached.cli.configure_logging", lambda level: None)
    monkeypatch.setattr(config, "shm_free_bytes", lambda: 1 << 50)
    for name in (*DAEMON_VARS, "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    return configs


def serve(started: list, *args: str, env: dict | None = None):
    """Run `lmcached serve ARGS`; returns (result, the ServerConfig started or None)."""
    result = run_cli("serve", *args, env=env)
    return result, (started.pop() if started else None)


# key, its ServerConfig field, the value in the file (TOML), the environment, the command
# line, and the effective value of each source, the default last
SOURCES = [
    ("capacity", "capacity_bytes", '"8MiB"', "16MiB", "32MiB",
     (8 * MiB, 16 * MiB, 32 * MiB, config.default_capacity_bytes())),
    ("max_clients", "max_clients", "7", "9", "11", (7, 9, 11, 1024)),
    ("buffer_budget", "buffer_budget_bytes", "4194304", "2MiB", "4GB",
     (4 * MiB, 2 * MiB, 4 * 10**9, 128 * MiB)),
    ("name", "name", '"from-file"', "from-env", "from-flag",
     ("from-file", "from-env", "from-flag", "default")),
    ("log_level", "log_level", '"warning"', "error", "debug", ("WARNING", "ERROR", "DEBUG", "INFO")),
    ("shm_mode", "shm_mode", "0o640", "0660", "0600", (0o640, 0o660, 0o600, 0o600)),
]


@pytest.mark.parametrize(("key", "field", "in_file", "in_env", "on_line", "effective"), SOURCES,
                         ids=[source[0] for source in SOURCES])
def test_serve_takes_flag_over_env_over_file_over_default(
    started, tmp_path, key, field, in_file, in_env, on_line, effective
):
    from_file, from_env, from_line, default = effective
    path = tmp_path / "lmcached.toml"
    path.write_text(f"{key} = {in_file}\n")
    env_var, option = config.envvar_name(key), config.option_name(key)

    result, cfg = serve(started)
    assert result.exit_code == 0, result.output
    assert getattr(cfg, field) == default and cfg.config_file is None

    # wherever --config stands on the line, the file applies to every setting
    result, cfg = serve(started, "--idle-timeout", "1", "--config", str(path))
    assert result.exit_code == 0, result.output
    assert getattr(cfg, field) == from_file and cfg.config_file == str(path)
    result, cfg = serve(started, env={config.CONFIG_ENVVAR: str(path)})
    assert getattr(cfg, field) == from_file and cfg.config_file == str(path), result.output

    result, cfg = serve(started, "--config", str(path), env={env_var: in_env})
    assert getattr(cfg, field) == from_env, result.output

    result, cfg = serve(started, "--config", str(path), option, on_line, env={env_var: in_env})
    assert getattr(cfg, field) == from_line, result.output
    assert cfg.cli_options == {key: on_line}


def test_serve_reresolves_from_its_command_line_on_sighup(started, tmp_path):
    """SIGHUP calls load_config with cli_options: a flag still beats the env and the file."""
    path = tmp_path / "lmcached.toml"
    path.write_text('log_level = "warning"\nmax_clients = 7\n')
    result, cfg = serve(started, "--shm-mode", "0640", "--config", str(path), "--log-level",
                        "debug", env={"LMCACHED_LOG_LEVEL": "error"})
    assert result.exit_code == 0, result.output
    assert cfg.cli_options == {"shm_mode": "0640", "log_level": "debug"}
    path.write_text('log_level = "critical"\nmax_clients = 8\n')
    fresh = config.load_config({**cfg.cli_options, "capacity": cfg.capacity_bytes},
                               cfg.config_file, check_shm_free=False)
    assert (fresh.log_level, fresh.shm_mode, fresh.max_clients) == ("DEBUG", 0o640, 8)


@pytest.mark.parametrize(
    ("args", "env", "file_text", "message"),
    [
        ([], {"LMCACHED_MAX_CLIENTS": "lots"}, "",
         r"LMCACHED_MAX_CLIENTS: invalid value 'lots': Expected `int`, got `str`"),
        ([], {"LMCACHED_CAPACITY": "150%"}, "",
         r"LMCACHED_CAPACITY: percentage '150%' must be in \(0, 100\]"),
        ([], {}, 'max_clients = "10"\n',
         r"max_clients in \S+/bad.toml: invalid value '10': Expected `int`, got `str`"),
        ([], {}, "socket = 7\n", r"socket in \S+/bad.toml: invalid value 7: Expected `str`"),
        ([], {}, 'capacity = "8 parsecs"\n', r"capacity in \S+/bad.toml: cannot parse size"),
        (["--idle-timeout", "soon"], {}, "", r"--idle-timeout: invalid value 'soon'"),
        ([], {}, "capcity = 1\n", r"unknown keys in \S+/bad.toml: \['capcity'\]"),
    ],
)
def test_serve_refuses_a_bad_value_naming_its_source_and_starts_nothing(
    started, tmp_path, args, env, file_text, message
):
    path = tmp_path / "bad.toml"
    path.write_text(file_text)
    result, cfg = serve(started, "--config", str(path), *args, env=env)
    assert result.exit_code == 1 and cfg is None
    assert re.search(rf"^Error: {message}", result.stderr, re.MULTILINE), result.stderr


def test_serve_refuses_a_missing_config_file_naming_its_source(started, tmp_path):
    path = str(tmp_path / "absent.toml")
    result, cfg = serve(started, "--config", path)
    assert (result.exit_code, cfg) == (1, None)
    assert f"Error: --config: cannot read {path}: No such file" in result.stderr
    result, cfg = serve(started, env={config.CONFIG_ENVVAR: path})
    assert (result.exit_code, cfg) == (1, None)
    assert f"Error: LMCACHED_CONFIG: cannot read {path}" in result.stderr


# ------------------------------------------- serve: start-up errors are one Error line
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (INFO|WARNING) lmcached")


def serve_and_fail(name: str, socket_path: str, *args: str, preexec_fn=None) -> str:
    """Run `lmcached serve` that must not start; returns its one Error line, after
    checking status 1, nothing else on stderr but INFO/WARNING log lines, and no socket
    or segment left behind."""
    proc = subprocess.run(
        [sys.executable, "-m", "lmcached.cli", "serve", "--name", name, "--socket",
         socket_path, "--capacity", "8MiB", *args],
        capture_output=True, text=True, timeout=60, preexec_fn=preexec_fn)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if not LOG_LINE.match(line)]
    assert len(errors) == 1 and errors[0].startswith("Error: "), proc.stderr
    assert list_segments(name) == []
    return errors[0]


@pytest.mark.parametrize("source", ["file", "env"])
def test_an_allow_group_that_does_not_exist_is_refused_naming_its_source(
        unique_name, short_tmp, monkeypatch, source):
    """Like every other setting error (its group is looked up at start-up)."""
    path = os.path.join(short_tmp, "d.toml")
    with open(path, "w") as f:
        f.write('allow_group = "no-such-group-lmc"\n')
    if source == "file":
        args, label = ("--config", path), f"allow_group in {path}"
    else:
        monkeypatch.setenv("LMCACHED_ALLOW_GROUP", "no-such-group-lmc")
        args, label = (), "LMCACHED_ALLOW_GROUP"
    assert serve_and_fail(unique_name, os.path.join(short_tmp, "d.sock"), *args) == (
        f"Error: {label}: no group named 'no-such-group-lmc' (getent group lists them)")


def test_serve_with_an_unsafe_socket_directory_is_one_error_line(unique_name, short_tmp):
    shared = os.path.join(short_tmp, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    path = os.path.join(shared, "d.sock")
    assert serve_and_fail(unique_name, path) == (
        f"Error: unsafe socket directory for {path}: {shared} is writable by every user "
        f"(mode 0777); anybody could replace the socket. Fix it (chmod 0700 {shared}) or "
        "remove it")
    in_tmp = f"/tmp/{unique_name}.sock"
    assert serve_and_fail(unique_name, in_tmp) == (
        f"Error: unsafe socket directory for {in_tmp}: /tmp is a shared directory, writable by "
        f"every user (mode 01777); anybody who may write it could replace the socket. Never "
        f"change its mode: use a private subdirectory, which the daemon creates 0700 (e.g. "
        f"--socket /tmp/lmcached-{os.geteuid()}/NAME.sock)")
    assert not os.path.exists(in_tmp)
    not_a_dir = os.path.join(short_tmp, "file")
    open(not_a_dir, "w").close()
    path = os.path.join(not_a_dir, "d.sock")
    assert serve_and_fail(unique_name, path) == (
        f"Error: unsafe socket directory for {path}: {not_a_dir} is not a directory")
    assert serve_and_fail(unique_name, "/proc/lmcached-test/d.sock") == (
        "Error: cannot create the directory of --socket /proc/lmcached-test/d.sock: No such "
        "file or directory: /proc/lmcached-test")


def test_serve_on_the_socket_of_a_running_daemon_is_one_error_line(daemon, unique_name):
    assert serve_and_fail(unique_name, daemon.socket) == (
        f"Error: another lmcached daemon is listening on {daemon.socket}")


@pytest.mark.parametrize(("args", "message"), [
    (["--capacity", "1KiB"], "Error: --capacity: capacity 1KiB leaves no room for a block: "
     "the arena needs at least 8192 bytes (its 4096-byte header and one 4096-byte block)"),
    (["--capacity", "8MB", "--block-size", "16MiB"], "Error: block size 16MiB (--block-size) "
     "does not fit in capacity 8MB (--capacity) with the arena's 4096-byte header; use a "
     "smaller block size or a larger capacity"),
    (["--allow-group", "no-such-group-lmc"],
     "Error: --allow-group: no group named 'no-such-group-lmc' (getent group lists them)"),
    (["--capacity", "1GiB", "--block-size", "2KiB"], "Error: block size 2KiB (--block-size) "
     "cuts capacity 1GiB (--capacity) into more than 262144 blocks; use a block size of at "
     "least 4096 bytes, or a smaller capacity"),
    (["--shm-mode", "0777"], "Error: --shm-mode: shm mode '0777' (0777) gives other users "
     "access to the arena, and so to every cached prompt: use 0600, or 0660 with "
     "--allow-group to share it with a group"),
], ids=["capacity-too-small", "block-larger-than-arena", "unknown-group", "too-many-blocks",
        "shm-mode-for-others"])
def test_serve_with_sizes_or_a_group_that_cannot_work_is_one_error_line(
        unique_name, short_tmp, args, message):
    assert serve_and_fail(unique_name, os.path.join(short_tmp, "d.sock"), *args) == message


@pytest.mark.parametrize(("capacity", "style"), [("1GB", "decimal"), ("1GiB", "binary")])
def test_serve_that_may_not_map_its_arena_is_one_error_line_in_the_units_typed(
        unique_name, short_tmp, capacity, style):
    def limit_address_space():  # 512 MiB: the daemon itself uses ~160 MiB, the arena not
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))

    line = serve_and_fail(unique_name, os.path.join(short_tmp, "d.sock"), "--capacity",
                          capacity, preexec_fn=limit_address_space)
    assert line == (f"Error: cannot create a {capacity} arena: Cannot allocate memory; this "
                    "process may not map that much (ulimit -v, a memory cgroup's "
                    "MemoryMax=): raise the limit or lower --capacity")


@pytest.mark.parametrize(("capacity", "free"), [("100TB", r"[0-9.]+[KMGT]?B"),
                                                ("100TiB", r"[0-9.]+([KMGT]i)?B")])
def test_serve_beyond_dev_shm_answers_in_the_units_typed(unique_name, short_tmp, capacity, free):
    line = serve_and_fail(unique_name, os.path.join(short_tmp, "d.sock"), "--capacity", capacity)
    assert re.fullmatch(rf"Error: capacity {capacity} \(--capacity\) is more than /dev/shm has "
                        rf"free \({free}\); ask for less, or enlarge /dev/shm", line), line
