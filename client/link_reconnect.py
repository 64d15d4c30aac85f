"""When a `DaemonLink` reconnects: the outage and back-off policy of client/daemon_link.py.

Why this file exists: the link's request path (client/daemon_link.py) and its policy for a
lost daemon are two concepts. Here: a failure marks the link down (`mark_down`: one
warning per outage, then an exponentially growing back-off window, BACKOFF_INITIAL_S up
to BACKOFF_MAX_S, during which every call is a miss at once); a refusal that lasts until
a setting changes (`permanent_refusal`, client/link_failures.py) logs one error and is
retried only every PERMANENT_BACKOFF_S; `ensure_connected` reconnects once the window
has passed; the first answered request after an outage ends it (`answered`); a session
the daemon closed while the link was idle (`--idle-timeout`) is dropped before the next
call so that it re-opens with no miss (`reopen_if_closed_while_idle`).

`ReconnectPolicy` is an object a `DaemonLink` holds (`link.reconnect`): its state is its
own (the back-off, the next attempt, the outage's reason, the last answer's time, the
outages ended), and each method takes the link it acts on, whose public members it reads
or calls are declared by `LinkSession`. Its log lines keep the logger name of the link
(lmcached.client.daemon_link), which docs/troubleshooting.md quotes.
"""

import threading
import time
from typing import Protocol

from lmcached.client.link_failures import CacheUnavailable, describe, permanent_refusal
from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import HelloReply

logger = init_logger("lmcached.client.daemon_link")

BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 5.0
PERMANENT_BACKOFF_S = 60.0  # after a refusal that only a change of settings lifts
# A session unused this long is checked for a close before a call (one poll(2)); an
# --idle-timeout shorter than this shows as an outage (one warning, one miss).
IDLE_PROBE_S = 0.1


class LinkSession(Protocol):
    """What `ReconnectPolicy` reads and changes of the link it acts on (`DaemonLink`)."""

    lock: threading.RLock
    socket_path: str
    hello_reply: HelloReply | None
    data_timeout_s: float

    @property
    def closed(self) -> bool: ...

    def connect(self, timeout_s: float | None = None) -> None: ...

    def peer_closed(self) -> bool: ...

    def drop_session(self) -> None: ...


class ReconnectPolicy:
    """The outage, back-off and reconnect policy of one `DaemonLink` (see the module
    docstring).

    Attributes:
        num_reconnects: outages ended by an answered request after a reconnect.
    """

    def __init__(self) -> None:
        self.num_reconnects = 0
        self._backoff_s = BACKOFF_INITIAL_S
        self._next_attempt = 0.0
        self._down_reason: str | None = None
        self._last_request_at = 0.0

    def try_connect(self, link: LinkSession, strict: bool = False) -> bool:
        """`link.connect()` now (timeout `timeout_s`); on any failure start disconnected.

        Args:
            link: the link to connect.
            strict: re-raise the failure instead (tests, tools that need the daemon).

        Returns:
            True when connected; False when the link was marked down (one warning; the
            next calls are misses and retry after the back-off).

        Raises:
            With strict=True only: whatever `connect` raises.
        """
        try:
            link.connect()
        except Exception as exc:
            if strict:
                raise
            self.connect_failed(link, exc)
            return False
        return True

    def mark_down(self, link: LinkSession, reason: str, permanent: bool = False) -> None:
        """Drop the link's session after a failure; schedule a retry.

        Until the retry every request fails at once with `CacheUnavailable` instead of
        paying a timeout again. An outage warns once and retries after an exponentially
        growing back-off (BACKOFF_INITIAL_S up to BACKOFF_MAX_S, reset by an answered
        request); a permanent refusal logs one error per distinct reason and retries
        after PERMANENT_BACKOFF_S (a daemon restarted with other settings is found
        again).

        Args:
            link: the link that failed.
            reason: what failed, with its fix for a permanent refusal.
            permanent: the failure lasts until a setting changes (`permanent_refusal`).
        """
        with link.lock:
            link.drop_session()
            if permanent:
                if reason != self._down_reason:
                    logger.error(
                        "lmcached daemon at %s refuses this client (%s): serving without "
                        "the cache (misses, skipped stores); next try in %.0f s",
                        link.socket_path, reason, PERMANENT_BACKOFF_S,
                    )
                self._next_attempt = time.monotonic() + PERMANENT_BACKOFF_S
            else:
                if self._down_reason is None:
                    logger.warning(
                        "lmcached daemon at %s is unavailable (%s): serving without the "
                        "cache (misses, skipped stores) and reconnecting in the background",
                        link.socket_path, reason,
                    )
                self._next_attempt = time.monotonic() + self._backoff_s
                self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
            self._down_reason = reason

    def connect_failed(self, link: LinkSession, exc: BaseException) -> None:
        """`mark_down` after a failed connect: permanent when `permanent_refusal` says so."""
        refusal = permanent_refusal(exc)
        self.mark_down(link, refusal or describe(exc), refusal is not None)

    def ensure_connected(self, link: LinkSession) -> HelloReply:
        """The link's current session, reconnecting (timeout `data_timeout_s`) if the
        backoff allows.

        Raises:
            CacheUnavailable: disconnected and not (yet) reconnectable; a failed
                reconnect of any kind marks the link down again.
        """
        reply = link.hello_reply
        if reply is not None:
            return reply
        with link.lock:
            if link.closed:
                raise CacheUnavailable("the engine is closed")
            if link.hello_reply is not None:
                return link.hello_reply
            if time.monotonic() < self._next_attempt:
                raise CacheUnavailable(self._down_reason or "disconnected")
            try:
                link.connect(link.data_timeout_s)
            except Exception as exc:  # any failure to open a session means "no cache now"
                self.connect_failed(link, exc)
                raise CacheUnavailable(describe(exc)) from None
            return link.hello_reply

    def reopen_if_closed_while_idle(self, link: LinkSession) -> None:
        """Drop a session unused for IDLE_PROBE_S that the daemon has closed meanwhile
        (`--idle-timeout`, or a daemon stopped since), so that `ensure_connected` opens a
        new one now instead of the next request failing on the old socket (a miss and
        an "unavailable" warning when the daemon was never down). One poll(2), only
        after IDLE_PROBE_S without a request: nothing on a busy link. The new session
        has a new id, so pins of the old one never look held (`holds`)."""
        if (time.monotonic() - self._last_request_at < IDLE_PROBE_S
                or not link.peer_closed()):
            return
        logger.debug("lmcached daemon at %s closed idle session %d (--idle-timeout): "
                     "opening a new one", link.socket_path, link.hello_reply.session_id)
        link.drop_session()

    def answered(self, link: LinkSession) -> None:
        """A reply was read on the link: note when, and end an outage if one was on."""
        self._last_request_at = time.monotonic()
        if self._down_reason is not None:
            self._recovered(link)

    def _recovered(self, link: LinkSession) -> None:
        """The first answer after an outage: end it, reset the back-off.

        Only an answered request ends an outage, not a successful HELLO: a daemon that
        greets but then stalls or answers out of protocol keeps its growing back-off
        and its single warning.
        """
        self._backoff_s = BACKOFF_INITIAL_S
        self.num_reconnects += 1
        logger.info("lmcached daemon at %s is back (generation %d): caching again",
                    link.socket_path, link.hello_reply.generation)
        self._down_reason = None
