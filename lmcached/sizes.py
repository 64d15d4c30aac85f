"""Byte sizes as people type and read them: parsing, echoing and human formatting.

Why this file exists: sizes reach the daemon from flags, LMCACHED_* variables and the
TOML file (`lmcached.config`), and leave it in messages, INFO's `*_human` fields and
progress lines. Reading and writing them is one concern, separate from which setting
wins over which, so it lives here rather than in the settings table.

A size is bytes (`1048576`), binary units (`512MiB`, `8GiB`), decimal units (`4GB`,
`10TB`) or a percentage of physical RAM (`25%`). A message about a size echoes it as
typed and states the other sizes in the same style (`capacity 10TB ... /dev/shm has
free 25.28GB`, `capacity 10GiB ... 23.54GiB`): `size_style` tells the style,
`format_size` writes it, `echo_size` names the typed value. `format_bytes` is the
Redis-style form of INFO's `*_human` fields (`1.50G`).

The floor of an arena's sizes lives here too, because the settings (`--capacity`,
`--block-size`) and the daemon (the block size a first layout sets) both apply it: an
arena holds at least one `MIN_BLOCK_BYTES` block after its header, and is never cut into
more than `MAX_NUM_BLOCKS` blocks (`min_block_bytes`), so that whatever a client or an
operator chooses, the daemon's per-block metadata and every request that walks the
cached values stay bounded (docs/architecture.md, "Block size").
"""

import re

import psutil

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_DECIMAL_UNITS = frozenset({"k", "kb", "m", "mb", "g", "gb", "t", "tb"})
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

MIN_BLOCK_BYTES = 4096  # one page: the smallest block a size derived from a layout takes
MAX_NUM_BLOCKS = 1 << 18  # most blocks in one arena: 4x MAX_CHUNKS_PER_REQUEST


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


def size_style(text: str | int | None) -> str:
    """The unit style of a size as the user typed it: "decimal" for `4GB`, `10TB` (powers
    of 1000), "binary" for anything else (`8GiB`, bytes, a percentage, no value)."""
    if isinstance(text, str):
        match = _SIZE_RE.match(text)
        if match and match.group(2).lower() in _DECIMAL_UNITS:
            return "decimal"
    return "binary"


def format_size(num_bytes: int | float, style: str = "binary") -> str:
    """A byte count in the unit style of `size_style`, in a form `parse_size` reads back.

    Examples: 23.54GiB, 512MiB, 1000B (binary); 25.28GB, 10TB (decimal).

    Raises:
        ValueError: `style` is neither "binary" nor "decimal".
    """
    if style not in ("binary", "decimal"):
        raise ValueError(f"size style {style!r}: use 'binary' or 'decimal'")
    base, names = (1000, "KB MB GB TB") if style == "decimal" else (1024, "KiB MiB GiB TiB")
    scale, unit = 1, "B"
    for power, name in enumerate(names.split(), 1):
        if abs(num_bytes) >= base**power:
            scale, unit = base**power, name
    return f"{num_bytes / scale:.2f}".rstrip("0").rstrip(".") + unit


def echo_size(text: str | int | None, num_bytes: int) -> str:
    """How a message names a size the user gave as `text` (None: a default of
    `num_bytes`): as typed when it has a unit, a percentage with its bytes, bytes as such."""
    if isinstance(text, str) and text.strip().endswith("%"):
        return f"{text.strip()} of RAM ({format_size(num_bytes)})"
    if isinstance(text, str) and not text.strip().isdigit():
        return text.strip()
    return format_size(num_bytes) if text is None else f"{num_bytes} bytes"


def min_block_bytes(capacity_bytes: int) -> int:
    """The smallest block size (a multiple of 64 bytes) that cuts an arena of
    `capacity_bytes` into at most MAX_NUM_BLOCKS blocks: 64 bytes up to a 16 MiB arena,
    4 KiB for 1 GiB, 256 KiB for 64 GiB."""
    return max(64, -(-capacity_bytes // (MAX_NUM_BLOCKS * 64)) * 64)
