"""An arena segment's name and header: what the arena (shm/arena.py) and the anonymous
arenas (shm/memfd.py) both write and read.

Why this file exists: a named segment and a memfd carry the same header and the same
name syntax (`lmcached.<name>.<generation>`); both modules take them from here, so
neither imports the other's internals.
"""

import re
import struct

SEGMENT_PREFIX = "lmcached."
HEADER_BYTES = 4096
ARENA_MAGIC = b"LMCACHD1"
# magic, generation, owner pid, owner create time (s), capacity_bytes, block_bytes
SEGMENT_HEADER = struct.Struct("<8sQQdQQ")
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# /proc/self/fd/N of a memfd made by create_memfd: "/memfd:lmcached.<name>.<gen> (deleted)"
MEMFD_LINK_RE = re.compile(r"^/memfd:lmcached\.([A-Za-z0-9_-]{1,64})\.([0-9]+)(?: |$)")


def start_time_s(pid: int) -> float:
    """When process `pid` started, in seconds since the epoch (the segment header's owner
    create time). psutil is imported here, by the creator only: clients import this module
    and never create an arena."""
    import psutil

    return psutil.Process(pid).create_time()


def segment_name(name: str, generation: int) -> str:
    """POSIX name of an arena segment: `/lmcached.<name>.<generation>`.

    Raises:
        ValueError: `name` is not 1-64 characters of [A-Za-z0-9_-].
    """
    if not NAME_RE.match(name):
        raise ValueError(
            f"arena name {name!r} must be 1-64 characters of letters, digits, '_' or '-'"
        )
    return f"/{SEGMENT_PREFIX}{name}.{generation}"
