"""Pages of a shared mapping: reserve, populate, protect; and where /dev/shm has room.

Why this file exists: writes into untouched shared memory pay a page fault per page and run several times
slower than writes into touched memory (docs/architecture.md, "Prefault"), so `create`
prefaults every page. It first reserves them (`posix_fallocate` on the segment): /dev/shm
is a tmpfs that may not have room for every page a segment's size promises, and a page
the kernel cannot back kills whoever touches it (SIGBUS), a worker storing into the
arena as well as the daemon. Reserved, a full /dev/shm fails the start-up with ENOSPC
instead. Daemons reserve one at a time (an flock on /dev/shm), so that two daemons
racing for the last space never both get part of it and both fail: one starts, the
other refuses.

Every function here works on a mapping and its file, whatever arena owns them
(`arena.py`): the daemon's named segments and anonymous (memfd) arenas alike.
"""

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import shutil
import time
from typing import Callable, Iterator

from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_PREFAULT_STEP_BYTES = 64 << 20
_SHM_DIR = "/dev/shm"  # where posix_ipc's segments live on Linux; flocked while reserving
_LOCK_POLL_S = 0.05
# Longest wait for the reservation lock; then the arena is reserved without it (see
# `reservation_lock`): anyone may flock /dev/shm, and must not hold a start-up forever.
_LOCK_WAIT_MAX_S = 10.0
_PAGE_BYTES = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)

ProgressCallback = Callable[[int, int], None]  # (done_bytes, total_bytes)


def shm_free_bytes() -> int:
    """Free bytes in /dev/shm (where POSIX shared memory lives on Linux)."""
    return shutil.disk_usage("/dev/shm").free


def prefault(mapping: mmap.mmap, total_bytes: int, progress: ProgressCallback | None = None,
             reserve_fd: int | None = None) -> None:
    """Populate pages [0, total_bytes) of `mapping` for writing, in steps, reporting progress.

    Args:
        mapping: the arena's mapping.
        total_bytes: bytes to populate from its start.
        progress: called as progress(done_bytes, total_bytes) after each step.
        reserve_fd: the mapping's file: each step's pages are first allocated in it
            (posix_fallocate), so that a tmpfs without room fails here with ENOSPC, not
            a later store with SIGBUS. None: populate only.

    Raises:
        OSError: the pages cannot be reserved (ENOSPC) or populated (`populate`).
    """
    for start in range(0, total_bytes, _PREFAULT_STEP_BYTES):
        length = min(_PREFAULT_STEP_BYTES, total_bytes - start)
        if reserve_fd is not None:
            os.posix_fallocate(reserve_fd, start, length)
        populate(mapping, start, length)
        if progress is not None:
            progress(start + length, total_bytes)


def protect_pages(mapping: mmap.mmap, num_bytes: int) -> None:
    """Make the first `num_bytes` of a client's mapping (the arena's header) read-only
    (mprotect), where they are whole pages. Defence in depth: a client can still map the
    segment itself read-write, which is why nothing trusts the header's bytes."""
    if num_bytes % _PAGE_BYTES:
        return  # pages larger than the header: blocks share its page
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # the export ends here
    if _libc.mprotect(ctypes.c_void_p(address), num_bytes, mmap.PROT_READ):
        err = ctypes.get_errno()
        raise OSError(err, f"mprotect of the arena header: {os.strerror(err)}")


def populate(mapping: mmap.mmap, start: int, length: int) -> None:
    """Map pages [start, start+length) for writing, allocating them where needed.

    Only EINVAL, the answer of a kernel older than 5.14 that does not know
    MADV_POPULATE_WRITE, falls back to reading one byte per page, which faults it in
    (and allocates it in a tmpfs); writing it back could undo another process's store
    into the page meanwhile. Any other failure is an error: touching a page the kernel
    cannot back would be SIGBUS. The process's other threads run meanwhile (`_madvise`
    releases the GIL): the daemon rebuilds its disk tier's index while it prefaults.

    Raises:
        OSError: EFAULT (a page cannot be backed: a full tmpfs; touching it would be
            SIGBUS), ENOMEM (a memory limit), or another errno of madvise(2).
    """
    err = _madvise(mapping, start, length, _MADV_POPULATE_WRITE)
    if err == 0:
        return
    if err != errno.EINVAL:
        raise OSError(err, os.strerror(err))
    import numpy as np  # only on a kernel older than 5.14

    pages = np.frombuffer(mapping, dtype=np.uint8, count=length, offset=start)
    pages[::_PAGE_BYTES].sum()  # a read, never a write (and numpy skips `a[:] = a`)
    del pages


def _madvise(mapping: mmap.mmap, start: int, length: int, advice: int) -> int:
    """madvise(2) of bytes [start, start+length) of `mapping` (start page-aligned), through
    ctypes, which releases the GIL for the call (`mmap.madvise` holds it: tens of ms per
    64 MiB populated, during which no other thread of the process runs). Returns 0, or
    the errno."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # the export ends here
    if _libc.madvise(ctypes.c_void_p(address + start), ctypes.c_size_t(length),
                     ctypes.c_int(advice)) == 0:
        return 0
    return ctypes.get_errno()


@contextlib.contextmanager
def reservation_lock(waiting: Callable[[], None] | None) -> Iterator[None]:
    """Hold an exclusive flock on /dev/shm: daemons reserve their arenas one at a time.

    Two daemons reserving at once on a tmpfs with room for only one would each get part
    of it, and both fail; in turn, the first gets its arena and the second ENOSPC.
    Any local process may flock /dev/shm, so the wait is bounded (_LOCK_WAIT_MAX_S):
    past it the arena is reserved without the lock, with a warning. Reservation still
    protects that start-up (a full tmpfs is ENOSPC, never SIGBUS); only a race with
    another daemon may then refuse both.

    Args:
        waiting: called every _LOCK_POLL_S while another process holds the lock (it may
            raise to give up, e.g. on a stop signal); None: wait.
    """
    fd = os.open(_SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        logged = False
        deadline = time.monotonic() + _LOCK_WAIT_MAX_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning("another process has held the lock on %s for %g s: "
                                   "reserving this arena without it", _SHM_DIR,
                                   _LOCK_WAIT_MAX_S)
                    break
                if not logged:
                    logger.info("waiting for another process to reserve its memory in %s",
                                _SHM_DIR)
                    logged = True
                if waiting is not None:
                    waiting()
                time.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock
