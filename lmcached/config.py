"""Daemon configuration: one declaration per setting, from which every source is built.

Each setting is declared once, in `SETTINGS`: its type and bounds (the schema of the
TOML file, `Settings`), its parser, its help, its click default and the `ServerConfig`
field it sets. From that one entry come the option of `lmcached serve`
(`--max-clients`), its `LMCACHED_*` variable (`LMCACHED_MAX_CLIENTS`, `envvar=`), its
TOML key (`max_clients`) and the daemon's field (`ServerConfig.max_clients`,
lmcached/daemon/server_config.py).

click resolves where each setting comes from: the TOML file (`--config`, else
`$LMCACHED_CONFIG`) becomes the context's `default_map`, so the precedence is click's own:
command-line option > LMCACHED_* environment variable > config file > default. Whatever
its source, a value goes through `Settings` (msgspec) and then its parser; a value of the
wrong type is an error naming the key and its source (`socket = 7` in the file is
refused, not turned into a socket named "7"). Sizes (`8GiB`, `4GB`, `25%`, bytes) are
read by `lmcached.sizes`, and a message about a size echoes it in the units typed.

This module declares the options (`serve_params`, used by `lmcached.cli`) and turns a
parsed click context into a `ServerConfig` (`config_from_context`); `load_config` runs
the same options on a dict, for the daemon's SIGHUP re-read (`reread_config`) and for
tests.
"""

import dataclasses
import os
import tomllib
from collections.abc import Callable
from typing import Annotated, Any, Literal

import click
import msgspec
import psutil
from click.core import ParameterSource

from lmcached.daemon.server_config import (
    DEFAULT_MAX_CLIENTS,
    DEFAULT_MAX_SESSION_SHARE,
    DEFAULT_METRICS_HOST,
    DEFAULT_SHM_MODE,
    DEFAULT_WRITING_TIMEOUT_S,
    ServerConfig,
)
from lmcached.shm.arena import (
    HEADER_BYTES,
    MAX_NUM_BLOCKS,
    MIN_BLOCK_BYTES,
    min_block_bytes,
    segment_name,
)
from lmcached.shm.pages import shm_free_bytes
from lmcached.sizes import parse_size
from lmcached.wire.protocol import MAX_FRAME_BYTES
from lmcached.wire.socket_path import DEFAULT_NAME, default_socket_path
from lmcached.wire.units import echo_size, format_size, size_style

DEFAULT_CAPACITY_BYTES = 4 << 30  # and at most 25% of RAM
DEFAULT_RAM_FRACTION = 0.25
DEFAULT_GROUP_SHM_MODE = 0o660  # with --allow-group: members map the arena read-write
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def default_capacity_bytes() -> int:
    """The smaller of 4 GiB and 25% of physical RAM."""
    return min(DEFAULT_CAPACITY_BYTES, int(psutil.virtual_memory().total * DEFAULT_RAM_FRACTION))


Size = str | int  # "8GiB", "4GB", "25%" (of RAM) or whole bytes
_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


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
    segment_name(value, 0)  # the arena owns the name's syntax
    return value


def _parse_capacity(value: Size) -> int:
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
        "Octal permissions of the arena segment; bits for others are refused.",
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
    "idle_timeout": Setting(
        Annotated[float, msgspec.Meta(ge=0, le=1e9)],  # seconds
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
        Annotated[float, msgspec.Meta(ge=0, le=1e9)],  # seconds
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
        "cluster when the servers say so. Needs `pip install 'lmcached[l2]'`.",
        None, "off", field="l2_url"),
    "l2_policy": Setting(
        Literal["write-through", "on-evict"],
        str, '"write-through" or "on-evict"', "POLICY",
        "Which chunks go to L2: write-through (every stored chunk, asynchronously) or "
        "on-evict (chunks evicted from the arena by pressure).",
        "write-through"),
    "l2_ttl": Setting(
        Annotated[float, msgspec.Meta(ge=0, le=1e9)],  # seconds
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
    "gpu_capacity": Setting(
        Size,
        _parse_gpu_capacity, 'a size such as "8GiB"', "SIZE",
        "GPU tier: this much device memory per --gpu-device, owned by the daemon and "
        "shared with clients by CUDA VMM file descriptors; chunks stored from a GPU go "
        "there first and are demoted to the arena when it fills (docs/architecture.md, "
        "\"Tiers\"). Needs `pip install 'lmcached[gpu]'`.",
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
    values = {setting.field or key: params[key] for key, setting in SETTINGS.items()}
    cfg = ServerConfig(**values, config_file=params["config_file"],
                       cli_options=dict(ctx.meta.get(_CLI_OPTIONS_META, {})),
                       reread=reread_config)
    # The defaults that depend on other settings.
    cfg.socket = os.path.abspath(params["socket"] or default_socket_path(params["name"]))
    cfg.capacity_bytes = params["capacity"] or default_capacity_bytes()
    cfg.block_bytes = params["block_size"] or 0
    if params["shm_mode"] is None:
        cfg.shm_mode = DEFAULT_GROUP_SHM_MODE if params["allow_group"] else DEFAULT_SHM_MODE
    cfg.gpu_capacity_bytes = params["gpu_capacity"] or 0
    cfg.gpu_devices = params["gpu_device"] or ((0,) if params["gpu_capacity"] else ())
    typed = ctx.meta.get(_TYPED_META, {})
    cfg.size_texts = {key: typed[key] for key, setting in SETTINGS.items()
                      if setting.type is Size and key in typed}
    if params["gpu_device"] and not params["gpu_capacity"]:
        raise ConfigError(
            f"GPU devices {typed.get('gpu_device', params['gpu_device'])} "
            f"({_source_label(ctx, 'gpu_device')}) without a GPU tier size: add "
            "--gpu-capacity SIZE"
        )
    capacity = echo_size(typed.get("capacity"), cfg.capacity_bytes)
    style = size_style(typed.get("capacity"))
    if cfg.block_bytes:
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


def reread_config(current: ServerConfig) -> ServerConfig:
    """`current` resolved again from its sources, for the daemon's SIGHUP
    (`ServerConfig.reread`): the same command-line options and file, the environment as
    it is now, and the capacity of the arena it already has (whose space /dev/shm no
    longer has free, so that is not checked again).

    Raises:
        ValueError, OSError: as `load_config`.
    """
    return load_config({**current.cli_options, "capacity": current.capacity_bytes},
                       current.config_file, check_shm_free=False)
