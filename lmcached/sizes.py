"""Byte sizes as people type them: `8GiB`, `4GB`, `25%` of RAM, whole bytes.

Why this file exists: sizes reach the daemon from flags, LMCACHED_* variables and the
TOML file (`lmcached.config`); reading them is one concern, separate from which setting
wins over which, so it lives here rather than in the settings table. Writing sizes back
for people (INFO's `*_human` fields, messages that echo a size as typed) is
`lmcached.wire.units`, which the daemon uses too; the floor of an arena's sizes is the
arena's (`lmcached.shm.geometry`).

A size is bytes (`1048576`), binary units (`512MiB`, `8GiB`), decimal units (`4GB`,
`10TB`) or a percentage of physical RAM (`25%`).
"""

import psutil

from lmcached.wire.units import SIZE_RE

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


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
            match = SIZE_RE.match(stripped)
            unit = match.group(2).lower() if match else None
            if match is None or unit not in _UNITS:
                raise ValueError(
                    f"cannot parse size {text!r}: use bytes, 512MiB, 8GiB, 4GB or 25%"
                )
            value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value
