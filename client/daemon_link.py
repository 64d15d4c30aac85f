"""A client's session with the daemon and its mapping of the arena, kept alive.

Why this file exists: a serving process must never fail because its cache did. This is
the ONE client call path, used by the engine, the adapters and the vLLM scheduler and
worker: `DaemonLink.call` holds the lock, takes one snapshot of the session (namespaces,
arena generation, arena), runs the caller's requests on it, releases the leases they
took if anything fails, and maps every failure in one place (the chunk-chain requests
sent through it are in client/chain/; the device tiers it maps, in
client/link_tiers.py). Every (re)connect goes through
`DaemonLink.try_connect` or `ensure_connected`, which turn any failure -- no socket (ENOENT), a refused or
forbidden socket (ECONNREFUSED, EACCES), an arena segment the process may not map
(posix_ipc.PermissionsError, which is not an OSError), a protocol version the daemon
does not speak, a reply that does not decode, a timeout -- into `CacheUnavailable`
(callers treat it as a miss or a skipped store). The link then warns once per outage,
skips the daemon for an exponentially growing back-off window, and reconnects on a later
call (that policy, `ReconnectPolicy`, is client/link_reconnect.py), re-attaching to the new arena generation of a restarted daemon (never reading an
old generation's bytes). A refusal that lasts until a setting changes (client/link_failures.py:
a chunk record the arena cannot hold, another protocol version, a socket this user may
not open) is not an outage: one error naming the sizes and the fix, then a retry only
every PERMANENT_BACKOFF_S. A session the daemon closed while the link was idle
(`--idle-timeout`) is re-opened at the start of the next call, with no miss and no
warning (a new session: pins of the old one stay void, `holds`). Only `DaemonError` (the
daemon refused one request; the session stays open) reaches callers as itself.

Timeouts: requests on the serving path (DATA_PATH_REQUESTS) and the reconnects that
`ensure_connected` makes on that path wait at most `data_timeout_s` (default 200 ms,
$LMCACHED_DATA_TIMEOUT_MS), so a stopped daemon costs a serving step one short timeout,
not seconds; the first connect and admin requests wait `timeout_s` (10 s).
"""

import math
import threading
from typing import Callable, Sequence, TypeVar

from lmcached.client.link_failures import CacheUnavailable, describe
from lmcached.client.link_reconnect import ReconnectPolicy
from lmcached.client.link_tiers import TierUnusable, close_other, map_tiers
from lmcached.client.snapshot import Snapshot
from lmcached.shm.arena import Arena
from lmcached.wire import envs
from lmcached.wire.logger import init_logger
from lmcached.wire.connection import Connection, DaemonError, hello
from lmcached.wire.protocol import (
    NO_REPLY_REQUESTS,
    Abort,
    Acquire,
    Alloc,
    Commit,
    Delete,
    Get,
    HelloReply,
    Invalidate,
    Layout,
    Lookup,
    Put,
    Release,
    Scan,
)
from lmcached.wire.socket_path import (API_HINT, NoDaemonError, connect_first, daemon_name,
                                        daemon_socket_paths)

logger = init_logger(__name__)

T = TypeVar("T")

ADMIN_TIMEOUT_S = 10.0  # first connect, HELLO and admin requests
DATA_TIMEOUT_S = 0.2  # serving-path requests and their reconnects ($LMCACHED_DATA_TIMEOUT_MS)

# Requests a serving step waits for: a stalled daemon must cost them milliseconds.
DATA_PATH_REQUESTS = frozenset({Lookup, Acquire, Alloc, Commit, Abort, Release, Put, Get,
                                Delete, Scan, Invalidate})


def default_data_timeout_s() -> float:
    """The serving-path timeout in seconds: $LMCACHED_DATA_TIMEOUT_MS, else DATA_TIMEOUT_S.

    Raises:
        ValueError: the variable is not a positive number of milliseconds.
    """
    value = envs.get("LMCACHED_DATA_TIMEOUT_MS")
    if value is None:
        return DATA_TIMEOUT_S
    try:
        timeout_ms = float(value)
    except ValueError:
        timeout_ms = math.nan
    if not 0 < timeout_ms < math.inf:
        raise ValueError(f"LMCACHED_DATA_TIMEOUT_MS={value!r}: give a positive number of "
                         "milliseconds, e.g. 200")
    return timeout_ms / 1000


_WARNED_DEVICES: set[str] = set()


class DaemonLink:
    """One session with the daemon plus the arena mapping, re-established after loss.

    Thread-safe: one lock serializes requests (a background store thread shares the
    session with the caller's thread).

    Args:
        socket_path: the daemon's socket, or None to look for daemon `name` where it
            may listen, as the CLI does (`socket_path.daemon_socket_paths`:
            $LMCACHED_SOCKET, else /run/lmcached, $RUNTIME_DIRECTORY,
            $XDG_RUNTIME_DIR/lmcached, /tmp/lmcached-<uid>; the first that answers),
            again at each reconnect.
        name: the daemon's name, to find its socket (None: $LMCACHED_NAME, else
            "default").
        layouts: the namespaces to register in HELLO, one per layout (e.g. one per
            tensor parallel rank); empty for admin-like clients.
        timeout_s: timeout of `connect` / `try_connect` and of admin requests, seconds.
        client_name: the name the daemon lists in CLIENTS.
        data_timeout_s: timeout of DATA_PATH_REQUESTS and of the reconnects
            `ensure_connected` makes, seconds (None: $LMCACHED_DATA_TIMEOUT_MS, else
            DATA_TIMEOUT_S).
        devices: device UUIDs whose tiers this session maps (docs/architecture.md,
            "Tiers"); the first one is the home tier that stores go to. A tier that
            cannot be mapped here is dropped from the list (one warning per device per
            process) and the session runs on the host arena.

    Raises:
        ValueError: a timeout that is not positive.

    Attributes:
        hello_reply: the last HELLO reply (arena, generation, namespace ids), or None
            while disconnected.
        arena: the mapped arena of the current generation, or None.
        tiers: the mapped device tiers of the current generation, by tier id.
        failed_devices: devices whose tier could not be mapped (not asked for again).
        reconnect: its outage and back-off policy (`ReconnectPolicy`).
    """

    def __init__(
        self,
        socket_path: str | None,
        name: str | None = None,
        layouts: Sequence[Layout] = (),
        timeout_s: float = ADMIN_TIMEOUT_S,
        client_name: str = "lmcached-client",
        data_timeout_s: float | None = None,
        devices: Sequence[str] = (),
    ) -> None:
        if data_timeout_s is None:
            data_timeout_s = default_data_timeout_s()
        if not (timeout_s > 0 and data_timeout_s > 0):
            raise ValueError(f"timeouts must be positive seconds, got timeout_s={timeout_s}, "
                             f"data_timeout_s={data_timeout_s}")
        self.name = daemon_name(name)
        self._socket = socket_path
        self.socket_path = daemon_socket_paths(socket_path, self.name)[0]  # until connected
        self.layouts = tuple(layouts)
        self.timeout_s = timeout_s
        self.data_timeout_s = data_timeout_s
        self.client_name = client_name
        self.hello_reply: HelloReply | None = None
        self.arena: Arena | None = None
        self.devices = tuple(devices)
        self.failed_devices: set[str] = set()
        self.tiers: dict[int, object] = {}
        self.home_tier = 0
        self.reconnect = ReconnectPolicy()
        self.lock = threading.RLock()
        self._conn: Connection | None = None
        self._closed = False
        # Called with each newly attached arena / before an arena is unmapped (e.g. to
        # page-lock it for CUDA).
        self.on_attach: Callable[[Arena], object] | None = None
        self.on_detach: Callable[[Arena], object] | None = None

    # ------------------------------------------------------------- connection
    def connect(self, timeout_s: float | None = None) -> None:
        """Open the session and map the arena now.

        Args:
            timeout_s: how long the socket connect and the HELLO may wait, seconds
                (None: `self.timeout_s`).

        Raises:
            OSError (e.g. ConnectionRefusedError, PermissionError, TimeoutError): no
                daemon answers; NoDaemonError (a FileNotFoundError) when none listens in
                any place looked at, which its message lists; ConnectionError also for a
                reply out of protocol.
            DaemonError: the daemon refused the HELLO (code "version": another protocol
                version; or a layout that does not fit).
            posix_ipc.Error (e.g. PermissionsError): the arena segment cannot be opened.
            ValueError: the segment is smaller than the announced arena, or
                (UnsafeSocketPathError) the socket's directory could have been placed
                by another user (see lmcached.wire.socket_path).
            Whatever `on_attach` raises.
        """
        with self.lock:
            for _ in range(len(self.devices)):  # each failure drops one device
                try:
                    return self._connect(timeout_s)
                except TierUnusable as exc:  # again, without that device
                    self._tier_failed(exc.device, exc.reason)
            try:
                return self._connect(timeout_s)
            except TierUnusable as exc:  # never loop: a daemon out of protocol
                raise ConnectionError(f"device tier {exc}") from None

    def _connect(self, timeout_s: float | None) -> None:
        with self.lock:
            wait_s = self.timeout_s if timeout_s is None else timeout_s

            def open_at(path: str) -> Connection:
                self.socket_path = path
                return Connection(path, wait_s)

            # Looked up at each connect: a daemon started since may listen elsewhere.
            paths = daemon_socket_paths(self._socket, self.name)
            try:
                conn = connect_first(paths, open_at, API_HINT)
            except NoDaemonError:
                self.socket_path = paths[0]
                raise
            devices = [d for d in self.devices if d not in self.failed_devices]
            tiers = {}
            try:
                reply = hello(conn, self.client_name, self.layouts, devices)
                tiers = map_tiers(conn, reply, devices, self.tiers)
                arena = self.arena
                if arena is None or arena.generation != reply.generation:
                    new_arena = Arena.attach(reply.arena_name, reply.generation,
                                             reply.block_bytes, reply.capacity_bytes)
                    try:
                        if self.on_attach is not None:
                            self.on_attach(new_arena)
                    except BaseException:
                        new_arena.close()
                        raise
                    if arena is not None:
                        self._unmap(arena)
                    arena = new_arena
            except BaseException:
                conn.close()
                close_other(tiers, self.tiers)  # mapped by this attempt only
                raise
            self._conn, self.hello_reply, self.arena = conn, reply, arena
            self._replace_tiers(tiers)
            home = [t for t in reply.tiers if devices and t.device == devices[0]]
            self.home_tier = home[0].tier_id if home and home[0].tier_id in tiers else 0


    # ------------------------------------------------------------ reconnects
    @property
    def num_reconnects(self) -> int:
        """Outages ended by an answered request after a reconnect."""
        return self.reconnect.num_reconnects

    def try_connect(self, strict: bool = False) -> bool:
        """Connect now, or start disconnected (`ReconnectPolicy.try_connect`)."""
        return self.reconnect.try_connect(self, strict)

    def mark_down(self, reason: str, permanent: bool = False) -> None:
        """Drop the session after a failure; schedule a retry (`ReconnectPolicy.mark_down`)."""
        self.reconnect.mark_down(self, reason, permanent)

    def connect_failed(self, exc: BaseException) -> None:
        """`mark_down` after a failed connect (`ReconnectPolicy.connect_failed`)."""
        self.reconnect.connect_failed(self, exc)

    def ensure_connected(self) -> HelloReply:
        """The current session, reconnecting if the back-off allows
        (`ReconnectPolicy.ensure_connected`).

        Raises:
            CacheUnavailable: disconnected and not (yet) reconnectable.
        """
        return self.reconnect.ensure_connected(self)

    def _replace_tiers(self, tiers: dict) -> None:
        """Make `tiers` current and unmap the ones no longer in it (another generation)."""
        close_other(self.tiers, tiers)
        self.tiers = tiers

    def _tier_failed(self, device: str, reason: str) -> None:
        """Never ask for `device` again; warn once per device per process."""
        self.failed_devices.add(device)
        if device not in _WARNED_DEVICES:
            _WARNED_DEVICES.add(device)
            logger.warning("the device tier of %s is not usable here (%s): using the host "
                           "tier", device, reason)

    @property
    def closed(self) -> bool:
        """True once `close` was called: the link opens no session again."""
        return self._closed

    def peer_closed(self) -> bool:
        """Whether the daemon has closed the current session's socket (one poll(2),
        `Connection.peer_closed`); False while there is no session."""
        conn = self._conn
        return conn is not None and conn.peer_closed()

    @property
    def generation(self) -> int | None:
        """Arena generation of the current session, or None while disconnected."""
        return self.hello_reply.generation if self.hello_reply else None

    def request(self, message, generation: int | None = None):
        """Send one request on the current session (the primitive under `call`).

        A request of NO_REPLY_REQUESTS (RELEASE) is only sent: it returns None at once.

        DATA_PATH_REQUESTS wait at most `data_timeout_s`, others `timeout_s`. Any
        failure other than a refusal drops the session (a late reply would answer the
        next request) and starts the back-off (`mark_down`).

        Args:
            message: a protocol request.
            generation: if given, the request is only sent when the session is still on
                this arena generation (block ids of an old generation mean nothing now).

        Raises:
            CacheUnavailable: the daemon is gone, stalled past the timeout, replaced,
                or answered out of protocol, and the request was not answered.
            DaemonError: the daemon refused the request (the session stays open).
        """
        if type(message) in NO_REPLY_REQUESTS:
            return self._on_session(type(message), generation,
                                    lambda conn, t: conn.send(message, t))
        return self._on_session(type(message), generation,
                                lambda conn, t: conn.request(message, t))

    def submit(self, messages: list, generation: int | None = None) -> None:
        """Send requests (of one type) whose replies `collect` reads later, in one write
        (`Connection.submit`: pipelining within one `call`, whose body collects every
        reply it submitted).

        Raises:
            As `request` (the replies' failures come from `collect`).
        """
        self._on_session(type(messages[0]), generation,
                         lambda conn, t: conn.submit(*messages, timeout_s=t))

    def collect(self, message_type: type):
        """The reply of the oldest request `submit`ted and not collected yet, of type
        `message_type` (for the timeout).

        Raises:
            As `request`.
        """
        return self._on_session(message_type, None, lambda conn, t: conn.collect(t),
                                answers=True)

    def _on_session(self, message_type: type, generation: int | None, send: Callable,
                    answers: bool = False):
        """Run `send(connection, timeout_s)` for a request of `message_type` on the current
        session, mapping failures as `request` says; `answers`: it reads a reply (ends an
        outage)."""
        with self.lock:
            reply = self.ensure_connected()
            if generation is not None and reply.generation != generation:
                raise CacheUnavailable("the daemon restarted: old block ids are void")
            data_path = message_type in DATA_PATH_REQUESTS
            timeout_s = self.data_timeout_s if data_path else self.timeout_s
            try:
                answer = send(self._conn, timeout_s)
            except DaemonError:
                raise
            except Exception as exc:  # timeout, loss, a reply out of protocol, too large
                self.mark_down(describe(exc))
                raise CacheUnavailable(describe(exc)) from None
            except BaseException:  # interrupted half-way: the stream is out of step
                self.drop_session()
                raise
            if answer is None and not answers:
                return None
            self.reconnect.answered(self)
            return answer

    def snapshot(self) -> Snapshot | None:
        """The current session (reconnecting if the back-off allows), or None if there
        is none now. For readers that need the arena but send nothing."""
        with self.lock:
            self.reconnect.reopen_if_closed_while_idle(self)
            try:
                return Snapshot(self, self.ensure_connected(), self.arena, [], self.tiers,
                                self.home_tier)
            except CacheUnavailable:
                return None

    def call(self, what: str, body: Callable[[Snapshot], T], default: T) -> T:
        """Run `body(snapshot)` on one snapshot of the session, under the lock.

        The one place where the client side maps failures: an unavailable daemon
        (CacheUnavailable: no session, timeout, restart, reply out of protocol) gives
        `default` silently (the link warns once per outage); a refusal (DaemonError)
        gives `default` and a warning naming `what`. In both cases the leases `body`
        took through `Snapshot.acquire` are released first, so a failed call leaves no
        pin behind.

        Args:
            what: the operation, for the warning (e.g. "ACQUIRE").
            body: sends its requests through the snapshot and returns a result.
            default: the result when the daemon is unavailable or refused.

        Returns:
            What `body` returned, or `default`.

        Raises:
            Whatever `body` raises other than CacheUnavailable and DaemonError (its
            leases are released first).
        """
        with self.lock:
            snapshot = self.snapshot()
            if snapshot is None:
                return default
            try:
                return body(snapshot)
            except CacheUnavailable:
                return default  # the session ended: its pins went with it
            except DaemonError as exc:
                logger.warning("%s refused: %s", what, exc)
                snapshot.release()
                return default
            except BaseException:
                snapshot.release()
                raise
            finally:
                self._drop_out_of_step(what)

    def _drop_out_of_step(self, what: str) -> None:
        """End the session when a `call` body left submitted replies uncollected (it
        failed half-way through a pipeline): their leases are unknown here, and the next
        request would read them as its own reply. The daemon releases the session's pins
        and aborts its allocations; the next call opens a new session."""
        conn = self._conn
        if conn is not None and conn.awaiting:
            logger.debug("%s left %d replies uncollected: closing session %d", what,
                         conn.awaiting, self.hello_reply.session_id)
            self.drop_session()

    def holds(self, session_id: int, generation: int) -> bool:
        """Whether session `session_id` of arena generation `generation` is still this
        link's open session, so that the pins it took still hold.

        Pins live as long as their session: a reconnect (after a timeout, a restart, a
        closed engine) or the daemon closing the connection (`--idle-timeout`, a
        dropped client) releases them all, and their blocks may then hold another
        chunk. A caller that read pinned blocks asks this after reading: True means
        nothing could have rewritten them meanwhile (the daemon closes a session's
        socket before it releases its pins, `Connection.peer_closed`). No request is
        sent (one poll(2)); a closed connection is noticed here, before any request
        would fail on it.
        """
        with self.lock:
            reply, conn = self.hello_reply, self._conn
            return (reply is not None and conn is not None
                    and reply.session_id == session_id and reply.generation == generation
                    and not conn.peer_closed())

    def release(self, leases: list[int], session_id: int) -> None:
        """RELEASE `leases` taken in session `session_id` (fire-and-forget: no reply is
        awaited). Never raises.

        Leases of a session that ended (a reconnect, a restarted daemon) are not sent:
        the daemon released their pins when that session ended.
        """
        leases = [lease for lease in leases if lease]
        if not leases:
            return
        with self.lock:
            reply = self.hello_reply
            if reply is None or reply.session_id != session_id:
                return
            try:
                self.request(Release(leases), reply.generation)
            except CacheUnavailable:
                pass

    def close(self) -> None:
        """End the session (the daemon releases its pins) and unmap the arena and the
        device tiers."""
        with self.lock:
            self._closed = True
            self.drop_session()
            self._replace_tiers({})
            if self.arena is not None:
                self._unmap(self.arena)
                self.arena = None

    def drop_session(self) -> None:
        """Close the connection (the daemon releases its pins); keep the arena mapped.
        The next request opens a new session (`ensure_connected`, the back-off allowing);
        none after `close`."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.hello_reply = None

    def _unmap(self, arena: Arena) -> None:
        """Run `on_detach`, then unmap. A failing hook is logged, never raised: it must
        not keep a reconnect from mapping a restarted daemon's arena, nor `close` from
        unmapping."""
        try:
            if self.on_detach is not None:
                self.on_detach(arena)
        except Exception as exc:
            logger.warning("detach hook failed for arena generation %d (%s); unmapping it",
                           arena.generation, describe(exc))
        finally:
            arena.close()
