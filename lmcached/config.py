"""Daemon configuration: one typed schema for flags, LMCACHED_* variables and the TOML file.

click resolves where each setting comes from: every option of `lmcached serve` declares
its `LMCACHED_*` variable (`envvar=`), and the TOML file (`--config`, else
`$LMCACHED_CONFIG`) becomes the context's `default_map`, so the precedence is click's own:
command-line option > LMCACHED_* environment variable > config file > default. Every
setting has the same name and type in each source (`Settings`): the TOML key
`max_clients`, the option `--max-clients`, the variable `LMCACHED_MAX_CLIENTS`. Whatever
its source, a value goes through `Settings` (msgspec) and then its parser; a value of the
wrong type is an error naming the key and its source (`socket = 7` in the file is
refused, not turned into a socket named "7"). Sizes (`8GiB`, `4GB`, `25%`, bytes) are
read by `lmcached.sizes`, and a message about a size echoes it in the units typed.

This module declares the options (`serve_params`, used by `lmcached.cli`) and turns a
parsed click context into a `ServerConfig` (`config_from_context`); `load_config` runs
the same options on a dict, for the daemon's SIGHUP re-read and for tests.
"""

import dataclasses
import os
import shutil
import tomllib
from collections.abc import Callable
from typing import Annotated, Any, Literal

import click
import msgspec
import psutil
from click.core import ParameterSource

from lmcached.wire.protocol import MAX_FRAME_BYTES
from lmcached.sizes import (
    MAX_NUM_BLOCKS,
    MIN_BLOCK_BYTES,
    echo_size,
    format_size,
    min_block_bytes,
    parse_size,
    size_style,
)
from lmcached.wire.socket_path import DEFAULT_NAME, default_socket_path  # noqa: F401 (re-export)

DEFAULT_CAPACITY_BYTES = 4 << 30  # and at most 25% of RAM
DEFAULT_RAM_FRACTION = 0.25
DEFAULT_SHM_MODE = 0o600
DEFAULT_GROUP_SHM_MODE = 0o660  # with --allow-group: members map the arena read-write
DEFAULT_MAX_CLIENTS = 1024
# One session may hold (WRITING + pinned) at most this share of the arena's blocks: the
# rest stays free or evictable for every other session (docs/architecture.md, "Limits").
DEFAULT_MAX_SESSION_SHARE = 50.0  # percent
DEFAULT_WRITING_TIMEOUT_S = 60.0  # an allocation not committed by then is aborted
DEFAULT_BUFFER_BUDGET_BYTES = 128 << 20
DEFAULT_METRICS_HOST = "127.0.0.1"  # metrics are for this node's Prometheus agent
DEFAULT_L2_QUEUE_BYTES = 256 << 20
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def default_capacity_bytes() -> int:
    """The smaller of 4 GiB and 25% of physical RAM."""
    return min(DEFAULT_CAPACITY_BYTES, int(psutil.virtual_memory().total * DEFAULT_RAM_FRACTION))


def shm_free_bytes() -> int:
    """Free bytes in /dev/shm (where POSIX shared memory lives on Linux)."""
    return shutil.disk_usage("/dev/shm").free


Size = str | int  # "8GiB", "4GB", "25%" (of RAM) or whole bytes


class Settings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The daemon's settings as a source gives them; None = this source does not.

    The one schema of every source: the keys of the TOML file, the options of
    `lmcached serve` (`--max-clients` for `max_clients`) and the LMCACHED_* variables
    (`LMCACHED_MAX_CLIENTS`). Types and bounds are declared here once; the file's values
    must have exactly these types, while option and environment strings are converted
    (`"1024"` -> 1024). Each option's parser then reads units (`SETTINGS`), and
    `config_from_context` fills in the defaults that depend on other settings.
    """

    name: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    socket: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    capacity: Size | None = None
    block_size: Size | None = None
    shm_mode: str | int | None = None  # "0660", or an integer such as 0o660 in TOML
    log_level: str | None = None
    allow_group: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    max_clients: Annotated[int, msgspec.Meta(ge=1)] | None = None
    idle_timeout: Annotated[float, msgspec.Meta(ge=0, le=1e9)] | None = None  # seconds
    max_session_share: Annotated[float, msgspec.Meta(gt=0, le=100)] | None = None  # percent
    writing_timeout: Annotated[float, msgspec.Meta(ge=0, le=1e9)] | None = None  # seconds
    buffer_budget: Size | None = None
    metrics_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    metrics_host: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    l2: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    l2_policy: Literal["write-through", "on-evict"] | None = None
    l2_ttl: Annotated[float, msgspec.Meta(ge=0, le=1e9)] | None = None  # seconds
    l2_queue: Size | None = None
    l2_fetch_wait: Annotated[float, msgspec.Meta(ge=0, le=60)] | None = None  # seconds
    l2_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    gpu_capacity: Size | None = None
    gpu_device: str | int | None = None  # "0,1", or an integer in TOML
    gpu_backend: Literal["cuda", "fake"] | None = None


@dataclasses.dataclass(frozen=True)
class SettingSpec:
    """How one field of `Settings` is offered as an option of `lmcached serve`.

    Attributes:
        parse: turns the value typed by `Settings` into the effective one (units,
            octal, upper case); raises ValueError with the accepted forms.
        expected: what a value must look like, for type errors.
        metavar: the option's placeholder in --help.
        help: the option's help text.
        default: click's default, given as a source would give it (`"128MiB"`); None =
            none, or one that depends on another setting (`config_from_context`).
        default_text: what --help says of a default that `default` does not show.
    """

    parse: Callable[[Any], Any]
    expected: str
    metavar: str
    help: str
    default: Any = None
    default_text: str | None = None
    hidden: bool = False


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
        raise ValueError(f"the L2 tier needs redis-py ({exc}): pip install 'lmcached[l2]'") \
            from None
    parse_l2_url(value)
    return value


def _parse_l2_queue(value: Size) -> int:
    queue_bytes = parse_size(value)
    if queue_bytes < 1 << 20:
        raise ValueError(f"L2 queue {echo_size(value, queue_bytes)} is less than 1MiB")
    return queue_bytes


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


# One entry per field of `Settings`, in the order --help lists them.
SETTINGS: dict[str, SettingSpec] = {
    "name": SettingSpec(
        _parse_name, 'a daemon name, e.g. "llama"', "NAME",
        "Daemon name: arena /lmcached.<name>.<gen> and the default socket's name.",
        DEFAULT_NAME),
    "socket": SettingSpec(
        str, 'a socket path, e.g. "/run/lmcached/lmcached.sock"', "PATH",
        "Unix socket path. Its directory must be the daemon user's alone (not a symlink, "
        "not writable by others); a missing one is created 0700.",
        None, "$RUNTIME_DIRECTORY/lmcached.sock, $XDG_RUNTIME_DIR/lmcached/<name>.sock or "
        "/tmp/lmcached-<uid>/<name>.sock"),
    "capacity": SettingSpec(
        _parse_capacity, 'a size such as "8GiB", "4GB", "25%" or whole bytes', "SIZE",
        "Arena size: 512MiB, 8GiB, 4GB, 25% (of RAM) or bytes; never more than /dev/shm "
        "has free.",
        None, "the smaller of 4GiB and 25% of RAM"),
    "block_size": SettingSpec(
        _parse_block_size, 'a size such as "2MiB" or whole bytes', "SIZE",
        "Block size in bytes or units, a multiple of 64, at least capacity / "
        f"{MAX_NUM_BLOCKS} (at most {MAX_NUM_BLOCKS} blocks).",
        None, "the chunk size of the first layout that attaches"),
    "shm_mode": SettingSpec(
        _parse_mode, 'octal permission bits as a string, e.g. "0660" (0o660 in TOML)', "MODE",
        "Octal permissions of the arena segment; bits for others are refused.",
        None, "0600; 0660 with --allow-group"),
    "log_level": SettingSpec(
        _parse_log_level, "DEBUG, INFO, WARNING or ERROR", "LEVEL",
        "DEBUG, INFO, WARNING or ERROR; SIGHUP re-reads it.",
        "INFO"),
    "allow_group": SettingSpec(
        str, 'a group name, e.g. "lmcached"', "GROUP",
        "Also accept clients of this group: socket and arena 0660, group GROUP; only the "
        "daemon's user and root may stop, clear or evict."),
    "max_clients": SettingSpec(
        int, "a whole number of clients, at least 1", "N",
        "Most clients connected at once; more get a max_clients error. The daemon raises "
        "its fd limit to fit, or lowers N to what the hard limit allows (LimitNOFILE).",
        DEFAULT_MAX_CLIENTS),
    "idle_timeout": SettingSpec(
        float, "seconds, e.g. 300 or 0.5; 0 = off", "SECONDS",
        "Disconnect a client that sent no request for this long, like Redis `timeout`.",
        0.0, "0 = never"),
    "max_session_share": SettingSpec(
        float, "a percentage of the arena's blocks, more than 0 and at most 100, e.g. 50",
        "PERCENT",
        "Most of the arena one client session may hold at once, in blocks being written "
        "and blocks pinned for reading (percent); beyond it that session's stores get "
        "NOSPACE and its reads a shorter prefix, never the other sessions'. Also the "
        "largest value a PUT may store.",
        DEFAULT_MAX_SESSION_SHARE),
    "writing_timeout": SettingSpec(
        float, "seconds, e.g. 60; 0 = never", "SECONDS",
        "Abort a store's blocks that were allocated this long ago and not yet committed "
        "(counted: INFO writing_expired); its late COMMIT is refused (`expired`).",
        DEFAULT_WRITING_TIMEOUT_S, "60; 0 = never"),
    "buffer_budget": SettingSpec(
        _parse_buffer_budget, 'a size such as "128MiB" or whole bytes', "SIZE",
        "Input and output buffers of all clients together; beyond it the clients holding "
        "the most are dropped.",
        "128MiB"),
    "metrics_port": SettingSpec(
        int, "a TCP port number, 1-65535", "PORT",
        "Serve Prometheus metrics on http://HOST:PORT/metrics (docs/metrics.md). A port "
        "in use stops the start-up.",
        None, "off"),
    "metrics_host": SettingSpec(
        str, 'an address to listen on, e.g. "127.0.0.1" or "::"', "HOST",
        "Address of the metrics endpoint; 0.0.0.0 exposes the cache's statistics to the "
        "network.",
        DEFAULT_METRICS_HOST),
    "l2": SettingSpec(
        _parse_l2_url, 'a Redis URL, e.g. "redis://10.0.0.5:6379"', "URL",
        "L2 tier on Redis or Valkey (docs/l2.md): redis://HOST:PORT[,HOST:PORT...]; a "
        "cluster when the servers say so. Needs `pip install 'lmcached[l2]'`.",
        None, "off"),
    "l2_policy": SettingSpec(
        str, '"write-through" or "on-evict"', "POLICY",
        "Which chunks go to L2: write-through (every stored chunk, asynchronously) or "
        "on-evict (chunks evicted from the arena by pressure).",
        "write-through"),
    "l2_ttl": SettingSpec(
        float, "seconds, e.g. 86400; 0 = none", "SECONDS",
        "Time to live of the chunks written to L2.",
        0.0, "0 = none"),
    "l2_queue": SettingSpec(
        _parse_l2_queue, 'a size such as "256MiB"', "SIZE",
        "Bytes of chunks that may wait to be written to L2; beyond, writes are dropped "
        "and counted (a slow L2 never slows a store).",
        "256MiB"),
    "l2_fetch_wait": SettingSpec(
        float, "seconds, e.g. 0.5; 0 = do not wait", "SECONDS",
        "How long a lookup that misses in the arena waits for L2 to fetch the rest of its "
        "prefix; a fetch still running after that is installed for the next lookup. Keep "
        "it below the clients' LMCACHED_DATA_TIMEOUT_MS (200 ms by default).",
        0.1),
    "l2_threads": SettingSpec(
        int, "a whole number of threads, 1-64", "N",
        "Threads that write chunks to L2, and as many that fetch them.",
        2),
    "gpu_capacity": SettingSpec(
        _parse_gpu_capacity, 'a size such as "8GiB"', "SIZE",
        "GPU tier: this much device memory per --gpu-device, owned by the daemon and "
        "shared with clients by CUDA VMM file descriptors; chunks stored from a GPU go "
        "there first and are demoted to the arena when it fills (docs/architecture.md, "
        "\"Tiers\"). Needs `pip install 'lmcached[gpu]'`.",
        None, "off"),
    "gpu_device": SettingSpec(
        _parse_gpu_devices, 'device numbers, e.g. "0" or "0,1"', "N[,N...]",
        "The CUDA devices that get a GPU tier (with --gpu-capacity), as numbered inside "
        "the daemon's CUDA_VISIBLE_DEVICES.",
        None, "0"),
    "gpu_backend": SettingSpec(
        str, '"cuda" or "fake"', "BACKEND",
        "cuda, or fake: memfd tiers that stand in for GPUs (tests and CI without one).",
        "cuda", hidden=True),
}
assert list(SETTINGS) == list(Settings.__struct_fields__), "SETTINGS must mirror Settings"
_FILE_KEYS = frozenset(SETTINGS)
CONFIG_ENVVAR = "LMCACHED_CONFIG"
_CLI_OPTIONS_META = "lmcached.config.cli_options"  # ctx.meta key: raw command-line values
_TYPED_META = "lmcached.config.typed"  # ctx.meta key: each setting as its source typed it


def option_name(key: str) -> str:
    """The option of setting `key`: `max_clients` -> `--max-clients`."""
    return "--" + key.replace("_", "-")


def envvar_name(key: str) -> str:
    """The environment variable of setting `key`: `max_clients` -> `LMCACHED_MAX_CLIENTS`."""
    return "LMCACHED_" + key.upper()


class ConfigError(click.ClickException, ValueError):
    """A setting's value is refused; the message starts with its source.

    A `click.ClickException` (the CLI prints `Error: <message>` and exits with status 1)
    and a `ValueError` (what `load_config`'s callers catch).
    """


def _source_label(ctx: click.Context, key: str) -> str:
    """Where setting `key`'s value came from: `--max-clients`, `LMCACHED_MAX_CLIENTS`,
    `max_clients in /etc/lmcached/x.toml` or `default`."""
    source = ctx.get_parameter_source(key)
    if source is ParameterSource.COMMANDLINE:
        return option_name(key)
    if source is ParameterSource.ENVIRONMENT:
        return envvar_name(key)
    if source is ParameterSource.DEFAULT_MAP:
        return f"{key} in {ctx.params.get('config_file')}"
    return "default"


class SettingType(click.ParamType):
    """click type of one setting: typed by `Settings`, then parsed (`SettingSpec.parse`).

    Strings from the command line and the environment are converted (`"1024"` -> 1024);
    values from the TOML file must already have the schema's type (strict), so
    `socket = 7` is refused. Raw command-line values are kept in `ctx.meta` for
    `ServerConfig.cli_options`.
    """

    name = "setting"

    def __init__(self, key: str) -> None:
        self.key = key

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        """The effective value of setting `self.key`.

        Raises:
            ConfigError: wrong type, out of bounds or unparseable; the message names the
                source.
        """
        assert ctx is not None, "a setting is converted while click parses a command"
        source = ctx.get_parameter_source(self.key)
        label = _source_label(ctx, self.key)
        if source is ParameterSource.COMMANDLINE:
            ctx.meta.setdefault(_CLI_OPTIONS_META, {})[self.key] = value
        strict = source not in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
        spec = SETTINGS[self.key]
        try:
            typed = getattr(msgspec.convert({self.key: value}, Settings, strict=strict),
                            self.key)
        except msgspec.ValidationError as exc:
            detail = str(exc).split(" - at `", 1)[0].replace(" | null", "")
            raise ConfigError(
                f"{label}: invalid value {value!r}: {detail}; expected {spec.expected}"
            ) from None
        ctx.meta.setdefault(_TYPED_META, {})[self.key] = typed
        try:
            return spec.parse(typed)
        except ValueError as exc:
            raise ConfigError(f"{label}: {exc}") from None


def _read_config_file(ctx: click.Context, param: click.Parameter, path: str | None):
    """Eager callback of --config: the TOML file's table becomes `ctx.default_map`.

    Returns:
        `path` (None: no file).

    Raises:
        ConfigError: the file cannot be read, is not TOML, or has a key that is not a
            setting.
    """
    if path is None:
        return None
    source = "--config" if ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE \
        else CONFIG_ENVVAR
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    unknown = set(table) - _FILE_KEYS
    if unknown:
        raise ConfigError(
            f"unknown keys in {path}: {sorted(unknown)}; known: {sorted(_FILE_KEYS)}"
        )
    ctx.default_map = {**(ctx.default_map or {}), **table}
    return path


def serve_params() -> list[click.Parameter]:
    """The options of `lmcached serve`: --config, then one per setting.

    Each setting option reads its `LMCACHED_*` variable (shown in --help) and, through
    `ctx.default_map`, its key of the TOML file; click applies the precedence.
    """
    params: list[click.Parameter] = [click.Option(
        ["--config", "config_file"], type=click.Path(dir_okay=False), metavar="FILE",
        envvar=CONFIG_ENVVAR, show_envvar=True, is_eager=True, callback=_read_config_file,
        help="TOML file whose keys are the settings below (max_clients = 512), read from "
        "--config, else from $LMCACHED_CONFIG; no file when neither is given. Options "
        "and LMCACHED_* variables override its values.",
    )]
    for key, spec in SETTINGS.items():
        params.append(click.Option(
            [option_name(key), key], type=SettingType(key), metavar=spec.metavar,
            default=spec.default, show_default=spec.default_text or spec.default is not None,
            envvar=envvar_name(key), show_envvar=True, help=spec.help, hidden=spec.hidden,
        ))
    return params


@dataclasses.dataclass
class ServerConfig:
    """Effective configuration of one daemon (what `lmcached config` prints).

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
        gpu_capacity_bytes: bytes of each GPU tier; 0 = no GPU tier.
        gpu_devices: the CUDA devices with a GPU tier, in tier order (tier 1, 2, ...).
        gpu_backend: "cuda", or "fake" (memfd tiers, devices "fake-<i>": tests).
        size_texts: each size setting as its source typed it (`"10TB"`), so that
            messages echo it in the user's units (`echo_size`).
        cli_options: the command-line options it was resolved from, as given (SIGHUP
            re-resolves with them, so a command-line --log-level keeps precedence).
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
    gpu_capacity_bytes: int = 0
    gpu_devices: tuple[int, ...] = ()
    gpu_backend: str = "cuda"
    size_texts: dict = dataclasses.field(default_factory=dict, repr=False)
    cli_options: dict = dataclasses.field(default_factory=dict, repr=False)

    def as_dict(self) -> dict[str, int | str]:
        """Flat view for `CONFIG GET`; absent values as '', booleans as 0/1."""
        out = {}
        for field in dataclasses.fields(self):
            if field.name in ("cli_options", "size_texts"):
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


def config_from_context(ctx: click.Context, check_shm_free: bool = True) -> ServerConfig:
    """The `ServerConfig` of a parsed `lmcached serve` context (options of `serve_params`).

    Fills in the defaults that depend on other settings: the socket (from the name),
    the capacity (from RAM), the arena's mode (0660 with allow_group). Sizes in its
    messages are echoed as the user typed them (`echo_size`).

    Args:
        ctx: the context click parsed the options into.
        check_shm_free: refuse a capacity larger than /dev/shm's free space. False when
            a running daemon re-reads its file (its own arena already uses that space).

    Raises:
        ConfigError: a block size that does not fit in the arena or cuts it into more
            than MAX_NUM_BLOCKS blocks, or a capacity larger than /dev/shm's free space.
    """
    params = ctx.params
    shm_mode = params["shm_mode"]
    if shm_mode is None:
        shm_mode = DEFAULT_GROUP_SHM_MODE if params["allow_group"] else DEFAULT_SHM_MODE
    cfg = ServerConfig(
        name=params["name"],
        socket=os.path.abspath(params["socket"] or default_socket_path(params["name"])),
        capacity_bytes=params["capacity"] or default_capacity_bytes(),
        block_bytes=params["block_size"] or 0,
        shm_mode=shm_mode,
        log_level=params["log_level"],
        allow_group=params["allow_group"],
        config_file=params["config_file"],
        max_clients=params["max_clients"],
        idle_timeout_s=params["idle_timeout"],
        max_session_share=params["max_session_share"],
        writing_timeout_s=params["writing_timeout"],
        buffer_budget_bytes=params["buffer_budget"],
        metrics_port=params["metrics_port"],
        metrics_host=params["metrics_host"],
        l2_url=params["l2"],
        l2_policy=params["l2_policy"],
        l2_ttl_s=params["l2_ttl"],
        l2_queue_bytes=params["l2_queue"],
        l2_fetch_wait_s=params["l2_fetch_wait"],
        l2_threads=params["l2_threads"],
        gpu_capacity_bytes=params["gpu_capacity"] or 0,
        gpu_devices=params["gpu_device"] or ((0,) if params["gpu_capacity"] else ()),
        gpu_backend=params["gpu_backend"],
        cli_options=dict(ctx.meta.get(_CLI_OPTIONS_META, {})),
    )
    typed = ctx.meta.get(_TYPED_META, {})
    cfg.size_texts = {key: typed[key] for key in ("capacity", "block_size", "buffer_budget",
                                                   "l2_queue", "gpu_capacity")
                      if key in typed}
    if params["gpu_device"] and not params["gpu_capacity"]:
        raise ConfigError(
            f"GPU devices {typed.get('gpu_device', params['gpu_device'])} "
            f"({_source_label(ctx, 'gpu_device')}) without a GPU tier size: add "
            "--gpu-capacity SIZE"
        )
    capacity = echo_size(typed.get("capacity"), cfg.capacity_bytes)
    style = size_style(typed.get("capacity"))
    if cfg.block_bytes:
        from lmcached.shm.arena import HEADER_BYTES

        if cfg.block_bytes > cfg.capacity_bytes - HEADER_BYTES:
            raise ConfigError(
                f"block size {echo_size(typed.get('block_size'), cfg.block_bytes)} "
                f"({_source_label(ctx, 'block_size')}) does not fit in capacity {capacity} "
                f"({_source_label(ctx, 'capacity')}) with the arena's {HEADER_BYTES}-byte "
                "header; use a smaller block size or a larger capacity"
            )
        floor_bytes = min_block_bytes(cfg.capacity_bytes)
        if cfg.block_bytes < floor_bytes:
            raise ConfigError(
                f"block size {echo_size(typed.get('block_size'), cfg.block_bytes)} "
                f"({_source_label(ctx, 'block_size')}) cuts capacity {capacity} "
                f"({_source_label(ctx, 'capacity')}) into more than {MAX_NUM_BLOCKS} blocks; "
                f"use a block size of at least {floor_bytes} bytes, or a smaller capacity"
            )
    if check_shm_free:
        free = shm_free_bytes()
        if cfg.capacity_bytes > free:
            raise ConfigError(
                f"capacity {capacity} ({_source_label(ctx, 'capacity')}) is more than "
                f"/dev/shm has free ({format_size(free, style)}); ask for less, or enlarge "
                "/dev/shm"
            )
    return cfg


def load_config(
    options: dict[str, str | int | None],
    config_file: str | None = None,
    check_shm_free: bool = True,
) -> ServerConfig:
    """Resolve the daemon's configuration as `lmcached serve OPTIONS` would.

    Runs the options of `serve_params` through click on the command line that `options`
    stand for, so the precedence, the LMCACHED_* variables and the file are click's.

    Args:
        options: values given on the command line, keyed like the TOML file (the fields
            of `Settings`: `name`, `socket`, `capacity`, `max_clients`, ...); None = not
            given. Each value is passed as its text (`--capacity=67108864`).
        config_file: TOML file, or None to use $LMCACHED_CONFIG if set.
        check_shm_free: see `config_from_context`.

    Raises:
        ValueError: a key of `options` that is not a setting; a `ConfigError` (also a
            ValueError) for a value of the wrong type or a bad value (the message names
            the key or option and its source), a capacity larger than /dev/shm's free
            space, a config file that cannot be read, is not TOML or has unknown keys.
    """
    unknown = set(options) - _FILE_KEYS
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; use {sorted(_FILE_KEYS)}")
    argv = []
    for key, value in options.items():
        if value is not None:
            argv.append(f"{option_name(key)}={value}")
    if config_file:
        argv += ["--config", config_file]
    command = click.Command("serve", params=serve_params())
    with command.make_context("lmcached serve", argv) as ctx:
        return config_from_context(ctx, check_shm_free)
