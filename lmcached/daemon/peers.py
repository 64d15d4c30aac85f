"""What a connected peer may reach, from the credentials the kernel gave at accept.

Why this file exists: the daemon knows a peer by its SO_PEERCRED (uid, primary gid) and
nothing else, and two questions are decided from them here, in one place: may it
connect (`is_member` of --allow-group, server_clients.py), and may it read the arena
(`can_read_arena`). They differ: a member of --allow-group connects whatever the
segment's mode (--shm-mode), and with 0600 it cannot map the arena, so the daemon must
not hand it what only the arena holds (the token ids of the event feed,
event_handlers.py).
"""

import os
import pwd
import stat

from lmcached.shm.arena import Arena
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


def is_member(uid: int, gid: int, group_gid: int) -> bool:
    """Is the peer of `uid` (primary gid `gid`) a member of group `group_gid`: its primary
    gid, or its user's supplementary groups in the group database (getgrouplist; a uid
    with no user there has its primary group only)."""
    if gid == group_gid:
        return True
    try:
        user = pwd.getpwuid(uid).pw_name
        return group_gid in os.getgrouplist(user, gid)
    except KeyError:
        return False


def can_read_arena(uid: int, gid: int, arena: Arena) -> bool:
    """May the peer of `uid` (primary gid `gid`) read arena `arena`'s segment, as the
    kernel decides an open: the daemon's uid and root always; another uid by the
    segment's mode now (`Arena.stat`): the owner's bits if it owns the segment, else
    the group's if it is a member of the segment's group (`is_member`), else the
    others'. A segment that cannot be inspected reads as not readable (fail closed).

    Reads the segment's status (one shm_open and fstat, ~10 us) for a peer outside the
    daemon's uid and root: call it once per request that needs it, not per chunk.
    """
    if uid in (0, os.geteuid()):
        return True
    try:
        segment = arena.stat()
    except (OSError, ValueError) as exc:
        logger.warning("cannot inspect the arena's segment (%s): peer uid %d is treated as "
                       "unable to read it", exc, uid)
        return False
    mode = segment.st_mode
    if uid == segment.st_uid:
        return bool(mode & stat.S_IRUSR)
    if is_member(uid, gid, segment.st_gid):
        return bool(mode & stat.S_IRGRP)
    return bool(mode & stat.S_IROTH)
