"""`lmcached`: the daemon that keeps LLM KV cache in shared memory, its protocol and CLI.

The distribution has four import packages, whose names differ from their folders:
`lmcached` (this folder), `lmcached.shm` (folder `shm/`: the arena and the block pool),
`lmcached.client` (folder `client/`: the engine used inside worker processes) and
`lmcached.examples` (folder `examples/`: what `lmcached demo` runs). See docs/architecture.md.

What lives here:
    server.py, connection.py   the event loop and one client connection's buffers
    startup.py                 the start-up steps before the loop serves
    service.py, session.py     request semantics and what each session holds
    keys.py                    the block pool's keys for chunks and string keys
    info.py, stats.py          INFO / CLIENTS fields (daemon) and their text (CLI)
    protocol.py                the wire protocol shared with the clients
    record_format.py           chunk hashes and the record header, shared with the clients
    l2/                        the L2 tier on Redis (--l2): keys and values, I/O, threads
    config.py, envs.py         configuration and every LMCACHED_* variable
    sizes.py                   sizes as typed: parse "8GiB" / "10TB", echo, *_human form
    metrics.py, metrics_http.py  the Prometheus endpoint (--metrics-port): its collector, and
                               its HTTP server, bounded against hostile local processes
    socket_path.py             where the socket lives and whether it can be trusted
    cli.py, launcher.py        the `lmcached` command and daemon subprocesses
    logger.py, notify.py       logging and systemd's notify protocol

What it may import: `lmcached.shm`, never `lmcached.client` (the daemon runs without
torch and the client engine); the one exception is the CLI's `demo` command, which
imports `lmcached.examples.demo` inside the command. Clients import `protocol`, `socket_path`,
`envs`, `logger` and `record_format` from here, so those five import nothing else of the
daemon. redis-py is imported only by `l2/redis_store.py`, only with --l2.
"""

__version__ = "0.1.0"
