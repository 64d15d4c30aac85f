"""The `lmcached` command: run the daemon and administer it, redis-cli style.

    lmcached serve [--capacity 8GiB] [--name NAME] [--socket PATH] ...
    lmcached info [SECTION] [--json]      lmcached clients [--json]
    lmcached ping | stop [--no-wait] | config | clear [--yes] | evict (--lru N | --key K)
    lmcached demo [--workers 2]

Every admin command takes --socket / --name; without --socket it looks where the daemon
NAME may listen (`daemon_socket_paths`: /run/lmcached first, as the systemd units put
it). Every error, a daemon that does not start included, is one `Error: ...` line on
stderr and exit status 1 (click's usage errors: status 2, with the usage); the daemon's
own reason (an Error reply) is printed, not an errno.
"""

import json
import sys
import time

import click

from lmcached.config import config_from_context, serve_params
from lmcached.wire.extras import install_hint
from lmcached.wire.logger import configure_logging
from lmcached.wire.connection import Connection, DaemonError, hello, list_clients
from lmcached.wire.protocol import (
    INFO_SECTIONS,
    Clear,
    ConfigGet,
    Events,
    Evict,
    Info,
    Ping,
    Shutdown,
    Subscribe,
)
from lmcached.wire.socket_path import (
    NoDaemonError,
    UnsafeSocketPathError,
    connect_first,
    daemon_socket_paths,
)
from lmcached.info_text import blocks_note, loading_note, render_clients, render_info


STOP_WAIT_S = 60.0  # how long `stop` waits for the daemon to exit, by default
_EXIT_POLL_S = 0.05
CLEAR_L2_WAIT_S = 2.0  # how long `clear` waits for L2's clear generation to advance


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """Wait until process `pid` has exited (a zombie, exited but not yet reaped by its
    parent, counts as exited). Returns False if it still runs after `timeout_s`."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_EXIT_POLL_S)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lmcached")
def main() -> None:
    """lmcached: a local KV-cache daemon that keeps LLM KV cache in shared memory.

    Start it with `lmcached serve`; worker processes attach through
    lmcached.client.CacheEngine. The other commands administer a running daemon.
    """


@main.command(params=serve_params())
@click.pass_context
def serve(ctx: click.Context, **_settings) -> None:
    """Run the daemon in the foreground until SIGTERM, SIGINT or `lmcached stop`.

    Creates and prefaults the shared-memory arena (progress on stderr), listens on the
    Unix socket, and notifies systemd (READY=1) when it serves.

    Each setting comes from, first to last: its option, its LMCACHED_* variable (shown
    with each option), its key in the TOML file read from --config or $LMCACHED_CONFIG
    (`max_clients = 512`; no file is read when neither is given), its default. It has
    the same type in each.
    """
    from lmcached.daemon.server import StartupError, run_server

    try:
        config = config_from_context(ctx)
    except OSError as exc:  # /dev/shm cannot be inspected
        raise click.ClickException(str(exc)) from None
    configure_logging(config.log_level)
    try:
        status = run_server(config)
    except StartupError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(status)


def _admin_options(func):
    func = click.option("--socket", "socket_path", help="Daemon socket (env: LMCACHED_SOCKET).")(func)
    func = click.option("--name", default="default", show_default=True,
                        envvar="LMCACHED_NAME", help="Daemon name, to find its socket (in "
                        "/run/lmcached, $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/lmcached, "
                        "/tmp/lmcached-UID: the first that has a daemon).")(func)
    return func


def _request(socket_path: str | None, name: str, message):
    """Send one admin request and return the reply.

    Raises:
        click.ClickException: as `_session`.
    """
    return _session(socket_path, name, lambda conn: conn.request(message))


def _session(socket_path: str | None, name: str, talk):
    """Open an admin session and return `talk(conn)` (its requests, e.g. the pages of
    CLIENTS).

    Raises:
        click.ClickException: no daemon, an unsafe socket directory, a broken connection,
            or an Error reply (printed as one `Error: ...` line, exit status 1).
    """
    conn = _connect(daemon_socket_paths(socket_path, name))
    path = conn.socket_path
    answered = False
    try:
        with conn:
            try:
                hello(conn, "lmcached-cli")
            except DaemonError as exc:
                if exc.code != "loading":
                    raise
                # prefaulting: the admin requests are answered without a session
            answered = True
            return talk(conn)
    except (ConnectionError, TimeoutError, OSError) as exc:
        if not answered and isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            # accepted, then closed before any reply: the daemon was stopping (a refusal
            # such as max_clients is an Error reply, a DaemonError), or it does not accept
            # this peer (SO_PEERCRED), which it logs
            raise click.ClickException(
                f"the daemon on {path} closed the connection without answering: it is "
                "stopping, or it does not accept this user (see its log)") from None
        raise click.ClickException(f"cannot talk to the daemon on {path}: {exc}") from None
    except DaemonError as exc:  # "<code>: <message>", the code as INFO counts it
        raise click.ClickException(str(exc)) from None


def _connect(paths: list[str]) -> Connection:
    """A connection to the first of `paths` where a daemon listens (`connect_first` over
    `daemon_socket_paths`: --socket, $LMCACHED_SOCKET, or where the daemon NAME may listen,
    in order).

    Raises:
        click.ClickException: no daemon on any of them (the message lists them), an
            unsafe socket directory, or a socket that refuses us (e.g. permissions: said
            when no later place has a daemon either).
    """
    def open_at(path: str) -> Connection:
        try:
            return Connection(path, timeout_s=10.0)
        except (FileNotFoundError, ConnectionRefusedError, PermissionError):
            raise  # connect_first goes on to the next place
        except OSError as exc:
            raise click.ClickException(f"cannot talk to the daemon on {path}: {exc}") from None

    try:
        return connect_first(paths, open_at)
    except (UnsafeSocketPathError, NoDaemonError) as exc:
        raise click.ClickException(str(exc)) from None
    except PermissionError as exc:
        raise click.ClickException(
            f"permission denied on {exc.filename}: connect as the daemon's user or root, or "
            f"as a member of the group the daemon allows (--allow-group)") from None


@main.command()
@click.argument("section", required=False, metavar="[SECTION]",
                type=click.Choice(INFO_SECTIONS, case_sensitive=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_admin_options
def info(section, as_json, socket_path, name) -> None:
    """Server statistics: server, memory, blocks, clients, stats, l2, disk, tenants (or
    one SECTION).

    While no client has sent a layout (and --block-size is unset), the arena has no
    blocks yet; a note on stderr says why.
    """
    reply = _request(socket_path, name, Info(section and section.lower()))
    if as_json:
        click.echo(json.dumps(reply.sections, indent=2))
        return
    click.echo(render_info(reply.sections))
    for note in (loading_note(reply.sections), blocks_note(reply.sections)):
        if note:
            click.echo(note, err=True)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_admin_options
def clients(as_json, socket_path, name) -> None:
    """One line per connected client: id, pid, process, RSS, namespace, pins."""
    rows = _session(socket_path, name, list_clients)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif rows:
        click.echo(render_clients(rows))


@main.command()
@click.option("--namespace", "namespaces", type=click.IntRange(min=0), multiple=True,
              metavar="N", help="Only the events of namespace id N (repeatable; "
              "`lmcached clients` shows each client's).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per line (hashes in hex, token ids as a list).")
@click.option("--tokens", is_flag=True, help="Also the token ids of stored chunks.")
@click.option("--count", type=click.IntRange(min=1), help="Exit after N events.")
@click.option("--interval", type=click.FloatRange(min=0.001), default=0.1, show_default=True,
              help="Seconds between polls while nothing happens.")
@_admin_options
def events(namespaces, as_json, tokens, count, interval, socket_path, name) -> None:
    """Tail the daemon's chunk event feed: one line per chunk stored in or removed from
    the arena (medium cpu) or the disk tier (medium disk), as redis-cli's psubscribe does
    for keyspace notifications. Events this tail lost (it lagged more than the feed's
    --events-capacity behind) are said on stderr. Stops on Ctrl-C."""
    def tail(conn: Connection) -> None:
        cursor = conn.request(Subscribe(list(namespaces))).cursor
        seen = 0
        while count is None or seen < count:
            reply = conn.request(Events(cursor, 0, tokens))
            if reply.lost:
                click.echo(f"lost {reply.lost} events (this tail lagged)", err=True)
            for event in reply.events[:None if count is None else count - seen]:
                click.echo(_event_line(event, as_json))
                seen += 1
            cursor = reply.cursor
            if not reply.events:
                time.sleep(interval)

    try:
        _session(socket_path, name, tail)
    except KeyboardInterrupt:
        pass


def _event_line(event, as_json: bool) -> str:
    """One event as a line of `lmcached events`."""
    token_ids = [int.from_bytes(event.token_ids[i:i + 8], "little", signed=True)
                 for i in range(0, len(event.token_ids), 8)]
    if as_json:
        return json.dumps({"seq": event.seq, "kind": event.kind, "medium": event.medium,
                           "ns": event.ns, "ns_fp": event.ns_fp.hex(),
                           "chunk_hash": event.chunk_hash.hex(),
                           "parent": event.parent.hex(), "token_ids": token_ids})
    line = (f"seq={event.seq} {event.kind} medium={event.medium} ns={event.ns} "
            f"hash={event.chunk_hash.hex()}")
    if event.parent:
        line += f" parent={event.parent.hex()}"
    if token_ids:
        line += " tokens=" + ",".join(map(str, token_ids))
    return line


@main.command()
@_admin_options
def ping(socket_path, name) -> None:
    """Check that the daemon serves (prints PONG). While it loads (rebuilds its disk
    tier's index, prefaults its arena), prints LOADING, the phase and its progress, and
    exits with status 1 (as until it serves)."""
    loading = _session(socket_path, name, _ping)
    if loading is not None:
        click.echo(f"LOADING {loading}")
        sys.exit(1)
    click.echo("PONG")


def _ping(conn: Connection) -> str | None:
    """PING: None when answered, the daemon's progress when it refuses with `loading`."""
    try:
        conn.request(Ping())
    except DaemonError as exc:
        if exc.code != "loading":
            raise
        return str(exc).removeprefix("loading: ")
    return None


@main.command()
@click.option("--lru", type=click.IntRange(min=1), help="Evict the N least recently used values.")
@click.option("--key", help="Evict a string key, or a chunk hash (32 hex digits).")
@_admin_options
def evict(lru, key, socket_path, name) -> None:
    """Evict values now (pinned ones stay readable by their current readers)."""
    if (lru is None) == (key is None):
        raise click.UsageError("give exactly one of --lru N or --key K")
    reply = _request(socket_path, name, Evict(lru=lru or 0, key=key))
    click.echo(f"evicted {reply.count}")


@main.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@_admin_options
def clear(yes, socket_path, name) -> None:
    """Evict every cached value from the arena, the disk tier and L2 (asks first on a
    terminal). A value being read stays with its reader until released."""
    if not yes:
        if not _stdin_is_terminal():
            raise click.UsageError("clear asks for confirmation on a terminal, and stdin is "
                                   "not one: pass --yes to clear without asking")
        click.confirm("Evict every value from the cache (arena, disk and L2)?", abort=True)

    def talk(conn):
        count = conn.request(Clear()).count
        l2 = conn.request(Info("l2")).sections["l2"]
        deadline = time.monotonic() + CLEAR_L2_WAIT_S
        while l2.get("l2_clear_pending") and time.monotonic() < deadline:
            time.sleep(0.05)
            l2 = conn.request(Info("l2")).sections["l2"]
        return count, l2
    count, l2 = _session(socket_path, name, talk)
    click.echo(f"evicted {count}")
    if not l2.get("l2_enabled"):
        return
    if l2.get("l2_clear_pending"):
        click.echo("l2: not cleared yet (the L2 is down or refused the INCR: INFO "
                   "l2_clear_failures); this daemon fetches nothing from L2 until it is, "
                   "other daemons on it still serve the old chunks")
    else:
        click.echo(f"l2: cleared for every daemon on {l2['l2_url']}: chunks written before "
                   f"are never read again (l2_generation {l2['l2_generation']}; Redis drops "
                   "them when their TTL ends); other daemons' arenas and disks keep theirs: "
                   "run clear on each node")


def _stdin_is_terminal() -> bool:
    return sys.stdin.isatty()


@main.command()
@click.option("--no-wait", is_flag=True, help="Return once the daemon has the request, "
              "without waiting for it to exit.")
@click.option("--timeout", "timeout_s", default=STOP_WAIT_S, show_default=True,
              type=click.FloatRange(min=0), help="Seconds to wait for the daemon to exit.")
@_admin_options
def stop(no_wait, timeout_s, socket_path, name) -> None:
    """Stop the daemon gracefully (as SIGTERM), and wait until it has exited: its
    clients closed, its socket and arena removed."""
    pid = _session(socket_path, name, _shutdown)
    click.echo("stopping")
    if no_wait:
        return
    if not wait_for_exit(pid, timeout_s):
        raise click.ClickException(f"the daemon (pid {pid}) has not exited after "
                                   f"{timeout_s:g} s; see its log (it stops its L2 writes "
                                   f"and device tiers first), or kill it: kill {pid}")
    click.echo("stopped")


def _shutdown(conn: Connection) -> int:
    """Send SHUTDOWN; return the daemon's pid (SO_PEERCRED of the connection)."""
    pid = conn.peer_pid()
    conn.request(Shutdown())
    return pid


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_admin_options
def config(as_json, socket_path, name) -> None:
    """The running daemon's effective configuration."""
    reply = _request(socket_path, name, ConfigGet())
    fields = reply.sections["config"]
    click.echo(json.dumps(fields, indent=2) if as_json else render_info(reply.sections))


@main.command()
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=2),
              help="Worker processes, each with its own copy of the model.")
@click.option("--size", type=click.Choice(["demo", "tiny"]), default="demo", show_default=True,
              help="demo: a 10-layer model, prompts of ~1.3k tokens; tiny: a 2-layer "
              "model for tests, too small for the cache to pay off.")
@click.option("--socket", "socket_path", help="Use the daemon on this socket instead of "
              "starting one on a temp socket.")
@click.option("--name", default=None, help="Use the running daemon of this name (found as "
              "`lmcached info --name` finds it) instead of starting one.")
@click.option("--capacity", default="1GiB", show_default=True,
              help="Arena of the daemon the demo starts.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON at the end.")
def demo(workers, size, socket_path, name, capacity, as_json) -> None:
    """Worker processes running a real transformer share prompt prefixes.

    Builds a Llama-architecture model with random weights in each worker (nothing is
    downloaded), trains a tokenizer on Python's documentation, runs RAG-like prompts,
    and prints per request the cached tokens and TTFT, then a summary. Needs the `hf`
    extra (transformers). Exits with status 1 if an output differs from a no-cache run.
    """
    try:
        from lmcached.examples.demo import run_demo
    except ImportError as exc:
        raise click.ClickException(f"the demo needs the hf extra ({install_hint('hf')}): {exc}")
    log = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    try:
        summary = run_demo(workers, size, socket_path, capacity, log, name=name)
    except (RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    if not summary["outputs_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
