"""`lmcached.shm` (folder `shm/`): the arena and the block pool. Pure data structures, no
sockets.

What lives here, one concept per module:
    arena.py       the POSIX shared-memory segment: create, attach, prefault, unlink, and
                   zero-copy views of its blocks (the daemon and the clients).
    janitor.py     the lock of a daemon name, which says who owns its segments, and the
                   unlinking of the segments of dead daemons (the daemon's start-up
                   sweep), as CPython's resource_tracker cleans up after shared_memory.
    free_queue.py  `KVCacheBlock` metadata and the LRU `FreeKVCacheBlockQueue`.
    block_pool.py  `BlockPool`: allocation, commit, pins, free, eviction (daemon only).

What it may import: the standard library, numpy, posix_ipc, psutil, torch (lazily, for
views) and `lmcached.wire.logger`. Never `lmcached.client`, the protocol or the daemon: both
the daemon (`lmcached`) and the clients (`lmcached.client`) import this package.
"""

from .arena import Arena, segment_name
from .janitor import list_segments, sweep_orphans

__all__ = [
    "Arena",
    "list_segments",
    "segment_name",
    "sweep_orphans",
]
