"""Facts the docs state, checked against the code and a running daemon: README's `info`
synopsis lists every INFO section, and the daemon's log lines the docs quote
(`WARNING lmcached.daemon.X: message`) are the ones a running daemon prints: same level,
same logger name; docs/troubleshooting.md quotes the usage error `lmcached info bogus` prints
(every INFO section, the `Usage:` lines) and states the exit status of both kinds of error.

A real daemon is made to print them (a first layout, a session idle past
`--idle-timeout`, a connection over `--max-clients`); every quoted line whose first
words are those of one of its lines must then name that line's level and logger.
"""

import glob
import os
import re
import socket
import time

from lmcached.daemon.info import INFO_SECTIONS
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOG_LINE = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR) (lmcached(?:\.\w+)+): (.+)")
NUMBER = re.compile(r"\d+(?:\.\d+)?")
PREFIX_WORDS = 2  # a quoted line and a log line of the same message start alike
LAYOUT = Layout("docs-llama", 1, 0, "vllm", "bfloat16", 2, 2, 16, 16, 2048)


def _quoted_daemon_lines() -> list[tuple[str, str, str, str]]:
    """(file, level, logger, message) of each daemon log line quoted in the docs."""
    found = []
    paths = [os.path.join(REPO, "README.md"), *glob.glob(os.path.join(REPO, "docs", "*.md")),
             os.path.join(REPO, "systemd", "README.md")]
    for path in paths:
        with open(path) as f:
            for line in f:
                match = LOG_LINE.search(line)
                if match and match[2].startswith("lmcached.daemon."):
                    found.append((os.path.relpath(path, REPO), match[1], match[2],
                                  match[3].rstrip("`\n")))
    return found


def _words(message: str) -> str:
    return " ".join(NUMBER.sub("N", message).split()[:PREFIX_WORDS])


def test_quoted_daemon_log_lines_name_the_logger_and_level_that_print_them(daemon_factory):
    idle = daemon_factory("--capacity", "64MiB", "--idle-timeout", "0.5")
    with Connection(idle.socket) as conn:
        hello(conn, "docs", [LAYOUT])  # the first layout sets the block size
        deadline = time.monotonic() + 20
        while "idle for more than" not in idle.log():
            assert time.monotonic() < deadline, "the idle session was never closed"
            time.sleep(0.1)
    full = daemon_factory("--capacity", "64MiB", "--max-clients", "2")
    with Connection(full.socket) as first, Connection(full.socket) as second:
        hello(first, "a"), hello(second, "b")
        third = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        third.connect(full.socket)  # over --max-clients: refused with a log line
        third.settimeout(10)
        third.recv(4096)
        third.close()
        deadline = time.monotonic() + 20
        while "max number of clients reached" not in full.log():
            assert time.monotonic() < deadline, "the extra connection was never refused"
            time.sleep(0.1)
    printed = {}  # words -> (level, logger, message) of the daemon's own lines
    for match in LOG_LINE.finditer(idle.log() + full.log()):
        printed.setdefault(_words(match[3]), (match[1], match[2], match[3]))
    checked = set()
    for path, level, logger, message in _quoted_daemon_lines():
        words = _words(message)
        if words not in printed:
            continue  # a line this run does not make the daemon print
        real_level, real_logger, real_message = printed[words]
        assert (level, logger) == (real_level, real_logger), (
            f"{path} quotes {level} {logger}: {message!r}, the daemon prints it as "
            f"{real_level} {real_logger}: {real_message!r}")
        checked.add(words)
    assert {"closing session", "refused a"} <= checked, checked


def test_readme_info_synopsis_lists_every_info_section():
    with open(os.path.join(REPO, "README.md")) as f:
        (synopsis,) = re.findall(r"^lmcached info \[([a-z0-9|]+)\]", f.read(), re.MULTILINE)
    assert synopsis.split("|") == list(INFO_SECTIONS)


def _troubleshooting() -> str:
    with open(os.path.join(REPO, "docs", "troubleshooting.md")) as f:
        return f.read()


def test_troubleshooting_quotes_the_info_section_error_the_cli_prints():
    from click.testing import CliRunner

    from lmcached.cli import main

    result = CliRunner().invoke(main, ["info", "bogus"], prog_name="lmcached")
    assert result.exit_code == 2, result.output
    page = _troubleshooting()
    printed = [line for line in result.output.splitlines() if line]
    assert printed[0].startswith("Usage: ") and printed[-1].startswith("Error: "), printed
    for section in INFO_SECTIONS:
        assert f"'{section}'" in printed[-1], (section, printed[-1])
    missing = [line for line in printed if line not in page.splitlines()]
    assert not missing, f"docs/troubleshooting.md does not quote {missing}"


def test_troubleshooting_states_the_exit_status_of_errors_and_of_usage_errors(short_tmp):
    from click.testing import CliRunner

    from lmcached.cli import main

    runner = CliRunner()
    failed = runner.invoke(main, ["ping", "--socket", os.path.join(short_tmp, "none.sock")])
    assert failed.exit_code == 1, failed.output
    assert [line for line in failed.output.splitlines() if line] == [
        f"Error: no daemon is running on {os.path.join(short_tmp, 'none.sock')}"]
    misused = runner.invoke(main, ["info", "--bogus"], prog_name="lmcached")
    assert misused.exit_code == 2, misused.output
    lines = [line for line in misused.output.splitlines() if line]
    assert lines[0].startswith("Usage: lmcached info ") and lines[-1].startswith("Error: ")
    (intro,) = re.findall(r"The CLI prints one `Error: \.\.\.` line.*?\n\n", _troubleshooting(),
                          re.DOTALL)
    intro = " ".join(intro.split())
    assert "exits with status 1" in intro and "exit status 2" in intro, intro
    assert "`Usage:` line" in intro, intro
