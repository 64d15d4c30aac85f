"""Byte counts as people read them: INFO's `*_human` fields and the sizes in messages.

Why this file exists: the daemon (INFO, start-up messages, progress lines), shared memory
(device tiers' messages) and the operations layer (settings) all write byte counts for
people, and a message about a size the user typed echoes it in the units typed
(`capacity 10TB ... /dev/shm has free 25.28GB`, `capacity 10GiB ... 23.54GiB`):
`size_style` tells the style, `format_size` writes it, `echo_size` names the typed value.
`format_bytes` is the Redis-style form of INFO's `*_human` fields (`1.50G`). Reading a
size (`parse_size`, "25%" of RAM) is the operations layer's (`lmcached/sizes.py`).
"""

import re

# A size as typed: a number, then an optional unit (`512MiB`, `4GB`, `1048576`).
SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
DECIMAL_UNITS = frozenset({"k", "kb", "m", "mb", "g", "gb", "t", "tb"})


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
        match = SIZE_RE.match(text)
        if match and match.group(2).lower() in DECIMAL_UNITS:
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
