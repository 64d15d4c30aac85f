"""Every setting of the daemon, declared once: `SETTINGS`, and the `Settings` schema built from it.

Why this file exists: one entry per setting says everything about it (type and bounds,
parser, --help text, click default, the `ServerConfig` field it sets), and every source
is built from these entries by `lmcached.config`: the option of `lmcached serve`, its
LMCACHED_* variable, its TOML key and the daemon's field. Adding a setting is adding one
entry here and one field to `ServerConfig` (lmcached/daemon/server_config.py).
"""

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

from lmcached.daemon.server_config import (
    DEFAULT_DISK_CAPACITY,
    DEFAULT_MAX_CLIENTS,
    DEFAULT_MAX_SESSION_SHARE,
    DEFAULT_METRICS_HOST,
    DEFAULT_WRITING_TIMEOUT_S,
)
from lmcached.shm.geometry import MAX_NUM_BLOCKS, MIN_BLOCK_BYTES
from lmcached.sizes import parse_size
from lmcached.wire.extras import install_hint
from lmcached.wire.protocol import MAX_FRAME_BYTES
from lmcached.wire.socket_path import DEFAULT_NAME
from lmcached.wire.units import echo_size, format_size, size_style

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

Size = str | int  # "8GiB", "4GB", "25%" (of RAM) or whole bytes
_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
_Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e9)]  # a duration; 0 = off or none


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of the daemon, declared once: its schema, its option, its field.

    Attributes:
        type: the value's type and bounds as a source gives it (msgspec: the TOML
            file's values must have exactly this type, option and environment strings
            are converted, `"1024"` -> 1024); `Settings` is built from these.
        parse: turns the typed value into the effective one (units, octal, upper case);
            raises ValueError with the accepted forms.
        expected: what a value must look like, for type errors.
        metavar: the option's placeholder in --help.
        help: the option's help text.
        default: click's default, given as a source would give it (`"128MiB"`); None =
            none, or one that depends on another setting (`config_from_context`).
        default_text: what --help says of a default that `default` does not show.
        hidden: left out of --help (test-only settings).
        field: the `ServerConfig` field it sets; None = the setting's own name.
    """

    type: Any
    parse: Callable[[Any], Any]
    expected: str
    metavar: str
    help: str
    default: Any = None
    default_text: str | None = None
    hidden: bool = False
    field: str | None = None


def _parse_name(value: str) -> str:
    from lmcached.shm.arena import segment_name  # the arena owns the name's syntax

    segment_name(value, 0)
    return value


def _parse_capacity(value: Size) -> int:
    from lmcached.shm.arena import HEADER_BYTES  # the arena owns its layout

    capacity_bytes = parse_size(value)
    if capacity_bytes < HEADER_BYTES + MIN_BLOCK_BYTES:
        raise ValueError(
            f"capacity {echo_size(value, capacity_bytes)} leaves no room for a block: the "
            f"arena needs at least {HEADER_BYTES + MIN_BLOCK_BYTES} bytes (its "
            f"{HEADER_BYTES}-byte header and one {MIN_BLOCK_BYTES}-byte block)"
        )
    return capacity_bytes


def _parse_block_size(value: Size) -> int:
    block_bytes = parse_size(value)
    if block_bytes % 64:
        raise ValueError(f"block size {echo_size(value, block_bytes)} is not a multiple of 64 "
                         "bytes")
    return block_bytes


def _parse_mode(value: str | int) -> int:
    try:
        mode = int(value, 8) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"shm mode {value!r} is not octal (e.g. 0600)") from None
    hint = ' (a TOML integer is decimal: write "0660" or 0o660)' * isinstance(value, int)
    if not 0 <= mode <= 0o777:
        raise ValueError(f"shm mode {value!r} is out of range{hint}")
    if mode & 0o007:
        raise ValueError(
            f"shm mode {value!r} (0{mode:03o}) gives other users access to the arena, and "
            f"so to every cached prompt{hint}: use 0600, or 0660 with --allow-group to share "
            "it with a group"
        )
    return mode


def _parse_log_level(value: str) -> str:
    level = value.upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"unknown log level {value!r}; use one of {', '.join(LOG_LEVELS)}")
    return level


def _parse_l2_url(value: str) -> str:
    try:  # the L2 tier owns the URL's syntax; redis-py is imported only with --l2
        from lmcached.daemon.l2.redis_store import parse_l2_url
    except ImportError as exc:
        raise ValueError(f"the L2 tier needs redis-py ({exc}): {install_hint('l2')}") from None
    parse_l2_url(value)
    return value


def _parse_l2_queue(value: Size) -> int:
    queue_bytes = parse_size(value)
    if queue_bytes < 1 << 20:
        raise ValueError(f"L2 queue {echo_size(value, queue_bytes)} is less than 1MiB")
    return queue_bytes


def _parse_disk_capacity(value: Size) -> str:
    # A percentage is of the directory's free space, known only at start: kept as text.
    if isinstance(value, str) and value.strip().endswith("%"):
        parse_size(value, total_bytes=1 << 50)  # checks the percentage
        return value.strip()
    capacity_bytes = parse_size(value)
    if capacity_bytes < 1 << 20:
        raise ValueError(f"disk capacity {echo_size(value, capacity_bytes)} is less than 1MiB")
    return str(capacity_bytes)


def _parse_gpu_capacity(value: Size) -> int:
    capacity_bytes = parse_size(value)
    if capacity_bytes < 1 << 20:
        raise ValueError(f"GPU tier {echo_size(value, capacity_bytes)} is less than 1MiB")
    return capacity_bytes


MAX_GPU_DEVICES = 16


def _parse_gpu_devices(value: str | int) -> tuple[int, ...]:
    parts = [value] if isinstance(value, int) else [p.strip() for p in value.split(",")]
    try:
        devices = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"GPU devices {value!r} must be device numbers such as 0 or 0,1") \
            from None
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise ValueError(f"GPU devices {value!r} must be distinct numbers >= 0")
    if len(devices) > MAX_GPU_DEVICES:
        raise ValueError(f"GPU devices {value!r}: at most {MAX_GPU_DEVICES}")
    return devices


def _parse_buffer_budget(value: Size) -> int:
    budget_bytes = parse_size(value)
    if budget_bytes < MAX_FRAME_BYTES:
        raise ValueError(
            f"buffer budget {echo_size(value, budget_bytes)} is less than one largest frame "
            f"({format_size(MAX_FRAME_BYTES, size_style(value))})"
        )
    return budget_bytes


# Every setting, in the order --help lists them.
SETTINGS: dict[str, Setting] = {
    "name": Setting(
        _NonEmpty,
        _parse_name, 'a daemon name, e.g. "llama"', "NAME",
        "Daemon name: arena /lmcached.<name>.<gen> and the default socket's name.",
        DEFAULT_NAME),
    "socket": Setting(
        _NonEmpty,
        str, 'a socket path, e.g. "/run/lmcached/lmcached.sock"', "PATH",
        "Unix socket path. Its directory must be the daemon user's alone (not a symlink, "
        "not writable by others); a missing one is created 0700.",
        None, "$RUNTIME_DIRECTORY/lmcached.sock, $XDG_RUNTIME_DIR/lmcached/<name>.sock or "
        "/tmp/lmcached-<uid>/<name>.sock"),
    "capacity": Setting(
        Size,
        _parse_capacity, 'a size such as "8GiB", "4GB", "25%" or whole bytes', "SIZE",
        "Arena size: 512MiB, 8GiB, 4GB, 25% (of RAM) or bytes; never more than /dev/shm "
        "has free.",
        None, "the smaller of 4GiB and 25% of RAM", field="capacity_bytes"),
    "block_size": Setting(
        Size,
        _parse_block_size, 'a size such as "2MiB" or whole bytes', "SIZE",
        "Block size in bytes or units, a multiple of 64, at least capacity / "
        f"{MAX_NUM_BLOCKS} (at most {MAX_NUM_BLOCKS} blocks).",
        None, "the chunk size of the first layout that attaches", field="block_bytes"),
    "shm_mode": Setting(
        str | int,  # "0660", or an integer such as 0o660 in TOML
        _parse_mode, 'octal permission bits as a string, e.g. "0660" (0o660 in TOML)', "MODE",
        "Octal permissions of the arena segment; bits for others are refused. "
        "Without group read, --allow-group members cannot map the arena, and the event "
        "feed sends them no token ids.",
        None, "0600; 0660 with --allow-group"),
    "log_level": Setting(
        str,
        _parse_log_level, "DEBUG, INFO, WARNING or ERROR", "LEVEL",
        "DEBUG, INFO, WARNING or ERROR; SIGHUP re-reads it.",
        "INFO"),
    "allow_group": Setting(
        _NonEmpty,
        str, 'a group name, e.g. "lmcached"', "GROUP",
        "Also accept clients of this group: socket and arena 0660, group GROUP; only the "
        "daemon's user and root may stop, clear or evict."),
    "max_clients": Setting(
        Annotated[int, msgspec.Meta(ge=1)],
        int, "a whole number of clients, at least 1", "N",
        "Most clients connected at once; more get a max_clients error. The daemon raises "
        "its fd limit to fit, or lowers N to what the hard limit allows (LimitNOFILE).",
        DEFAULT_MAX_CLIENTS),
    "events_capacity": Setting(
        Annotated[int, msgspec.Meta(ge=1)],
        int, "a whole number of events, at least 1", "N",
        "Chunk events (stored, removed) the event feed keeps for its subscribers "
        "(docs/kv-events.md); a subscriber further behind loses the oldest, counted.",
        65536),
    "idle_timeout": Setting(
        _Seconds,
        float, "seconds, e.g. 300 or 0.5; 0 = off", "SECONDS",
        "Disconnect a client that sent no request for this long, like Redis `timeout`.",
        0.0, "0 = never", field="idle_timeout_s"),
    "max_session_share": Setting(
        Annotated[float, msgspec.Meta(gt=0, le=100)],  # percent
        float, "a percentage of the arena's blocks, more than 0 and at most 100, e.g. 50",
        "PERCENT",
        "Most of the arena one client session may hold at once, in blocks being written "
        "and blocks pinned for reading (percent); beyond it that session's stores get "
        "NOSPACE and its reads a shorter prefix, never the other sessions'. Also the "
        "largest value a PUT may store.",
        DEFAULT_MAX_SESSION_SHARE),
    "writing_timeout": Setting(
        _Seconds,
        float, "seconds, e.g. 60; 0 = never", "SECONDS",
        "Abort a store's blocks that were allocated this long ago and not yet committed "
        "(counted: INFO writing_expired); its late COMMIT is refused (`expired`).",
        DEFAULT_WRITING_TIMEOUT_S, "60; 0 = never", field="writing_timeout_s"),
    "buffer_budget": Setting(
        Size,
        _parse_buffer_budget, 'a size such as "128MiB" or whole bytes', "SIZE",
        "Input and output buffers of all clients together; beyond it the clients holding "
        "the most are dropped.",
        "128MiB", field="buffer_budget_bytes"),
    "metrics_port": Setting(
        Annotated[int, msgspec.Meta(ge=1, le=65535)],
        int, "a TCP port number, 1-65535", "PORT",
        "Serve Prometheus metrics on http://HOST:PORT/metrics (docs/metrics.md). A port "
        "in use stops the start-up.",
        None, "off"),
    "metrics_host": Setting(
        _NonEmpty,
        str, 'an address to listen on, e.g. "127.0.0.1" or "::"', "HOST",
        "Address of the metrics endpoint; 0.0.0.0 exposes the cache's statistics to the "
        "network.",
        DEFAULT_METRICS_HOST),
    "l2": Setting(
        _NonEmpty,
        _parse_l2_url, 'a Redis URL, e.g. "redis://10.0.0.5:6379"', "URL",
        "L2 tier on Redis or Valkey (docs/l2.md): redis://HOST:PORT[,HOST:PORT...]; a "
        f"cluster when the servers say so. Needs redis-py: {install_hint('l2')}.",
        None, "off", field="l2_url"),
    "l2_policy": Setting(
        Literal["write-through", "on-evict"],
        str, '"write-through" or "on-evict"', "POLICY",
        "Which chunks go to L2: write-through (every stored chunk, asynchronously) or "
        "on-evict (chunks evicted from the arena by pressure).",
        "write-through"),
    "l2_ttl": Setting(
        _Seconds,
        float, "seconds, e.g. 86400; 0 = none", "SECONDS",
        "Time to live of the chunks written to L2.",
        0.0, "0 = none", field="l2_ttl_s"),
    "l2_queue": Setting(
        Size,
        _parse_l2_queue, 'a size such as "256MiB"', "SIZE",
        "Bytes of chunks that may wait to be written to L2; beyond, writes are dropped "
        "and counted (a slow L2 never slows a store).",
        "256MiB", field="l2_queue_bytes"),
    "l2_fetch_wait": Setting(
        Annotated[float, msgspec.Meta(ge=0, le=60)],  # seconds
        float, "seconds, e.g. 0.5; 0 = do not wait", "SECONDS",
        "How long a lookup that misses in the arena waits for L2 to fetch the rest of its "
        "prefix; a fetch still running after that is installed for the next lookup. Keep "
        "it below the clients' LMCACHED_DATA_TIMEOUT_MS (200 ms by default).",
        0.1, field="l2_fetch_wait_s"),
    "l2_threads": Setting(
        Annotated[int, msgspec.Meta(ge=1, le=64)],
        int, "a whole number of threads, 1-64", "N",
        "Threads that write chunks to L2, and as many that fetch them.",
        2),
    "disk_path": Setting(
        _NonEmpty,
        str, 'a directory, e.g. "/var/cache/lmcached"', "DIR",
        "Disk tier (docs/operator.md): a slot file in DIR (local NVMe) holds the chunks the "
        "arena evicts and serves them back; a restarted daemon serves them again. DIR must "
        "be the daemon user's alone (not a symlink, not writable by others); a missing one "
        "is created 0700; one daemon per DIR. A slot holds one arena block: a chunk "
        "spanning several blocks is not written (INFO disk_write_drops_oversize).",
        None, "off"),
    "disk_capacity": Setting(
        Size,
        _parse_disk_capacity, 'a size such as "100GiB", or "50%" of the free space', "SIZE",
        "Size of the disk tier's slot file: bytes, 100GiB, or a percentage of the free space "
        "of --disk-path's filesystem at start.",
        DEFAULT_DISK_CAPACITY),
    "disk_policy": Setting(
        Literal["on-evict", "write-through"],
        str, '"on-evict" or "write-through"', "POLICY",
        "Which chunks go to disk: on-evict (chunks the arena evicts under pressure) or "
        "write-through (every stored chunk, asynchronously).",
        "on-evict"),
    "disk_fetch_wait": Setting(
        Annotated[float, msgspec.Meta(ge=0, le=60)],  # seconds
        float, "seconds, e.g. 0.5; 0 = do not wait", "SECONDS",
        "How long a lookup that misses in the arena waits for the disk tier to read the "
        "rest of its prefix; keep it below the clients' LMCACHED_DATA_TIMEOUT_MS.",
        0.1, field="disk_fetch_wait_s"),
    "disk_save_on_stop": Setting(
        Annotated[float, msgspec.Meta(ge=0, le=3600)],  # seconds
        float, "seconds, e.g. 20; 0 = off", "SECONDS",
        "On a graceful stop, write the arena's chunks that are not on disk yet, most "
        "recently used first, for at most this long (keep it below the unit's "
        "TimeoutStopSec); a restart reads the hottest back into the arena.",
        20.0, field="disk_save_on_stop_s"),
    "gpu_capacity": Setting(
        Size,
        _parse_gpu_capacity, 'a size such as "8GiB"', "SIZE",
        "GPU tier: this much device memory per --gpu-device, owned by the daemon and "
        "shared with clients by CUDA VMM file descriptors; chunks stored from a GPU go "
        "there first and are demoted to the arena when it fills (docs/architecture.md, "
        f"\"Tiers\"). Needs NVIDIA's cuda-bindings: {install_hint('gpu')}.",
        None, "off", field="gpu_capacity_bytes"),
    "gpu_device": Setting(
        str | int,  # "0,1", or an integer in TOML
        _parse_gpu_devices, 'device numbers, e.g. "0" or "0,1"', "N[,N...]",
        "The CUDA devices that get a GPU tier (with --gpu-capacity), as numbered inside "
        "the daemon's CUDA_VISIBLE_DEVICES.",
        None, "0", field="gpu_devices"),
    "gpu_backend": Setting(
        Literal["cuda", "fake"],
        str, '"cuda" or "fake"', "BACKEND",
        "cuda, or fake: memfd tiers that stand in for GPUs (tests and CI without one).",
        "cuda", hidden=True),
}
Settings = msgspec.defstruct(
    "Settings", [(key, setting.type | None, None) for key, setting in SETTINGS.items()],
    module=__name__, forbid_unknown_fields=True, kw_only=True)
Settings.__doc__ = """The daemon's settings as one source gives them; None = this source does not.

The one schema of every source (built from `SETTINGS`): the keys of the TOML file, the
options of `lmcached serve` and the LMCACHED_* variables."""
