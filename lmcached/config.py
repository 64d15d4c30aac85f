"""Daemon configuration: defaults, units, socket path resolution, TOML file.

Precedence: command-line option > LMCACHED_* environment variable > config file >
default. Sizes accept bytes (`1048576`), binary units (`512MiB`, `8GiB`), decimal units
(`4GB`) and a percentage of physical RAM (`25%`).
"""

import dataclasses
import os
import re
import shutil
import tomllib

import psutil

from lmcached import envs

DEFAULT_NAME = "default"
DEFAULT_CAPACITY_BYTES = 4 << 30  # and at most 25% of RAM
DEFAULT_RAM_FRACTION = 0.25
DEFAULT_SHM_MODE = 0o600
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


def default_socket_path(name: str) -> str:
    """Where the daemon `name` listens when no socket is given.

    `$LMCACHED_SOCKET`, else `$RUNTIME_DIRECTORY/<name>.sock` under systemd (the
    default instance is `lmcached.sock`), else `$XDG_RUNTIME_DIR/lmcached/<name>.sock`,
    else `/tmp/lmcached-<uid>/<name>.sock`.
    """
    explicit = envs.get("LMCACHED_SOCKET")
    if explicit:
        return explicit
    runtime_dir = envs.get("RUNTIME_DIRECTORY")
    if runtime_dir:
        # systemd may list several directories separated by ':'; ours is the first.
        base = runtime_dir.split(":")[0]
        return os.path.join(base, "lmcached.sock" if name == DEFAULT_NAME else f"{name}.sock")
    xdg = envs.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "lmcached", f"{name}.sock")
    return os.path.join(f"/tmp/lmcached-{os.getuid()}", f"{name}.sock")


def default_capacity_bytes() -> int:
    """The smaller of 4 GiB and 25% of physical RAM."""
    return min(DEFAULT_CAPACITY_BYTES, int(psutil.virtual_memory().total * DEFAULT_RAM_FRACTION))


def shm_free_bytes() -> int:
    """Free bytes in /dev/shm (where POSIX shared memory lives on Linux)."""
    return shutil.disk_usage("/dev/shm").free


@dataclasses.dataclass
class ServerConfig:
    """Effective configuration of one daemon (what `lmcached config` prints).

    Attributes:
        name: daemon name (arena segment and default socket name).
        socket: path of the Unix socket.
        capacity_bytes: arena size in bytes.
        block_bytes: block size in bytes; 0 = set by the first layout that attaches.
        shm_mode: permission bits of the arena segment.
        log_level: logging level name.
        allow_group: group name whose members may connect, or None.
        config_file: the TOML file read, or None.
        prefault: populate the arena at start (always on outside tests).
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
    max_clients: int = 1024
    idle_timeout_s: float = 0.0
    buffer_budget_bytes: int = 128 << 20
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


_FILE_KEYS = {"name", "socket", "capacity", "block_size", "shm_mode", "log_level", "allow_group"}


def load_config(
    options: dict[str, str | int | None],
    config_file: str | None = None,
    check_shm_free: bool = True,
) -> ServerConfig:
    """Resolve the daemon's configuration (see module docstring for precedence).

    Args:
        options: values given on the command line, keyed like the TOML file (`name`,
            `socket`, `capacity`, `block_size`, `shm_mode`, `log_level`,
            `allow_group`); None = not given.
        config_file: TOML file, or None to use $LMCACHED_CONFIG if set.
        check_shm_free: refuse a capacity larger than /dev/shm's free space. False when
            a running daemon re-reads its file (its own arena already uses that space).

    Raises:
        ValueError: a bad value (the message names the option and the source), a
            capacity larger than /dev/shm's free space, or an unknown key in the file.
        FileNotFoundError: the config file does not exist.
    """
    config_file = config_file or envs.get("LMCACHED_CONFIG")
    from_file: dict = {}
    if config_file:
        with open(config_file, "rb") as f:
            from_file = tomllib.load(f)
        unknown = set(from_file) - _FILE_KEYS
        if unknown:
            raise ValueError(
                f"unknown keys in {config_file}: {sorted(unknown)}; known: {sorted(_FILE_KEYS)}"
            )

    def pick(key: str, env_name: str):
        if options.get(key) is not None:
            return options[key], f"--{key.replace('_', '-')}"
        env_value = envs.get(env_name)
        if env_value is not None:
            return env_value, env_name
        if key in from_file:
            return from_file[key], f"{key} in {config_file}"
        return None, "default"

    cfg = ServerConfig(config_file=config_file, cli_options=dict(options))
    name, _ = pick("name", "LMCACHED_NAME")
    cfg.name = str(name) if name else DEFAULT_NAME
    socket_path, _ = pick("socket", "LMCACHED_SOCKET")
    cfg.socket = str(socket_path) if socket_path else default_socket_path(cfg.name)

    capacity, source = pick("capacity", "LMCACHED_CAPACITY")
    try:
        cfg.capacity_bytes = (
            parse_size(capacity) if capacity is not None else default_capacity_bytes()
        )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if check_shm_free:
        free = shm_free_bytes()
        if cfg.capacity_bytes > free:
            raise ValueError(
                f"capacity {format_bytes(cfg.capacity_bytes)} ({source}) is more than "
                f"/dev/shm has free ({format_bytes(free)}); ask for less, or enlarge /dev/shm"
            )

    block_size, source = pick("block_size", "LMCACHED_BLOCK_SIZE")
    if block_size:
        try:
            cfg.block_bytes = parse_size(block_size)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        if cfg.block_bytes % 64:
            raise ValueError(f"{source}: block size {cfg.block_bytes} is not a multiple of 64")

    mode, source = pick("shm_mode", "LMCACHED_SHM_MODE")
    if mode is not None:
        try:
            cfg.shm_mode = int(mode, 8) if isinstance(mode, str) else int(mode)
        except ValueError:
            raise ValueError(f"{source}: shm mode {mode!r} is not octal (e.g. 0600)") from None
        if not 0 <= cfg.shm_mode <= 0o777:
            raise ValueError(f"{source}: shm mode {mode!r} is out of range")

    level, source = pick("log_level", "LMCACHED_LOG_LEVEL")
    cfg.log_level = str(level).upper() if level else "INFO"
    if cfg.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"{source}: unknown log level {level!r}")

    group, _ = pick("allow_group", "LMCACHED_ALLOW_GROUP")
    cfg.allow_group = str(group) if group else None
    return cfg
