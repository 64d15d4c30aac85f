"""What a connected peer is, from the credentials the kernel gave at accept.

Why this file exists: the daemon knows a peer by its SO_PEERCRED (uid, primary gid) and
nothing else; who may connect (`is_member` of --allow-group, server_clients.py) is
decided from them here, in one place.
"""

import os
import pwd


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
