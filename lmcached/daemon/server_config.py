"""What the daemon runs with: `ServerConfig`, one daemon's effective configuration.

Why this file exists: the daemon consumes its configuration as typed fields in their
units (`capacity_bytes`, `idle_timeout_s`), while where each setting comes from (flags,
LMCACHED_* variables, the TOML file, with click) is the operations layer's
(`lmcached.config`, which builds a `ServerConfig`). The daemon imports this module,
never `lmcached.config`: request semantics do not depend on click.
"""

import dataclasses
from collections.abc import Callable

from lmcached.wire.socket_path import DEFAULT_NAME

DEFAULT_SHM_MODE = 0o600
DEFAULT_MAX_CLIENTS = 1024
# One session may hold (WRITING + pinned) at most this share of the arena's blocks: the
# rest stays free or evictable for every other session (docs/architecture.md, "Limits").
DEFAULT_MAX_SESSION_SHARE = 50.0  # percent
DEFAULT_WRITING_TIMEOUT_S = 60.0  # an allocation not committed by then is aborted
DEFAULT_BUFFER_BUDGET_BYTES = 128 << 20
DEFAULT_METRICS_HOST = "127.0.0.1"  # metrics are for this node's Prometheus agent
DEFAULT_L2_QUEUE_BYTES = 256 << 20
DEFAULT_DISK_CAPACITY = "10%"  # of the disk directory's free space at start


@dataclasses.dataclass
class ServerConfig:
    """Effective configuration of one daemon (what `lmcached config` prints).

    Built by `lmcached.config` from the settings' sources; tests build one directly.

    Attributes:
        name: daemon name (arena segment and default socket name).
        socket: path of the Unix socket.
        capacity_bytes: arena size in bytes.
        block_bytes: block size in bytes; 0 = set by the first layout that attaches.
        shm_mode: permission bits of the arena segment (0660 with allow_group, unless
            given).
        log_level: logging level name.
        allow_group: group name whose members may connect and map the arena, or None.
        config_file: the TOML file read, or None.
        prefault: populate the arena at start (always on outside tests).
        max_clients: most connections at once (Redis `maxclients`); the daemon lowers it
            at start when its file descriptor limit cannot hold that many.
        events_capacity: chunk events the event feed keeps (lmcached/daemon/events.py).
        idle_timeout_s: a client without a request for this long is disconnected, in
            seconds; 0 = never (Redis `timeout`).
        max_session_share: percent of the host arena's blocks one session may hold,
            WRITING and pinned together; also bounds a PUT value's size.
        writing_timeout_s: WRITING blocks allocated longer ago than this, in seconds,
            are aborted by the daemon's housekeeping; 0 = never.
        buffer_budget_bytes: input and output buffers of all clients together, in bytes.
        metrics_port: TCP port of the Prometheus endpoint; None = no endpoint.
        metrics_host: address the endpoint listens on.
        l2_url: the L2 tier's servers (`redis://HOST:PORT[,HOST:PORT...]`), None = no L2.
        l2_policy: "write-through" or "on-evict".
        l2_ttl_s: time to live of L2 values in seconds; 0 = none.
        l2_queue_bytes: bytes of L2 writes that may wait.
        l2_fetch_wait_s: how long a LOOKUP / ACQUIRE waits for an L2 fetch, in seconds.
        l2_threads: L2 writer threads (and as many fetch threads).
        disk_path: the disk tier's directory, None = no disk tier.
        disk_capacity: the disk tier's size: whole bytes, or a percentage of the
            directory's free space ("10%"), as text; resolved at start.
        disk_policy: "on-evict" or "write-through".
        disk_fetch_wait_s: how long a LOOKUP / ACQUIRE waits for a disk fetch, in seconds.
        disk_save_on_stop_s: how long a graceful stop may write the arena's chunks to
            the disk tier, in seconds; 0 = off.
        gpu_capacity_bytes: bytes of each GPU tier; 0 = no GPU tier.
        gpu_devices: the CUDA devices with a GPU tier, in tier order (tier 1, 2, ...).
        gpu_backend: "cuda", or "fake" (memfd tiers, devices "fake-<i>": tests).
        size_texts: each size setting as its source typed it (`"10TB"`), so that
            messages echo it in the user's units (`echo_size`).
        cli_options: the command-line options it was resolved from, as given (SIGHUP
            re-resolves with them, so a command-line --log-level keeps precedence).
        sources: where each setting came from, by key (`--allow-group`,
            `LMCACHED_ALLOW_GROUP`, `allow_group in /etc/lmcached/x.toml`, `default`), so
            that an error found at start-up names it (`source_of`).
        reread: how SIGHUP resolves this configuration again from its sources
            (`lmcached.config.reread_config`, set by the operations layer that resolved
            it); None = SIGHUP re-reads nothing.
    """

    name: str = DEFAULT_NAME
    socket: str = ""
    capacity_bytes: int = 0
    block_bytes: int = 0
    shm_mode: int = DEFAULT_SHM_MODE
    log_level: str = "INFO"
    allow_group: str | None = None
    config_file: str | None = None
    prefault: bool = True
    max_clients: int = DEFAULT_MAX_CLIENTS
    idle_timeout_s: float = 0.0
    events_capacity: int = 65536
    max_session_share: float = DEFAULT_MAX_SESSION_SHARE
    writing_timeout_s: float = DEFAULT_WRITING_TIMEOUT_S
    buffer_budget_bytes: int = DEFAULT_BUFFER_BUDGET_BYTES
    metrics_port: int | None = None
    metrics_host: str = DEFAULT_METRICS_HOST
    l2_url: str | None = None
    l2_policy: str = "write-through"
    l2_ttl_s: float = 0.0
    l2_queue_bytes: int = DEFAULT_L2_QUEUE_BYTES
    l2_fetch_wait_s: float = 0.1
    l2_threads: int = 2
    disk_path: str | None = None
    disk_capacity: str = DEFAULT_DISK_CAPACITY
    disk_policy: str = "on-evict"
    disk_fetch_wait_s: float = 0.1
    disk_save_on_stop_s: float = 20.0
    gpu_capacity_bytes: int = 0
    gpu_devices: tuple[int, ...] = ()
    gpu_backend: str = "cuda"
    size_texts: dict = dataclasses.field(default_factory=dict, repr=False)
    cli_options: dict = dataclasses.field(default_factory=dict, repr=False)
    sources: dict = dataclasses.field(default_factory=dict, repr=False)
    reread: Callable[["ServerConfig"], "ServerConfig"] | None = dataclasses.field(
        default=None, repr=False, compare=False)

    def source_of(self, key: str) -> str:
        """Where setting `key` came from (`sources`); its option (`--allow-group`) when
        unknown (a ServerConfig made in code)."""
        return self.sources.get(key) or "--" + key.replace("_", "-")

    def as_dict(self) -> dict[str, int | str]:
        """Flat view for `CONFIG GET`; absent values as '', booleans as 0/1."""
        out = {}
        for field in dataclasses.fields(self):
            if field.name in ("cli_options", "size_texts", "sources", "reread"):
                continue
            value = getattr(self, field.name)
            if field.name == "shm_mode":
                value = f"0{value:o}"
            elif field.name == "gpu_devices":
                value = ",".join(map(str, value))
            elif isinstance(value, bool):
                value = int(value)  # the wire's INFO values are int | float | str
            out[field.name] = "" if value is None else value
        return out
