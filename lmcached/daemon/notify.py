"""systemd's notify protocol over $NOTIFY_SOCKET (sd_notify(3)), without libsystemd.

Why this file exists: with `Type=notify` systemd waits for READY=1 before it starts the
units that need the cache, shows STATUS= in `systemctl status`, and restarts the daemon
when WATCHDOG=1 stops arriving. The protocol is one datagram of `KEY=VALUE` lines to a
Unix datagram socket; an address starting with '@' is in the abstract namespace.
"""

import os
import socket

from lmcached.wire import envs
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


class SystemdNotifier:
    """Sends notify datagrams when $NOTIFY_SOCKET is set; does nothing otherwise.

    Attributes:
        enabled: True when running under a service manager that listens.
        watchdog_interval_s: how often to send WATCHDOG=1 (half of $WATCHDOG_USEC), or
            None when the watchdog is off or meant for another process ($WATCHDOG_PID).
    """

    def __init__(self) -> None:
        address = envs.get("NOTIFY_SOCKET")
        self._address: str | bytes | None = None
        self._sock: socket.socket | None = None
        if address:
            self._address = b"\0" + address[1:].encode() if address.startswith("@") else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.enabled = self._sock is not None
        self.watchdog_interval_s = None
        usec = envs.get("WATCHDOG_USEC")
        pid = envs.get("WATCHDOG_PID")
        if usec and usec.isdigit() and int(usec) > 0 and (pid is None or pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 2e6

    def notify(self, *fields: str) -> bool:
        """Send `fields` (e.g. "READY=1", "STATUS=serving") as one datagram.

        Returns:
            True when sent; False when disabled or the send failed (logged, not raised:
            a dead service manager must not stop the cache).
        """
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self._address)
        except OSError as exc:
            logger.warning("systemd notify to %s failed: %s", self._address, exc)
            return False
        return True

    def close(self) -> None:
        """Close the datagram socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
