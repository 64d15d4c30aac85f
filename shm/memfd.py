"""Anonymous arenas: created with memfd_create by the daemon, mapped from a descriptor by
its clients (the memory of a "fake" device tier in tests and CI, exported like a CUDA
allocation: shm/device_memory.py). `Arena.create_memfd` and `Arena.from_fd` call these
and build the `Arena` around the mapping they return.
"""

import mmap
import os

from lmcached.shm import pages
from lmcached.shm.segment import (
    ARENA_MAGIC,
    HEADER_BYTES,
    MEMFD_LINK_RE,
    SEGMENT_HEADER,
    segment_name,
    start_time_s,
)


def create_memfd(name: str, generation: int, capacity_bytes: int,
                 block_bytes: int = 0) -> tuple[int, mmap.mmap]:
    """Create the memory of an anonymous arena (memfd_create), sized and mapped, with the
    segment header of `Arena.create` written: the memory of a "fake" device tier in tests
    and CI, which stands in for a CUDA allocation exported the same way
    (shm/device_memory.py). Other processes map it only through its file descriptor
    (`Arena.export_fd`, sent over the daemon's socket).

    It has no name in /dev/shm: the kernel frees it when the owner's descriptor and
    every mapping are gone, so nothing is left behind by a crash.

    Args:
        name: daemon name (1-64 of [A-Za-z0-9_-]); names the memfd for /proc.
        generation: the daemon's generation (written in the header).
        capacity_bytes, block_bytes: as `Arena.create`.

    Returns:
        (fd, mapping): the memfd, which the caller owns and closes, and its mapping of
        `capacity_bytes` bytes.

    Raises:
        ValueError: bad name or capacity.
        OSError: the memory cannot be created, sized or mapped.
    """
    if capacity_bytes <= HEADER_BYTES:
        raise ValueError(
            f"capacity_bytes must exceed the {HEADER_BYTES}-byte header, got {capacity_bytes}"
        )
    fd = os.memfd_create(segment_name(name, generation)[1:], os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity_bytes)
        mapping = mmap.mmap(fd, capacity_bytes)
        pid = os.getpid()
        SEGMENT_HEADER.pack_into(mapping, 0, ARENA_MAGIC, generation, pid,
                                 start_time_s(pid), capacity_bytes,
                                 block_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping


def map_fd(fd: int, generation: int, size_bytes: int,
           populate: bool = True) -> tuple[str, mmap.mmap]:
    """Map an arena received as a file descriptor (an anonymous arena's `export_fd`),
    read-write, its header read-only. The caller keeps and closes `fd` (the mapping
    stays valid after it does).

    As `Arena.attach`, nothing comes from the memory's bytes, which every client mapping
    it can write: the size comes from the daemon, the generation from the memfd's name
    (set by the daemon's `memfd_create`; no client can change it).

    Args:
        fd: the descriptor (OPEN_TIER's SCM_RIGHTS data).
        generation: the generation the daemon announced; a memfd of lmcached named
            for another generation is refused.
        size_bytes: bytes of the memory the daemon announced (OPEN_TIER's
            `size_bytes`); this many bytes are mapped.
        populate: map every page now, as `Arena.attach`.

    Returns:
        (name, mapping): the daemon name in the memfd's name ("anonymous" for memory
        passed another way) and the mapping of `size_bytes` bytes.

    Raises:
        ValueError: the memory is an arena of another generation, or smaller than
            `size_bytes`.
        OSError: `fd` cannot be mapped.
    """
    size = os.fstat(fd).st_size
    if size < size_bytes or size_bytes <= HEADER_BYTES:
        raise ValueError(f"descriptor {fd} holds {size} bytes, but the daemon announced "
                         f"an arena of {size_bytes} bytes")
    # The daemon's name, for messages; memory passed another way is "anonymous".
    match = MEMFD_LINK_RE.match(os.readlink(f"/proc/self/fd/{fd}"))
    if match and match.group(2) != str(generation):
        raise ValueError(f"descriptor {fd} is an arena of generation {match.group(2)}, "
                         f"not of generation {generation}")
    mapping = mmap.mmap(fd, size_bytes)
    try:
        if populate:
            pages.populate(mapping, 0, size_bytes)
        pages.protect_pages(mapping, HEADER_BYTES)
    except BaseException:
        mapping.close()
        raise
    return (match.group(1) if match else "anonymous"), mapping
