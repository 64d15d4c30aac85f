"""The `lmcached` command: run the daemon and administer it, redis-cli style.

    lmcached serve [--capacity 8GiB] [--name NAME] [--socket PATH] ...
    lmcached info [SECTION] [--json]      lmcached clients [--json]
    lmcached ping | stop | config | clear [--yes] | evict (--lru N | --key K)
    lmcached demo [--workers 2]

Every admin command takes --socket / --name; when no daemon answers it prints one line
and exits with status 1.
"""

import json
import sys

import click

from lmcached.config import load_config
from lmcached.logger import configure_logging
from lmcached.protocol import (
    Clear,
    Clients,
    ConfigGet,
    Connection,
    DaemonError,
    Evict,
    Info,
    Ping,
    Shutdown,
    hello,
)
from lmcached.socket_path import (
    UnsafeSocketPathError,
    check_client_socket_directory,
    default_socket_path,
)
from lmcached.stats import render_clients, render_info


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lmcached")
def main() -> None:
    """lmcached: a local KV-cache daemon that keeps LLM KV cache in shared memory.

    Start it with `lmcached serve`; worker processes attach through
    lmcached.client.CacheEngine. The other commands administer a running daemon.
    """


@main.command()
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False),
              help="TOML file with any of the options below (env: LMCACHED_CONFIG).")
@click.option("--name", metavar="NAME", help="Daemon name: arena /lmcached.<name>.<gen> "
              "[default: default] (env: LMCACHED_NAME).")
@click.option("--socket", "socket_path", metavar="PATH", help="Unix socket path "
              "(env: LMCACHED_SOCKET) [default: $RUNTIME_DIRECTORY/lmcached.sock, "
              "$XDG_RUNTIME_DIR/lmcached/<name>.sock or /tmp/lmcached-<uid>/<name>.sock]. Its "
              "directory must be the daemon user's alone (not a symlink, not writable by "
              "others); a missing one is created 0700.")
@click.option("--capacity", metavar="SIZE", help="Arena size: 512MiB, 8GiB, 25% of RAM "
              "[default: the smaller of 4GiB and 25% of RAM; never more than /dev/shm has "
              "free] (env: LMCACHED_CAPACITY).")
@click.option("--block-size", metavar="SIZE", help="Block size in bytes or units "
              "[default: the chunk size of the first layout that attaches] "
              "(env: LMCACHED_BLOCK_SIZE).")
@click.option("--shm-mode", metavar="MODE", help="Octal permissions of the arena segment "
              "[default: 0600; 0660 with --allow-group] (env: LMCACHED_SHM_MODE).")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"],
              case_sensitive=False), help="[default: INFO] (env: LMCACHED_LOG_LEVEL).")
@click.option("--allow-group", metavar="GROUP", help="Also accept clients of this group: "
              "socket and arena 0660, group GROUP; only the daemon's user and root may "
              "stop, clear or evict (env: LMCACHED_ALLOW_GROUP).")
@click.option("--max-clients", metavar="N", help="Most clients connected at once; more get "
              "a max_clients error. The daemon raises its fd limit to fit, or lowers N to "
              "what the hard limit allows (LimitNOFILE) [default: 1024] "
              "(env: LMCACHED_MAX_CLIENTS).")
@click.option("--idle-timeout", metavar="SECONDS", help="Disconnect a client that sent no "
              "request for this long, like Redis `timeout` [default: 0 = never] "
              "(env: LMCACHED_IDLE_TIMEOUT).")
@click.option("--buffer-budget", metavar="SIZE", help="Input and output buffers of all "
              "clients together; beyond it the clients holding the most are dropped "
              "[default: 128MiB] (env: LMCACHED_BUFFER_BUDGET).")
def serve(config_file, name, socket_path, capacity, block_size, shm_mode, log_level,
          allow_group, max_clients, idle_timeout, buffer_budget) -> None:
    """Run the daemon in the foreground until SIGTERM, SIGINT or `lmcached stop`.

    Creates and prefaults the shared-memory arena (progress on stderr), listens on the
    Unix socket, and notifies systemd (READY=1) when it serves. Every option is also an
    LMCACHED_* variable and a key of the TOML file (`max_clients = 512`), with the same
    type in each.
    """
    from lmcached.server import run_server

    options = {
        "name": name, "socket": socket_path, "capacity": capacity, "block_size": block_size,
        "shm_mode": shm_mode, "log_level": log_level, "allow_group": allow_group,
        "max_clients": max_clients, "idle_timeout": idle_timeout,
        "buffer_budget": buffer_budget,
    }
    try:
        config = load_config(options, config_file)
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    configure_logging(config.log_level)
    sys.exit(run_server(config))


def _admin_options(func):
    func = click.option("--socket", "socket_path", help="Daemon socket (env: LMCACHED_SOCKET).")(func)
    func = click.option("--name", default="default", show_default=True,
                        envvar="LMCACHED_NAME", help="Daemon name, to find its socket.")(func)
    return func


def _request(socket_path: str | None, name: str, message):
    """Send one admin request; a missing daemon is one line and exit status 1."""
    path = socket_path or default_socket_path(name)
    try:
        check_client_socket_directory(path)
    except UnsafeSocketPathError as exc:
        click.echo(f"lmcached: {exc}", err=True)
        sys.exit(1)
    try:
        with Connection(path, timeout_s=10.0) as conn:
            hello(conn, "lmcached-cli")
            return conn.request(message)
    except (FileNotFoundError, ConnectionRefusedError):
        click.echo(f"lmcached: no daemon is running on {path}", err=True)
        sys.exit(1)
    except (ConnectionError, TimeoutError, OSError) as exc:
        click.echo(f"lmcached: cannot talk to the daemon on {path}: {exc}", err=True)
        sys.exit(1)
    except DaemonError as exc:
        click.echo(f"lmcached: the daemon refused: {exc}", err=True)
        sys.exit(1)


@main.command()
@click.argument("section", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_admin_options
def info(section, as_json, socket_path, name) -> None:
    """Server statistics: server, memory, blocks, clients, stats (or one SECTION)."""
    reply = _request(socket_path, name, Info(section))
    click.echo(json.dumps(reply.sections, indent=2) if as_json else render_info(reply.sections))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_admin_options
def clients(as_json, socket_path, name) -> None:
    """One line per connected client: id, pid, process, RSS, namespace, pins."""
    reply = _request(socket_path, name, Clients())
    if as_json:
        click.echo(json.dumps(reply.clients, indent=2))
    elif reply.clients:
        click.echo(render_clients(reply.clients))


@main.command()
@_admin_options
def ping(socket_path, name) -> None:
    """Check that the daemon answers (prints PONG)."""
    _request(socket_path, name, Ping())
    click.echo("PONG")


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
    """Evict every cached value that nobody is reading."""
    if not yes:
        click.confirm("Evict every unpinned value from the cache?", abort=True)
    reply = _request(socket_path, name, Clear())
    click.echo(f"evicted {reply.count}")


@main.command()
@_admin_options
def stop(socket_path, name) -> None:
    """Stop the daemon gracefully (as SIGTERM)."""
    _request(socket_path, name, Shutdown())
    click.echo("stopping")


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
              help="demo: ~1-2 s cold prefills; tiny: seconds in all (tests).")
@click.option("--socket", "socket_path", help="Use the daemon on this socket instead of "
              "starting one on a temp socket.")
@click.option("--capacity", default="1GiB", show_default=True,
              help="Arena of the daemon the demo starts.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON at the end.")
def demo(workers, size, socket_path, capacity, as_json) -> None:
    """Worker processes running a real transformer share prompt prefixes.

    Builds a Llama-architecture model with random weights in each worker (nothing is
    downloaded), trains a tokenizer on Python's documentation, runs RAG-like prompts,
    and prints per request the cached tokens and TTFT, then a summary. Needs the `hf`
    extra (transformers). Exits with status 1 if an output differs from a no-cache run.
    """
    try:
        from lmcached.examples.demo import run_demo
    except ImportError as exc:
        raise click.ClickException(f"the demo needs the hf extra (pip install 'lmcached[hf]'): {exc}")
    log = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    try:
        summary = run_demo(workers, size, socket_path, capacity, log)
    except (RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    if not summary["outputs_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
