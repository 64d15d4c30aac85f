"""Daemon configuration: one typed schema for flags, LMCACHED_* variables and the TOML file.

Precedence: command-line option > LMCACHED_* environment variable > config file >
default. Every setting has the same name and type in each source (`Settings`): the TOML
key `max_clients`, the option `--max-clients`, the variable `LMCACHED_MAX_CLIENTS`. A
value of the wrong type is an error naming the key and its source (`socket = 7` in the
file is refused, not turned into a socket named "7"). Sizes accept bytes (`1048576`),
binary units (`512MiB`, `8GiB`), decimal units (`4GB`) and a percentage of physical RAM
(`25%`).
"""

import dataclasses
import os
import re
import shutil
import tomllib
from typing import Annotated

import msgspec
import psutil

from lmcached import envs
from lmcached.protocol import MAX_FRAME_BYTES
from lmcached.socket_path import DEFAULT_NAME, default_socket_path  # noqa: F401 (re-export)

DEFAULT_CAPACITY_BYTES = 4 << 30  # and at most 25% of RAM
DEFAULT_RAM_FRACTION = 0.25
DEFAULT_SHM_MODE = 0o600
DEFAULT_GROUP_SHM_MODE = 0o660  # with --allow-group: members map the arena read-write
DEFAULT_MAX_CLIENTS = 1024
DEFAULT_BUFFER_BUDGET_BYTES = 128 << 20
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, total_bytes: int | None = None) -> int:
    """Parse a size: `1048576`, `512MiB`, `8GiB`, `4GB`, or `25%` of `total_bytes`.

    Args:
        text: the size.
        total_bytes: what a percentage refers to (default: physical RAM).

    Raises:
        ValueError: unparseable, zero, or a percentage outside (0, 100].
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif not isinstance(text, str):
        raise ValueError(f"size {text!r} must be a string such as '8GiB' or whole bytes")
    else:
        stripped = text.strip()
        if stripped.endswith("%"):
            try:
                pct = float(stripped[:-1])
            except ValueError:
                raise ValueError(f"cannot parse percentage {text!r}: use e.g. 25%") from None
            if not 0 < pct <= 100:
                raise ValueError(f"percentage {text!r} must be in (0, 100]")
            total = total_bytes if total_bytes is not None else psutil.virtual_memory().total
            value = int(total * pct / 100)
        else:
            match = _SIZE_RE.match(stripped)
            unit = match.group(2).lower() if match else None
            if match is None or unit not in _UNITS:
                raise ValueError(
                    f"cannot parse size {text!r}: use bytes, 512MiB, 8GiB, 4GB or 25%"
                )
            value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def format_bytes(num_bytes: int | float) -> str:
    """Human form of a byte count, Redis style: 1.50G, 512.00M, 3.00K, 12B."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f}{unit}"
    return f"{int(num_bytes)}B"


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
    (`"1024"` -> 1024). `load_config` then parses units and resolves defaults.
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
    buffer_budget: Size | None = None


# What each setting expects, for error messages.
_EXPECTED = {
    "name": 'a daemon name, e.g. "llama"',
    "socket": 'a socket path, e.g. "/run/lmcached/lmcached.sock"',
    "capacity": 'a size such as "8GiB", "4GB", "25%" or whole bytes',
    "block_size": 'a size such as "2MiB" or whole bytes',
    "shm_mode": 'octal permission bits as a string, e.g. "0660" (0o660 in TOML)',
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "allow_group": 'a group name, e.g. "lmcached"',
    "max_clients": "a whole number of clients, at least 1",
    "idle_timeout": "seconds, e.g. 300 or 0.5; 0 = off",
    "buffer_budget": 'a size such as "128MiB" or whole bytes',
}
_FILE_KEYS = frozenset(Settings.__struct_fields__)


def _typed(key: str, value, source: str, strict: bool):
    """`value` of setting `key` checked against `Settings` (strict: no str -> number).

    Raises:
        ValueError: wrong type or out of bounds; the message names the source.
    """
    try:
        return getattr(msgspec.convert({key: value}, Settings, strict=strict), key)
    except msgspec.ValidationError as exc:
        detail = str(exc).split(" - at `", 1)[0].replace(" | null", "")
        raise ValueError(
            f"{source}: invalid value {value!r}: {detail}; expected {_EXPECTED[key]}"
        ) from None


def _read_file(config_file: str) -> dict:
    """The TOML file's table, its keys checked against `Settings`."""
    with open(config_file, "rb") as f:
        try:
            from_file = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{config_file} is not valid TOML: {exc}") from None
    unknown = set(from_file) - _FILE_KEYS
    if unknown:
        raise ValueError(
            f"unknown keys in {config_file}: {sorted(unknown)}; known: {sorted(_FILE_KEYS)}"
        )
    return from_file


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
        buffer_budget_bytes: input and output buffers of all clients together, in bytes.
        cli_options: the command-line options it was resolved from (SIGHUP re-resolves
            with them, so a command-line --log-level keeps precedence).
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
    buffer_budget_bytes: int = DEFAULT_BUFFER_BUDGET_BYTES
    cli_options: dict = dataclasses.field(default_factory=dict, repr=False)

    def as_dict(self) -> dict[str, int | str]:
        """Flat view for `CONFIG GET`; absent values as '', booleans as 0/1."""
        out = {}
        for field in dataclasses.fields(self):
            if field.name == "cli_options":
                continue
            value = getattr(self, field.name)
            if field.name == "shm_mode":
                value = f"0{value:o}"
            elif isinstance(value, bool):
                value = int(value)  # the wire's INFO values are int | float | str
            out[field.name] = "" if value is None else value
        return out


def load_config(
    options: dict[str, str | int | None],
    config_file: str | None = None,
    check_shm_free: bool = True,
) -> ServerConfig:
    """Resolve the daemon's configuration (see module docstring for precedence).

    Args:
        options: values given on the command line, keyed like the TOML file (the fields
            of `Settings`: `name`, `socket`, `capacity`, `max_clients`, ...); None = not
            given.
        config_file: TOML file, or None to use $LMCACHED_CONFIG if set.
        check_shm_free: refuse a capacity larger than /dev/shm's free space. False when
            a running daemon re-reads its file (its own arena already uses that space).

    Raises:
        ValueError: a value of the wrong type or a bad value (the message names the key
            or option and its source), a capacity larger than /dev/shm's free space, an
            unknown key in the file, or a file that is not TOML.
        FileNotFoundError: the config file does not exist.
    """
    config_file = config_file or envs.get("LMCACHED_CONFIG")
    from_file = _read_file(config_file) if config_file else {}

    sources: dict[str, str] = {}

    def parsed(key: str, parse, default):
        """Setting `key` from the first source that gives it (option, LMCACHED_*, file),
        checked against `Settings`, then `parse`d; `default` when no source gives it."""
        env_name = "LMCACHED_" + key.upper()
        if options.get(key) is not None:
            source, value, strict = f"--{key.replace('_', '-')}", options[key], False
        elif envs.get(env_name) is not None:
            source, value, strict = env_name, envs.get(env_name), False
        elif key in from_file:
            source, value, strict = f"{key} in {config_file}", from_file[key], True
        else:
            sources[key] = "default"
            return default
        sources[key] = source
        value = _typed(key, value, source, strict)
        try:
            return parse(value)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    cfg = ServerConfig(config_file=config_file, cli_options=dict(options))
    cfg.name = parsed("name", _parse_name, DEFAULT_NAME)
    cfg.socket = os.path.abspath(parsed("socket", str, None) or default_socket_path(cfg.name))
    cfg.capacity_bytes = parsed("capacity", parse_size, None) or default_capacity_bytes()
    if check_shm_free:
        free = shm_free_bytes()
        if cfg.capacity_bytes > free:
            raise ValueError(
                f"capacity {format_bytes(cfg.capacity_bytes)} ({sources['capacity']}) is more "
                f"than /dev/shm has free ({format_bytes(free)}); ask for less, or enlarge /dev/shm"
            )
    cfg.block_bytes = parsed("block_size", _parse_block_size, 0)
    cfg.allow_group = parsed("allow_group", str, None)
    cfg.shm_mode = parsed(
        "shm_mode", _parse_mode, DEFAULT_GROUP_SHM_MODE if cfg.allow_group else DEFAULT_SHM_MODE
    )
    cfg.log_level = parsed("log_level", _parse_log_level, "INFO")
    cfg.max_clients = parsed("max_clients", int, DEFAULT_MAX_CLIENTS)
    cfg.idle_timeout_s = parsed("idle_timeout", float, 0.0)
    cfg.buffer_budget_bytes = parsed("buffer_budget", _parse_buffer_budget,
                                     DEFAULT_BUFFER_BUDGET_BYTES)
    return cfg


def _parse_name(value: str) -> str:
    from lmcached.shm.arena import segment_name  # the arena owns the name's syntax

    segment_name(value, 0)
    return value


def _parse_block_size(value: Size) -> int:
    block_bytes = parse_size(value)
    if block_bytes % 64:
        raise ValueError(f"block size {block_bytes} is not a multiple of 64")
    return block_bytes


def _parse_mode(value: str | int) -> int:
    try:
        mode = int(value, 8) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"shm mode {value!r} is not octal (e.g. 0600)") from None
    if not 0 <= mode <= 0o777:
        hint = ' (a TOML integer is decimal: write "0660" or 0o660)' * isinstance(value, int)
        raise ValueError(f"shm mode {value!r} is out of range{hint}")
    return mode


def _parse_log_level(value: str) -> str:
    level = value.upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"unknown log level {value!r}; use one of {', '.join(LOG_LEVELS)}")
    return level


def _parse_buffer_budget(value: Size) -> int:
    budget_bytes = parse_size(value)
    if budget_bytes < MAX_FRAME_BYTES:
        raise ValueError(
            f"buffer budget {format_bytes(budget_bytes)} is less than one largest frame "
            f"({format_bytes(MAX_FRAME_BYTES)})"
        )
    return budget_bytes
