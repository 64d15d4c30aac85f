"""One discovery rule for every client (lmcached/wire/socket_path.py: `daemon_socket_paths`,
`connect_first`): `CacheEngine.connect`, the demo and the CLI find the daemon in the same
places ($LMCACHED_SOCKET, $LMCACHED_NAME, /run/lmcached, $RUNTIME_DIRECTORY,
$XDG_RUNTIME_DIR/lmcached, /tmp/lmcached-<uid>), skip a stale socket as the CLI does, and
a "no daemon" error or warning lists every place looked at."""

import logging
import os
import socket
import subprocess
import sys

import pytest
import torch

from conftest import start_daemon
from engine_worker import prompt_kv, small_layout
from lmcached.client import CacheEngine
from lmcached.wire import envs, socket_path
from lmcached.wire.socket_path import NoDaemonError

LMCACHED = os.path.join(os.path.dirname(sys.executable), "lmcached")


@pytest.fixture
def places(monkeypatch, short_tmp):
    """Every place a client looks, under the test's own directory: returns the list
    `client_socket_paths` gives for a daemon name."""
    for name in (*envs.ENV_VARS, *envs.SYSTEMD_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket_path, "RUN_DIRECTORY", os.path.join(short_tmp, "run"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.path.join(short_tmp, "xdg"))
    return socket_path.client_socket_paths


def xdg_socket(short_tmp: str, name: str) -> str:
    return os.path.join(short_tmp, "xdg", "lmcached", f"{name}.sock")


def test_the_engine_finds_the_daemon_named_by_lmcached_name(places, monkeypatch, short_tmp,
                                                            unique_name):
    where = xdg_socket(short_tmp, unique_name)
    daemon = start_daemon(unique_name, where, os.path.join(short_tmp, "d.log"),
                          "--capacity", "8MiB")
    try:
        monkeypatch.setenv("LMCACHED_NAME", unique_name)
        layout = small_layout()
        tokens = list(range(40))
        with CacheEngine.connect(layout, strict=True) as engine:  # no socket, no name
            assert engine.link.socket_path == where
            engine.store(torch.tensor(tokens), prompt_kv(layout, tokens))
            assert engine.lookup(torch.tensor(tokens)) == 40
        # The CLI, given the same environment, talks to the same daemon.
        cli = subprocess.run([LMCACHED, "info", "stats", "--json"], capture_output=True,
                             text=True, timeout=60, env=dict(os.environ))
        assert cli.returncode == 0, cli.stderr
        assert '"stores": 3' in cli.stdout
    finally:
        assert daemon.stop() == 0


def test_a_stale_socket_in_the_first_place_is_skipped_as_the_cli_skips_it(
        places, short_tmp, unique_name):
    stale_dir = os.path.dirname(places(unique_name)[0])
    os.makedirs(stale_dir, 0o700)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(places(unique_name)[0])  # a socket file nobody listens on (a dead daemon)
    stale.close()
    where = xdg_socket(short_tmp, unique_name)
    daemon = start_daemon(unique_name, where, os.path.join(short_tmp, "d.log"),
                          "--capacity", "8MiB")
    try:
        with CacheEngine.connect(small_layout(), name=unique_name, strict=True) as engine:
            assert engine.link.socket_path == where
            assert engine.link.generation is not None
    finally:
        assert daemon.stop() == 0


def test_no_daemon_lists_every_place_looked_at_strict_or_not(places, unique_name, caplog):
    looked = places(unique_name)
    assert len(looked) == 3  # /run/lmcached, $XDG_RUNTIME_DIR/lmcached, /tmp/lmcached-<uid>
    with pytest.raises(NoDaemonError) as excinfo:
        CacheEngine.connect(small_layout(), name=unique_name, strict=True)
    assert isinstance(excinfo.value, FileNotFoundError)
    assert excinfo.value.paths == looked
    assert str(excinfo.value) == (
        f"no daemon is running on {', '.join(looked)} (looked there in this order; give "
        f"socket=, or name= if the daemon has another name (or set LMCACHED_SOCKET, "
        f"LMCACHED_NAME))")
    with caplog.at_level(logging.WARNING, logger="lmcached"):
        engine = CacheEngine.connect(small_layout(), name=unique_name)
    try:
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert str(excinfo.value) in warning, warning
        assert engine.lookup(torch.tensor(list(range(40)))) == 0  # a miss, not an error
    finally:
        engine.close()


def test_the_demo_uses_the_running_daemon_found_by_name(places, short_tmp, unique_name):
    pytest.importorskip("transformers")
    from lmcached.examples import demo

    lines = []
    with pytest.raises(NoDaemonError, match="no daemon is running on " + ", ".join(
            places(unique_name)).replace(".", r"\.")):
        with demo._daemon(None, unique_name, "1GiB", 0, lines.append):
            pass
    where = xdg_socket(short_tmp, unique_name)
    daemon = start_daemon(unique_name, where, os.path.join(short_tmp, "d.log"),
                          "--capacity", "8MiB")
    try:
        with demo._daemon(None, unique_name, "1GiB", 0, lines.append) as found:
            assert found == where
        assert lines == [f"using the daemon on {where}"]  # none started
    finally:
        assert daemon.stop() == 0
