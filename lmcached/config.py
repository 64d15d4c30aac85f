"""Daemon configuration: one declaration per setting, from which every source is built.

Each setting is declared once, in `SETTINGS` (lmcached/settings.py): its type and
bounds (the schema of the TOML file, `Settings`), its parser, its help, its click
default and the `ServerConfig` field it sets. From that one entry come the option of `lmcached serve`
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

This module builds the options (`serve_params`, used by `lmcached.cli`) and turns a
parsed click context into a `ServerConfig` (`config_from_context`); `load_config` runs
the same options on a dict, for the daemon's SIGHUP re-read (`reread_config`) and for
tests.
"""

import os
import tomllib
from typing import Any

import click
import msgspec
import psutil
from click.core import ParameterSource

from lmcached.daemon.server_config import DEFAULT_SHM_MODE, ServerConfig
from lmcached.settings import SETTINGS, Settings, Size
from lmcached.shm.geometry import MAX_NUM_BLOCKS, min_block_bytes
from lmcached.shm.pages import shm_free_bytes
from lmcached.wire.socket_path import default_socket_path
from lmcached.wire.units import echo_size, format_size, size_style

DEFAULT_CAPACITY_BYTES = 4 << 30  # and at most 25% of RAM
DEFAULT_RAM_FRACTION = 0.25
DEFAULT_GROUP_SHM_MODE = 0o660  # with --allow-group: members map the arena read-write
# The smallest CUDA VMM allocation granularity of any device (cuMemGetAllocationGranularity):
# a CUDA GPU tier below it would be empty. The device's own is checked at start.
CUDA_VMM_MIN_GRANULARITY_BYTES = 2 << 20


def default_capacity_bytes() -> int:
    """The smaller of 4 GiB and 25% of physical RAM."""
    return min(DEFAULT_CAPACITY_BYTES, int(psutil.virtual_memory().total * DEFAULT_RAM_FRACTION))


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
                       sources={key: _source_label(ctx, key) for key in SETTINGS},
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
    if cfg.gpu_backend == "cuda" and 0 < cfg.gpu_capacity_bytes < CUDA_VMM_MIN_GRANULARITY_BYTES:
        raise ConfigError(
            f"GPU tier {echo_size(typed.get('gpu_capacity'), cfg.gpu_capacity_bytes)} "
            f"({_source_label(ctx, 'gpu_capacity')}) is less than 2MiB, the smallest CUDA "
            "VMM allocation granularity (the tier is a whole number of granules): use "
            "--gpu-capacity 2MiB or more"
        )
    capacity = echo_size(typed.get("capacity"), cfg.capacity_bytes)
    style = size_style(typed.get("capacity"))
    if cfg.block_bytes:
        from lmcached.shm.arena import HEADER_BYTES  # numpy: only when a block size is set

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
