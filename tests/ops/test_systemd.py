"""systemd/: the unit files verify and carry the required settings; the sample config loads;
the daemon behaves as the units expect (socket in $RUNTIME_DIRECTORY, exact shm mode under
the service umask, SIGHUP reload)."""

import grp
import json
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcached import config
from lmcached.wire import envs
from lmcached.config import ServerConfig, load_config
from lmcached.wire.connection import Connection, DaemonError
from lmcached.wire.protocol import Ping
from lmcached.daemon.server import Server
from lmcached.shm.janitor import list_segments

SYSTEMD_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "systemd")
UNITS = {"lmcached.service": "lmcached.service", "lmcached@.service": "lmcached@llama.service"}
EXAMPLE_TOML = os.path.join(SYSTEMD_DIR, "lmcached.toml.example")
EXEC_PATH = "/usr/local/bin/lmcached"
LMCACHED = os.path.join(os.path.dirname(sys.executable), "lmcached")
MiB = 1 << 20
START_DEADLINE_S = 30.0

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian: apt-get install systemd)",
)


def read_unit(filename: str) -> dict[str, dict[str, list[str]]]:
    """Directives of a unit file by section: {section: {key: [values in order]}}."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    with open(os.path.join(SYSTEMD_DIR, filename)) as f:
        for raw in f:
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                current = sections.setdefault(line[1:-1], {})
                continue
            key, _, value = line.partition("=")
            assert current is not None, f"{filename}: {line!r} outside a section"
            current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit_text(filename: str) -> str:
    return Path(SYSTEMD_DIR, filename).read_text()


def verify_unit(text: str, unit_name: str, tmp_path) -> tuple[int, list[str]]:
    """`systemd-analyze verify` of unit `text` saved as `unit_name`: (return code, lines
    about it).

    The template is verified as an instance (`lmcached@llama.service`). ExecStart runs a
    stub executable, because verify refuses a command that does not exist on this
    machine. verify does not look up User=/Group=, so the lmcached user need not exist.
    """
    stub = tmp_path / "lmcached"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    assert EXEC_PATH in text
    unit = tmp_path / unit_name
    unit.write_text(text.replace(EXEC_PATH, str(stub)))
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True, text=True, timeout=120,
    )
    # verify also reports on system units it loads as dependencies; keep what is ours.
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if unit_name in line]
    return proc.returncode, ours


# ------------------------------------------------------------------------- the units
@needs_systemd_analyze
@pytest.mark.parametrize("filename", sorted(UNITS))
def test_unit_passes_systemd_analyze_verify(filename, tmp_path):
    returncode, complaints = verify_unit(unit_text(filename), UNITS[filename], tmp_path)
    assert returncode == 0 and complaints == [], "\n".join(complaints)


@needs_systemd_analyze
def test_verify_check_catches_a_bad_directive(tmp_path):
    """The check above can fail: verify exits 0 on an unknown key, but says so."""
    text = unit_text("lmcached.service").replace("Type=notify\n", "Type=notify\nWatchdogSecs=1\n")
    _, complaints = verify_unit(text, "lmcached.service", tmp_path)
    assert any("Unknown key" in line and "WatchdogSecs" in line for line in complaints)


@pytest.mark.parametrize("filename", sorted(UNITS))
def test_unit_has_the_required_service_settings(filename):
    service = read_unit(filename)["Service"]
    required = {
        "Type": "notify",
        "NotifyAccess": "main",
        "WatchdogSec": "30s",
        "Restart": "on-failure",
        "RuntimeDirectory": "lmcached",
        "RuntimeDirectoryMode": "0750",
        "RuntimeDirectoryPreserve": "yes",  # shared by all instances
        "User": "lmcached",
        "Group": "lmcached",
        "LimitMEMLOCK": "infinity",
        "LimitNOFILE": "65536",  # room for --max-clients (default 1024) plus the daemon's own
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "KillSignal": "SIGTERM",
        "RemoveIPC": "no",
        "ExecReload": "/bin/kill -HUP $MAINPID",
    }
    for key, value in required.items():
        assert service.get(key) == [value], f"{filename}: {key}={service.get(key)}"
    assert "TimeoutStopSec" in service and "TimeoutStartSec" in service
    assert read_unit(filename)["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.parametrize("filename", sorted(UNITS))
def test_unit_stop_timeout_leaves_room_for_the_save_on_stop(filename):
    """systemd kills a stop after TimeoutStopSec: the default --disk-save-on-stop and the
    queued writes' drain (DiskTier.close) must end before it."""
    from lmcached.daemon.disk.tier import CLOSE_DRAIN_S

    (timeout,) = read_unit(filename)["Service"]["TimeoutStopSec"]
    assert timeout.endswith("s"), timeout
    budget_s = config.SETTINGS["disk_save_on_stop"].default
    assert float(timeout[:-1]) > budget_s + CLOSE_DRAIN_S, filename


@pytest.mark.parametrize("filename", sorted(UNITS))
def test_unit_keeps_dev_shm_and_the_users_ipc(filename):
    """Nothing may hide /dev/shm (the arena) or delete the shared user's segments."""
    service = read_unit(filename)["Service"]
    for key in ("PrivateIPC", "PrivateDevices", "DynamicUser", "InaccessiblePaths",
                "TemporaryFileSystem", "UMask"):
        assert key not in service, f"{filename}: {key}= would break the arena"
    for key in ("ReadOnlyPaths", "InaccessiblePaths"):
        assert not any("/dev" in v for v in service.get(key, [])), key


def readme_command(prefix: str) -> str:
    """The command of systemd/README.md that starts with `prefix`: continuation lines
    joined, the trailing `# comment` cut."""
    text = unit_text("README.md").replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.strip().startswith(prefix)]
    return " ".join(line.split(" #")[0].split())


def test_readme_installs_the_units_that_exist_with_their_system_user():
    install = readme_command("sudo install -m 0644 systemd/").split()
    assert install[-1] == "/etc/systemd/system/"
    assert sorted(os.path.basename(p) for p in install[4:-1]) == sorted(UNITS)
    # The user the units run as must be a system user: logind's RemoveIPC=yes deletes
    # the shared memory (the arena) of a non-system user when its last session ends.
    useradd = readme_command("sudo useradd").split()
    assert "--system" in useradd
    user = useradd[-1]
    assert "--user-group" in useradd  # its own group, named like it
    for filename in UNITS:
        service = read_unit(filename)["Service"]
        assert (service["User"], service["Group"]) == ([user], [user]), filename
    link = readme_command("sudo ln -s").split()
    assert link[-1] == EXEC_PATH  # the units' ExecStart


def test_readme_names_the_paths_the_units_use():
    readme = unit_text("README.md")
    plain, template = read_unit("lmcached.service")["Service"], read_unit("lmcached@.service")[
        "Service"]
    runtime_dir = "/run/" + plain["RuntimeDirectory"][0]
    assert template["RuntimeDirectory"] == plain["RuntimeDirectory"]  # shared by all
    assert f"{runtime_dir}/lmcached.sock" in readme and f"{runtime_dir}/NAME.sock" in readme
    assert {p.rsplit("/", 1)[0] for p in re.findall(r"/run/[\w./]+\.sock", readme)} == {
        runtime_dir}
    (env_file,) = plain["EnvironmentFile"]
    assert env_file.startswith("-")  # optional: the unit starts without it
    assert f"`{env_file[1:]}` is optional" in readme
    (template_env,) = template["EnvironmentFile"]
    assert template_env.startswith("-") and template_env[1:].replace("%i", "NAME") in readme
    started_as = template["ExecStart"][0].replace(EXEC_PATH, "lmcached").replace("%i", "NAME")
    assert f"`{started_as}`" in " ".join(readme.split())


# ---------------------------------------------------------------- the sample config
def clean_environment(monkeypatch) -> None:
    for name in (*envs.ENV_VARS, *envs.SYSTEMD_VARS, "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)


def test_example_toml_loads_and_names_every_key(monkeypatch):
    clean_environment(monkeypatch)
    cfg = load_config({}, EXAMPLE_TOML, check_shm_free=False)  # sized for a serving node
    assert cfg.capacity_bytes == 8192 * MiB and cfg.block_bytes == 33558528
    assert cfg.shm_mode == 0o660 and cfg.allow_group == "lmcached"
    assert cfg.name == "default" and cfg.log_level == "INFO"
    text = Path(EXAMPLE_TOML).read_text()
    for key in config._FILE_KEYS:
        assert re.search(rf"^(# )?{key} = ", text, re.MULTILINE), f"{key} missing from example"


def test_example_toml_commented_values_are_valid_too(monkeypatch, tmp_path):
    clean_environment(monkeypatch)
    text = re.sub(r"^# (\w+ = )", r"\1", Path(EXAMPLE_TOML).read_text(), flags=re.MULTILINE)
    path = tmp_path / "all.toml"
    path.write_text(text)
    cfg = load_config({}, str(path), check_shm_free=False)
    assert cfg.block_bytes == 33558528 and cfg.socket == "/run/lmcached/lmcached.sock"


# (directive, the directory systemd puts it under): what ProtectSystem=strict leaves writable.
_WRITABLE_DIRECTIVES = {"CacheDirectory": "/var/cache", "StateDirectory": "/var/lib",
                        "RuntimeDirectory": "/run", "LogsDirectory": "/var/log"}


def writable_paths(filename: str, instance: str) -> list[str]:
    """The directories unit `filename` (instance `instance` of a template) may write under
    ProtectSystem=strict: its *Directory= (below systemd's roots) and ReadWritePaths=."""
    service = read_unit(filename)["Service"]
    assert service["ProtectSystem"] == ["strict"]
    paths = []
    for key, root in _WRITABLE_DIRECTIVES.items():
        for value in service.get(key, []):
            paths += [os.path.join(root, d.replace("%i", instance)) for d in value.split()]
    for value in service.get("ReadWritePaths", []):
        paths += [p.lstrip("-+") for p in value.split()]
    return paths


def lies_under(path: str, directories: list[str]) -> bool:
    return any(os.path.commonpath([path, d]) == d for d in directories)


def test_example_disk_path_lies_where_each_unit_can_write(monkeypatch, tmp_path):
    """The disk tier of the example TOML (and of the README's instance file) is in a
    directory the unit may write, made the daemon user's and not writable by group or
    others (prepare_disk_directory refuses anything else)."""
    clean_environment(monkeypatch)
    text = re.sub(r"^# (\w+ = )", r"\1", Path(EXAMPLE_TOML).read_text(), flags=re.MULTILINE)
    path = tmp_path / "all.toml"
    path.write_text(text)
    disk_path = load_config({}, str(path)).disk_path
    assert lies_under(disk_path, writable_paths("lmcached.service", "default")), disk_path
    (named,) = set(re.findall(r"(/var/cache/lmcached/NAME)\b", text))
    assert lies_under(named.replace("NAME", "llama"),
                      writable_paths("lmcached@.service", "llama"))
    (readme_path,) = re.findall(r'disk_path = "([^"]+)"\s+# /etc/lmcached/llama.toml',
                                unit_text("README.md"))
    assert lies_under(readme_path, writable_paths("lmcached@.service", "llama"))
    assert not lies_under(readme_path, writable_paths("lmcached@.service", "qwen"))
    for filename in UNITS:
        service = read_unit(filename)["Service"]
        if "CacheDirectory" in service:
            assert int(service["CacheDirectoryMode"][0], 8) & 0o022 == 0, filename


# ------------------------------------------------- the daemon as the template runs it
def wait_until_serving(proc: subprocess.Popen, socket_path: str, log_path: str) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, Path(log_path).read_text()
        try:
            with Connection(socket_path, timeout_s=5) as conn:
                conn.request(Ping())
            return
        except OSError:
            time.sleep(0.05)
        except DaemonError as exc:  # the arena is still prefaulted
            assert exc.code == "loading", exc
            time.sleep(0.05)
    raise AssertionError(f"daemon did not serve on {socket_path}:\n{Path(log_path).read_text()}")


def stop_if_running(proc: subprocess.Popen) -> None:
    """After a failed check: SIGTERM by pid, then SIGKILL if it does not stop."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def read_environment_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines, as systemd's EnvironmentFile= reads them (no quoting used here)."""
    lines = Path(path).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def wait_for_log(log_path: str, needle: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in Path(log_path).read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not logged:\n{Path(log_path).read_text()}")


@pytest.mark.slow
def test_template_exec_start_serves_in_the_runtime_directory(unique_name, short_tmp):
    """ExecStart of lmcached@NAME under systemd's environment: umask 0022,
    $RUNTIME_DIRECTORY, $NOTIFY_SOCKET. The socket is $RUNTIME_DIRECTORY/NAME.sock, the
    arena has exactly the configured 0660, SIGHUP (ExecReload) re-reads the log level,
    SIGTERM (KillSignal) stops it cleanly."""
    runtime_dir = os.path.join(short_tmp, "run")
    os.mkdir(runtime_dir, 0o750)
    toml_path = os.path.join(short_tmp, f"{unique_name}.toml")
    group = grp.getgrgid(os.getgid()).gr_name  # the units use lmcached; any group of ours
    example = re.sub(r"^(capacity|block_size) = .*$", "", Path(EXAMPLE_TOML).read_text(),
                     flags=re.MULTILINE) + 'capacity = "64MiB"\n'  # a test-sized arena
    Path(toml_path).write_text(
        example.replace('allow_group = "lmcached"', f'allow_group = "{group}"')
    )
    exec_start = read_unit("lmcached@.service")["Service"]["ExecStart"][0]
    argv = exec_start.replace(EXEC_PATH, LMCACHED).replace(
        "/etc/lmcached/%i.toml", toml_path).replace("%i", unique_name).split()
    notify_path = os.path.join(short_tmp, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(10)
    env = {k: v for k, v in os.environ.items() if k not in envs.ENV_VARS}
    env.update(RUNTIME_DIRECTORY=runtime_dir, NOTIFY_SOCKET=notify_path)
    log_path = os.path.join(short_tmp, "daemon.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                umask=0o022)
    socket_path = os.path.join(runtime_dir, f"{unique_name}.sock")
    try:
        wait_until_serving(proc, socket_path, log_path)
        while b"READY=1" not in notify.recv(4096):
            pass
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o660
        assert os.stat(socket_path).st_gid == os.getgid()
        (segment,) = list_segments(unique_name)
        assert stat.S_IMODE(os.stat(f"/dev/shm/{segment}").st_mode) == 0o660

        text = Path(toml_path).read_text()
        Path(toml_path).write_text(text.replace('log_level = "INFO"', 'log_level = "DEBUG"'))
        proc.send_signal(signal.SIGHUP)
        wait_for_log(log_path, "SIGHUP: log level is DEBUG")
        with Connection(socket_path) as conn:
            conn.request(Ping())

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        while b"STOPPING=1" not in notify.recv(4096):
            pass
        assert not os.path.exists(socket_path) and list_segments(unique_name) == []
    finally:
        stop_if_running(proc)
        notify.close()


@pytest.mark.slow
def test_plain_unit_exec_start_serves_where_the_readme_says(short_tmp):
    """ExecStart of lmcached.service, with the optional EnvironmentFile the README shows
    (`LMCACHED_CAPACITY=...`), under systemd's environment: it serves on
    $RUNTIME_DIRECTORY/lmcached.sock, tells systemd so in STATUS=, and the admin CLI
    finds it with no option. The daemon is the default instance, so its arena is
    /dev/shm/lmcached.default.<gen>: checked by hand, the leak fixture only sees test names."""
    service = read_unit("lmcached.service")["Service"]
    (env_file,) = service["EnvironmentFile"]
    assert env_file.startswith("-")  # optional: the unit must also start without it
    env_path = os.path.join(short_tmp, "lmcached.env")
    Path(env_path).write_text("LMCACHED_CAPACITY=16MiB\n")
    runtime_dir = os.path.join(short_tmp, "run")
    os.mkdir(runtime_dir, 0o750)
    notify_path = os.path.join(short_tmp, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(10)
    env = {k: v for k, v in os.environ.items()
           if k not in (*envs.ENV_VARS, *envs.SYSTEMD_VARS, "XDG_RUNTIME_DIR")}
    env.update(read_environment_file(env_path), RUNTIME_DIRECTORY=runtime_dir,
               NOTIFY_SOCKET=notify_path)
    argv = service["ExecStart"][0].replace(EXEC_PATH, LMCACHED).split()
    socket_path = os.path.join(runtime_dir, "lmcached.sock")
    log_path = os.path.join(short_tmp, "daemon.log")
    before = set(list_segments("default"))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                umask=0o022)
    try:
        wait_until_serving(proc, socket_path, log_path)
        while b"READY=1" not in (ready := notify.recv(4096)):
            pass
        assert f"STATUS=serving on {socket_path}" in ready.decode().split("\n")
        (segment,) = set(list_segments("default")) - before
        client_env = {k: v for k, v in env.items() if k not in envs.ENV_VARS}
        cli = subprocess.run([LMCACHED, "info", "memory", "--json"], capture_output=True,
                             text=True, timeout=60, env=client_env)
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["memory"]["capacity_bytes"] == 16 * MiB  # env file
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert not os.path.exists(socket_path) and segment not in list_segments("default")
    finally:
        stop_if_running(proc)
        notify.close()


def test_reload_works_when_the_arena_fills_most_of_dev_shm(monkeypatch, tmp_path):
    """SIGHUP must not refuse the config because the daemon's own arena uses /dev/shm."""
    clean_environment(monkeypatch)
    toml_path = tmp_path / "c.toml"
    toml_path.write_text('log_level = "DEBUG"\n')
    cfg = ServerConfig(name="reload", socket=str(tmp_path / "s.sock"), capacity_bytes=64 * MiB,
                       config_file=str(toml_path), reread=config.reread_config)
    monkeypatch.setattr(config, "shm_free_bytes", lambda: MiB)  # arena took the rest
    root = logging.getLogger("lmcached")
    saved_level, saved_handlers = root.level, list(root.handlers)
    server = Server(cfg)
    try:
        server._reload()
    finally:
        root.setLevel(saved_level)
        root.handlers[:] = saved_handlers
    assert server.config.log_level == "DEBUG"
