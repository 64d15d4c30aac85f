"""Every LMCACHED_* environment variable, with its default and meaning (one place).

The daemon's options resolve as: command-line option, else environment variable, else
the TOML config file, else the default in `lmcached.config`. Click applies that
precedence: each `serve` option declared in `lmcached.config` names its variable
(`envvar=`), and the file becomes click's `default_map`. `ENV_VARS` documents them all
(and the clients' variables, read through `get`).
"""

import os

ENV_VARS: dict[str, str] = {
    "LMCACHED_CONFIG": "path of a TOML config file for `lmcached serve`",
    "LMCACHED_NAME": "daemon name: arena segment /lmcached.<name>.<gen> and socket name",
    "LMCACHED_SOCKET": "path of the daemon's Unix socket (daemon and clients)",
    "LMCACHED_CAPACITY": "arena size: bytes, 512MiB, 8GiB or 25% of RAM",
    "LMCACHED_BLOCK_SIZE": "block size in bytes (default: the first layout's chunk size)",
    "LMCACHED_SHM_MODE": "octal permission bits of the arena segment (default 0600)",
    "LMCACHED_LOG_LEVEL": "DEBUG, INFO, WARNING or ERROR",
    "LMCACHED_ALLOW_GROUP": "also accept clients of this group (socket and arena 0660)",
    "LMCACHED_MAX_CLIENTS": "most clients connected at once (default 1024)",
    "LMCACHED_EVENTS_CAPACITY": "chunk events the event feed keeps for its subscribers",
    "LMCACHED_IDLE_TIMEOUT": "seconds without a request before a client is disconnected "
    "(default 0 = never)",
    "LMCACHED_MAX_SESSION_SHARE": "percent of the arena one client session may hold, blocks "
    "being written and pinned together (default 50)",
    "LMCACHED_WRITING_TIMEOUT": "seconds after which blocks allocated and not committed are "
    "aborted (default 60; 0 = never)",
    "LMCACHED_BUFFER_BUDGET": "input and output buffers of all clients together (default 128MiB)",
    "LMCACHED_METRICS_PORT": "TCP port of the Prometheus metrics endpoint of `lmcached serve` "
    "(default: none, metrics off; docs/metrics.md)",
    "LMCACHED_METRICS_HOST": "address the metrics endpoint listens on (default 127.0.0.1)",
    "LMCACHED_L2": "L2 tier's Redis servers, redis://HOST:PORT[,HOST:PORT...] (docs/l2.md)",
    "LMCACHED_L2_POLICY": "which chunks go to L2: write-through (default) or on-evict",
    "LMCACHED_L2_TTL": "time to live of L2 values in seconds (default 0 = none)",
    "LMCACHED_L2_QUEUE": "bytes of L2 writes that may wait before writes are dropped (256MiB)",
    "LMCACHED_L2_FETCH_WAIT": "seconds a lookup waits for an L2 fetch (default 0.1)",
    "LMCACHED_L2_THREADS": "L2 writer threads, and as many fetch threads (default 2)",
    "LMCACHED_DISK_PATH": "directory of the disk tier's slot file (default: no disk tier)",
    "LMCACHED_DISK_CAPACITY": "disk tier size: bytes, 100GiB, or 50% of the directory's free "
    "space (default 10%)",
    "LMCACHED_DISK_POLICY": "which chunks go to disk: on-evict (default) or write-through",
    "LMCACHED_DISK_FETCH_WAIT": "seconds a lookup waits for a disk fetch (default 0.1)",
    "LMCACHED_DISK_SAVE_ON_STOP": "seconds a graceful stop may write the arena's chunks to "
    "the disk tier (default 20; 0 = off)",
    "LMCACHED_GPU_CAPACITY": "GPU tier size per device, e.g. 8GiB (default: no GPU tier)",
    "LMCACHED_GPU_DEVICE": "CUDA devices with a GPU tier, e.g. 0 or 0,1 (default 0)",
    "LMCACHED_GPU_BACKEND": "cuda, or fake: memfd tiers standing in for GPUs (tests)",
    "LMCACHED_DATA_TIMEOUT_MS": "clients: timeout of a serving-path request (LOOKUP, ACQUIRE, "
    "ALLOC, COMMIT, ...) and of a reconnect, in milliseconds (default 200); a daemon that "
    "does not answer in time is skipped for a back-off window (misses, skipped stores)",
}

# Set by systemd, read here so that no other module touches os.environ.
SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "RUNTIME_DIRECTORY")


def get(name: str) -> str | None:
    """Value of environment variable `name` (an LMCACHED_* or systemd one), or None.

    Raises:
        KeyError: `name` is not a variable lmcached documents (a typo in the code).
    """
    if name not in ENV_VARS and name not in SYSTEMD_VARS and name != "XDG_RUNTIME_DIR":
        raise KeyError(f"{name} is not an lmcached environment variable")
    value = os.environ.get(name)
    return value if value else None
