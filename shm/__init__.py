"""`lmcached.shm` (folder `shm/`): memory the daemon and its clients both map.

What lives here, one concept per module:
    arena.py          the POSIX shared-memory segment: create (reserve, prefault), attach,
                      unlink, and zero-copy views of its blocks (the daemon and the clients)
    memfd.py          anonymous arenas: created by memfd_create, mapped from a descriptor
    segment.py        an arena segment's name and header, which both of the above write
    geometry.py       an arena's size limits: smallest block, most blocks
    pages.py          a mapping's pages: reserve them one daemon at a time, populate them,
                      make the header read-only; the free space of /dev/shm
    janitor.py        the lock of a daemon name, which says who owns its segments, and the
                      unlinking of the segments of dead daemons (the daemon's start-up
                      sweep), as CPython's resource_tracker cleans up after shared_memory
    device_memory.py  device tiers' memory: "fake" memfd arenas and CUDA VMM allocations
                      exported by file descriptor
    cuda_driver.py    the CUDA driver calls of VMM export and import (cuda-bindings, lazily)

What it may import: `lmcached.wire`, the standard library, numpy, posix_ipc, and lazily
psutil (the creator's start time) and torch (views).
Nothing is imported with the package itself: the CLI reads `geometry` and `pages`
without loading numpy. Never the daemon or the client: both import this package.
"""
