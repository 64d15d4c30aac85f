"""`lmcached`: a local KV-cache daemon, its wire contract, its client engine and its CLI.

The distribution is one import tree in five layers; a layer never imports one above it
(tests/docs/test_layers.py checks it with import-linter's contracts, pyproject.toml
`[tool.importlinter]`):

    operations   lmcached/ (this folder): cli.py, config.py, settings.py, launcher.py,
        |        sizes.py, info_text.py -- what an operator runs and types
    daemon       lmcached.daemon (lmcached/daemon/)      client   lmcached.client (client/)
        |        the process that owns the memory          |      the engine in workers
        +--------------------------+-------------------------+
                                   |   (the daemon and the client never import each other)
    shared memory                  lmcached.shm (shm/): arena, janitor, device memory
                                   |
    wire contract                  lmcached.wire (lmcached/wire/): messages, frames,
                                   the blocking Connection, record header, socket paths,
                                   LMCACHED_* variables, logging

Each package's docstring says what lives in it and what it may import. `lmcached.examples`
(folder `examples/`) is what `lmcached demo` runs.

What lives here (operations):
    cli.py, launcher.py        the `lmcached` command and daemon subprocesses
    settings.py                every setting, declared once (type, parser, help, default,
                               the daemon's `ServerConfig` field)
    config.py                  the sources built from them: flags, LMCACHED_* variables,
                               the TOML file; resolves a `ServerConfig`
    sizes.py                   sizes as typed: parse "8GiB" / "10TB" / "25%"
    info_text.py               INFO / CLIENTS replies as text (after redis-cli)

What it may import: every layer below. Only the CLI's `demo` command imports the client
(`lmcached.examples.demo`, inside the command).
"""

__version__ = "0.1.0"
