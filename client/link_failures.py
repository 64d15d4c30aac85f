"""How a client's link to the daemon names and classifies a failure.

Why this file exists: `DaemonLink` (client/daemon_link.py) turns every failure into a
miss, but not every failure is the same: an outage (a stopped, restarting or stalled
daemon) is retried soon, while a refusal that lasts until a setting changes is logged
once with its fix and retried only after a long back-off. Both the link and the device
tiers it maps (client/link_tiers.py) name failures the same way (`describe`).
"""

from lmcached.wire.connection import DaemonError


def describe(exc: BaseException) -> str:
    """`TypeName: message` of an exception, for warnings and down reasons."""
    return f"{type(exc).__name__}: {exc}"


class CacheUnavailable(Exception):
    """The daemon cannot be reached now; the caller degrades to a miss."""


def permanent_refusal(exc: BaseException) -> str | None:
    """Why a failed connect will fail again until a setting changes, or None for an
    outage (a stopped, restarting or stalled daemon) worth retrying soon.

    Permanent: a HELLO refused with a code of protocol.PERMANENT_ERROR_CODES (the
    daemon's message names the sizes and the option to change), and a socket this
    process may not open (EACCES).

    Args:
        exc: what `DaemonLink.connect` raised.

    Returns:
        The reason with its fix, for the one error the link logs; None if transient.
    """
    if isinstance(exc, DaemonError) and exc.permanent:
        return describe(exc)
    if isinstance(exc, PermissionError):
        return (f"{describe(exc)}: run this process as the daemon's user or as a member of "
                "the group the daemon was started with (--allow-group)")
    return None
