"""A client's session with the daemon and its mapping of the arena, kept alive.

Why this file exists: a serving process must never fail because its cache did. Every
request goes through `DaemonLink.request`, which turns a lost daemon into
`CacheUnavailable` (callers treat it as a miss or a skipped store), warns once per
outage, and reconnects with exponential backoff on later calls, re-attaching to the
new arena generation of a restarted daemon (never reading an old generation's bytes).
"""

import threading
import time
from typing import Callable

from lmcached.config import default_socket_path
from lmcached.logger import init_logger
from lmcached.protocol import Abort, Commit, Connection, DaemonError, HelloReply, Layout, hello
from lmcached.shm.arena import Arena

logger = init_logger(__name__)

BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 5.0


class CacheUnavailable(Exception):
    """The daemon cannot be reached now; the caller degrades to a miss."""


class DaemonLink:
    """One session with the daemon plus the arena mapping, re-established after loss.

    Thread-safe: one lock serializes requests (a background store thread shares the
    session with the caller's thread).

    Args:
        socket_path: the daemon's socket, or None for the default of daemon `name`.
        name: daemon name used to find the default socket, and the client's name.
        layout: the namespace to register in HELLO (None for admin-like clients).
        timeout_s: connect and per-request timeout in seconds.

    Attributes:
        hello_reply: the last HELLO reply (arena, generation, namespace id), or None
            while disconnected.
        arena: the mapped arena of the current generation, or None.
        num_reconnects: successful reconnections after a loss.
    """

    def __init__(
        self,
        socket_path: str | None,
        name: str = "default",
        layout: Layout | None = None,
        timeout_s: float = 10.0,
        client_name: str = "lmcached-client",
    ) -> None:
        self.socket_path = socket_path or default_socket_path(name)
        self.layout = layout
        self.timeout_s = timeout_s
        self.client_name = client_name
        self.hello_reply: HelloReply | None = None
        self.arena: Arena | None = None
        self.num_reconnects = 0
        self.lock = threading.RLock()
        self._conn: Connection | None = None
        self._backoff_s = BACKOFF_INITIAL_S
        self._next_attempt = 0.0
        self._down_reason: str | None = None
        self._closed = False
        # Called with each newly attached arena / before an arena is unmapped (e.g. to
        # page-lock it for CUDA).
        self.on_attach: Callable[[Arena], object] | None = None
        self.on_detach: Callable[[Arena], object] | None = None

    # ------------------------------------------------------------- connection
    def connect(self) -> None:
        """Open the session and map the arena now.

        Raises:
            OSError (e.g. FileNotFoundError, ConnectionRefusedError): no daemon.
            DaemonError: the daemon refused the HELLO (e.g. a layout that does not fit).
        """
        with self.lock:
            conn = Connection(self.socket_path, self.timeout_s)
            try:
                reply = hello(conn, self.client_name, self.layout)
                arena = self.arena
                if arena is None or arena.generation != reply.generation:
                    new_arena = Arena.attach(reply.arena_name, reply.generation, reply.block_bytes)
                    if arena is not None:
                        self._unmap(arena)
                    if self.on_attach is not None:
                        self.on_attach(new_arena)
                    arena = new_arena
            except BaseException:
                conn.close()
                raise
            self._conn, self.hello_reply, self.arena = conn, reply, arena
            self._backoff_s = BACKOFF_INITIAL_S
            if self._down_reason is not None:
                self.num_reconnects += 1
                logger.warning(
                    "lmcached daemon at %s is back (generation %d): caching again",
                    self.socket_path, reply.generation,
                )
                self._down_reason = None

    @property
    def connected(self) -> bool:
        """True while a session is open."""
        return self._conn is not None

    @property
    def generation(self) -> int | None:
        """Arena generation of the current session, or None while disconnected."""
        return self.hello_reply.generation if self.hello_reply else None

    def mark_down(self, reason: str) -> None:
        """Drop the session after a failure; warn once per outage; schedule a retry."""
        with self.lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self.hello_reply = None
            if self._down_reason is None:
                logger.warning(
                    "lmcached daemon at %s is unavailable (%s): serving without the cache "
                    "(misses, skipped stores) and reconnecting in the background",
                    self.socket_path, reason,
                )
            self._down_reason = reason
            self._next_attempt = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)

    def ensure_connected(self) -> HelloReply:
        """The current session, reconnecting if the backoff allows.

        Raises:
            CacheUnavailable: disconnected and not (yet) reconnectable.
        """
        reply = self.hello_reply
        if reply is not None:
            return reply
        with self.lock:
            if self._closed:
                raise CacheUnavailable("the engine is closed")
            if self.hello_reply is not None:
                return self.hello_reply
            if time.monotonic() < self._next_attempt:
                raise CacheUnavailable(self._down_reason or "disconnected")
            try:
                self.connect()
            except (OSError, DaemonError, ValueError) as exc:
                self.mark_down(f"{type(exc).__name__}: {exc}")
                raise CacheUnavailable(str(exc)) from None
            return self.hello_reply

    def request(self, message, generation: int | None = None):
        """Send one request on the current session.

        Args:
            message: a protocol request.
            generation: if given, the request is only sent when the session is still on
                this arena generation (block ids of an old generation mean nothing now).

        Raises:
            CacheUnavailable: the daemon is gone (or was replaced) and the request was
                not answered.
            DaemonError: the daemon refused the request.
        """
        with self.lock:
            reply = self.ensure_connected()
            if generation is not None and reply.generation != generation:
                raise CacheUnavailable("the daemon restarted: old block ids are void")
            try:
                return self._conn.request(message)
            except (OSError, ConnectionError, TimeoutError) as exc:
                self.mark_down(f"{type(exc).__name__}: {exc}")
                raise CacheUnavailable(str(exc)) from None

    def fill_and_commit(self, block_ids: list[int], generation: int,
                        fill: Callable[[], None]) -> bool:
        """Fill blocks this session ALLOCated with `fill()`, then COMMIT them (DESIGN.md:
        WRITING -> READY); ABORT them if `fill` raises, so no half-written record is ever
        readable.

        Args:
            block_ids: the ALLOC reply's block ids (may be empty: nothing to commit).
            generation: the arena generation they were allocated in.
            fill: copies the records' bytes into the blocks.

        Returns:
            True once committed; False when the daemon is gone or refused the COMMIT
            (logged): the chunks are then simply not stored.

        Raises:
            Whatever `fill` raises, after the ABORT.
        """
        try:
            fill()
        except BaseException:
            if block_ids:
                try:
                    self.request(Abort(block_ids), generation)
                except (CacheUnavailable, DaemonError):
                    pass  # the session's end aborts them anyway
            raise
        if not block_ids:
            return True
        try:
            self.request(Commit(block_ids), generation)
        except CacheUnavailable:
            return False
        except DaemonError as exc:
            logger.warning("COMMIT refused, chunks not stored: %s", exc)
            return False
        return True

    def close(self) -> None:
        """End the session (the daemon releases its pins) and unmap the arena."""
        with self.lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self.hello_reply = None
            if self.arena is not None:
                self._unmap(self.arena)
                self.arena = None

    def _unmap(self, arena: Arena) -> None:
        if self.on_detach is not None:
            self.on_detach(arena)
        arena.close()
