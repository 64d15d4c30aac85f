"""The janitor: finds arena segments whose daemon died and unlinks them.

Why this file exists: a daemon killed by SIGKILL (or the OOM killer) never unlinks its
arena, and a POSIX shared-memory segment outlives every process that mapped it: it keeps
its memory until someone removes its file in /dev/shm. Only the owner unlinks a live
segment (`Arena.close`), so the cleaning up after crashes lives here, apart from the
segment itself, as CPython keeps `resource_tracker.py` apart from `shared_memory.py`.

A segment is an orphan when the daemon recorded in its header (pid and process create
time, written by `Arena.create`) is gone. The daemon sweeps the segments of its name at
start-up (`startup.py`); `launcher.py` sweeps after stopping a daemon it started.
"""

import os
import time

import posix_ipc
import psutil

from lmcached.logger import init_logger

from .arena import ARENA_MAGIC, SEGMENT_HEADER, SEGMENT_PREFIX

logger = init_logger(__name__)

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments as files


def read_segment_owner(path: str) -> tuple[int, int, float] | None:
    """Read (generation, owner pid, owner create time) from a segment file's header.

    Returns:
        None when the file is too small or has no lmcached header.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(SEGMENT_HEADER.size)
    except OSError:
        return None
    if len(raw) < SEGMENT_HEADER.size:
        return None
    magic, generation, pid, create_time, _, _ = SEGMENT_HEADER.unpack(raw)
    if magic != ARENA_MAGIC:
        return None
    return generation, pid, create_time


def _owner_alive(pid: int, create_time: float) -> bool:
    """Whether the daemon that wrote a segment's header still runs.

    Dead: no process `pid`, a process `pid` started at another time (the pid was
    reused), or a zombie (killed, e.g. by SIGKILL, and not yet reaped by its parent: it
    holds no mapping and will never unlink its segment). A process this one may not
    inspect counts as alive: never unlink a live daemon's arena.
    """
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) >= 0.01:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):  # ZombieProcess is a NoSuchProcess
        return False
    except psutil.AccessDenied:
        return True


def list_segments(name: str | None = None) -> list[str]:
    """File names in /dev/shm of arena segments (of daemon `name`, or of any daemon)."""
    prefix = SEGMENT_PREFIX + (f"{name}." if name else "")
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if e.startswith(prefix))


def sweep_orphans(name: str | None = None, min_age_s: float = 10.0) -> list[str]:
    """Unlink arena segments whose owning daemon is dead (start-up janitor).

    A segment is an orphan when the process recorded in its header (pid and create time,
    so a reused pid does not count) no longer exists or is a zombie (`_owner_alive`). A
    segment without a valid header is removed only when older than `min_age_s` (it may
    be one being created right now). Another user's segment that this process may not
    read or unlink is left alone.

    Args:
        name: only segments of this daemon name; None for every lmcached segment.
        min_age_s: age below which a headerless segment is left alone.

    Returns:
        The names (in /dev/shm) of the segments unlinked.
    """
    removed = []
    for entry in list_segments(name):
        path = os.path.join(SHM_DIR, entry)
        owner = read_segment_owner(path)
        if owner is None:
            try:
                if time.time() - os.stat(path).st_mtime < min_age_s:
                    continue
            except FileNotFoundError:
                continue
        elif _owner_alive(owner[1], owner[2]):
            continue
        try:
            posix_ipc.unlink_shared_memory("/" + entry)
        except posix_ipc.ExistentialError:
            continue
        except posix_ipc.PermissionsError:  # another user's segment: not ours to judge
            logger.debug("cannot remove segment %s of another user", entry)
            continue
        logger.warning("removed orphaned arena segment %s (its daemon is gone)", entry)
        removed.append(entry)
    return removed
