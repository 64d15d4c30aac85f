"""Request semantics of the daemon: its state and the dispatch of every request to one
handler function per request type, no sockets.

Why this file exists: what the daemon decides is separated from how bytes arrive
(`server.py`), so that the semantics of docs/architecture.md's request table can be read
and tested without a socket. Each handler validates its request completely before it
changes anything; a bad request gets an `Error` reply and is counted, and the daemon
goes on serving. What the keys of the block pool are is `keys.py`; the fields of INFO
and CLIENTS are built in `info.py`.

`CacheService` holds the daemon state and dispatches; the handlers are functions over
that state, one module per responsibility (after Redis's `t_*.c` and its command
table): this file holds the state, the dispatch (one row per request type in
`commands.py`, the command table, whose rows name the handler functions), the
sessions and the housekeeping; `namespaces.py` HELLO and the namespace registry,
`request_checks.py` validation and a session's room, `value_handlers.py` the value
requests, `admin_handlers.py` the admin requests, `events.py` the chunk event feed's.
The checks, value, admin and namespace modules name the parts of the state their
functions read and change in a protocol each (`CheckState`, `ValueState`,
`AdminState`, `HelloState`; tests/daemon/test_handler_state.py holds them to it);
`replies.py` holds the refusal (`RequestError`) and the waiting reply (`Deferred`).
"""

import functools
import os
import time
from typing import TYPE_CHECKING

from lmcached.daemon import keys
from lmcached.daemon.server_config import ServerConfig
from lmcached.wire.logger import init_logger
from lmcached.daemon.stats import DaemonStats, RequestLatency
from lmcached.wire.protocol import AllocReply, BlocksReply, Error, Layout
from lmcached.daemon.session import Session
from lmcached.shm.arena import Arena
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.memory_tiers import TierSet
from lmcached.daemon.jobs import JobRunner
from lmcached.daemon.commands import COMMANDS, Command
from lmcached.daemon.events import EventFeed
from lmcached.daemon.namespaces import NamespaceRegistry, end_namespaces, namespace_emptied
from lmcached.daemon.replies import Deferred, RequestError

if TYPE_CHECKING:
    from lmcached.daemon.demotion import Demoter
    from lmcached.daemon.progress import Loading
    from lmcached.daemon.spill.tier import SpillTier

logger = init_logger(__name__)


class CacheService:
    """The daemon's state and its dispatch (single-threaded: no locks).

    Args:
        config: effective configuration.
        arena: the owned arena; cut into blocks now if its block size is known, else at
            the first HELLO that carries a layout.
        device_memories: one device tier memory per `--gpu-device`
            (shm/device_memory.py), tiers 1, 2, ...; cut into blocks of the
            arena's block size with it.
        jobs: the background job runner, whose `wake` wakes the server's loop; a new
            one that wakes nothing by default (tests apply completions themselves).

    Attributes:
        pool: the host arena's block pool (tier 0), or None until the block size is
            known.
        tiers: every tier and its pool (lmcached/daemon/memory_tiers.py).
        demoter: moves device-tier chunks to the host arena (lmcached/daemon/demotion.py);
            None without device tiers or before the block size is known.
        jobs: the daemon's background job runner (`jobs.py`): demotions and the L2
            tier's threads; the server applies their completions
            (`JobRunner.process_completions`).
        sessions: session id -> Session.
        next_lease: the id the next lease gets (`request_checks.new_lease`); daemon-wide,
            so a lease of an ended session is never given again.
        ns_registry: the namespaces alive and their ids (`namespaces.NamespaceRegistry`):
            used by an open session or by a value cached in some tier. A freed id is
            given again, the smallest first, once no value and no session uses it.
        namespaces: layout -> namespace id, of every namespace alive (the registry's
            `ids`).
        stop_requested: set by SHUTDOWN; the server loop then stops gracefully.
        stats: every counter of the request semantics (`stats.DaemonStats`); the
            pools count their hits, misses and evictions (`stats.PoolStats`).
        latency: time per request type, observed when metrics are on (`metrics.py`),
            else None.
        work_units: what the last request costs in the server's per-pass budget: its
            command's `cost` (commands.py), or what its handler priced it by its work
            (SCAN, CLIENTS).
        spill_tiers: the tiers under the arena (`spill.tier.SpillTier`: the disk tier,
            L2), in lookup order; attached by the server before it serves
            (`attach_tier`).
        load_progress: the start-up's phases (`progress.Loading`: the disk tier's index
            rebuild, the arena's prefault; INFO's loading_* fields), or None when there
            was nothing to load.
        loading: the same while they run (requests whose command is not
            `while_loading` are refused with `loading`), None once the daemon serves.
    """

    def __init__(self, config: ServerConfig, arena: Arena, device_memories=(),
                 jobs: JobRunner | None = None) -> None:
        self.config = config
        self.arena = arena
        self.tiers = TierSet(arena, device_memories)
        self.demoter: "Demoter | None" = None
        self.jobs = jobs if jobs is not None else JobRunner()
        self.pool: BlockPool | None = None
        self.spill_tiers: "list[SpillTier]" = []  # under the arena, in lookup order
        self.sessions: dict[int, Session] = {}
        self._next_session_id = 1
        self.next_lease = 1  # daemon-wide: a lease of an ended session is never reused
        self.ns_registry = NamespaceRegistry()
        self.namespaces: dict[Layout, int] = self.ns_registry.ids
        self.started_at = time.time()
        self.load_progress: "Loading | None" = None
        self.loading: "Loading | None" = None
        self.stop_requested = False
        self.stats = DaemonStats()
        self.events = EventFeed(config.events_capacity)
        self.work_units = 0
        self.latency = RequestLatency(COMMANDS) if config.metrics_port else None
        if arena.block_bytes:
            self.make_pool()

    def start_loading(self, progress: "Loading") -> None:
        """Answer in the `loading` state until `loading` is set to None (the server does
        so when the phases of `progress` end)."""
        self.load_progress = self.loading = progress

    def attach_tier(self, tier: "SpillTier") -> None:
        """Put `tier` under the arena, after the tiers attached before it (before
        serving): lookups that miss in the arena read from the spill tiers in the order
        they were attached, and chunks evicted from the arena spill to each of them."""
        self.spill_tiers.append(tier)
        tier.set_layouts(self.ns_registry.layouts.get)
        tier.set_events(self.events)
        for layout, ns in self.namespaces.items():
            tier.register_namespace(ns, layout)
        if self.pool is not None:
            self.pool.on_evict = self._evict_hook()
            tier.set_pool(self.pool, self.arena.block_bytes)

    def spill_tier(self, name: str) -> "SpillTier | None":
        """The attached spill tier called `name` (`SpillTier.name`: "disk", "l2"), or
        None: how a caller that needs one tier's own operations (the disk tier's index
        rebuild and save on stop) finds it; the rest iterate `spill_tiers`."""
        return next((tier for tier in self.spill_tiers if tier.name == name), None)

    def _evict_hook(self):
        """The host pool's `on_evict`: each spill tier's spill, in order; None without."""
        hooks = [tier.spill for tier in self.spill_tiers]
        if len(hooks) < 2:
            return hooks[0] if hooks else None

        def spill_everywhere(key, blocks) -> None:
            for hook in hooks:
                hook(key, blocks)
        return spill_everywhere

    def make_pool(self) -> None:
        """Cut the arena and the device tiers into blocks of the arena's block size, once
        it is known (at start, or at the first HELLO, `namespaces.register_layout`)."""
        tiers = self.tiers
        tiers.make_pools(self._evict_hook())
        self.pool = tiers.pools[0]
        self.pool.ledger.events = self.events
        for tier in self.spill_tiers:
            tier.set_pool(self.pool, self.arena.block_bytes)
        for pool in tiers.pools:  # each counts its values by namespace
            if pool is not None:
                pool.ledger.group_of = keys.namespace_tag_of
                pool.ledger.on_group_empty = functools.partial(namespace_emptied, self)
        if any(pool is not None for pool in tiers.pools[1:]):
            from lmcached.daemon.demotion import Demoter

            self.demoter = Demoter(tiers, self.jobs, self.host_committed)
        for tier in tiers.device_tiers:
            logger.info("device tier %d (%s %s): %d blocks of %d bytes", tier.tier_id,
                        tier.kind, tier.device, tier.memory.num_blocks, tier.memory.block_bytes)

    def host_committed(self, values: list) -> None:
        """Values just committed in the host arena (by a COMMIT or a demotion): the
        write-through of each spill tier."""
        for tier in self.spill_tiers:
            tier.write_through(self.pool, values)

    def housekeeping(self) -> None:
        """Periodic work of the loop thread: start demotions a device tier needs and the
        spill tiers' housekeeping (the disk tier's writes ahead of eviction), and abort the values that stayed WRITING
        longer than `--writing-timeout`."""
        if self.demoter is not None:
            self.demoter.plan()
        for tier in self.spill_tiers:
            tier.housekeeping()
        if self.config.writing_timeout_s and self.pool is not None:
            self.expire_writing(time.monotonic() - self.config.writing_timeout_s)

    def expire_writing(self, allocated_before: float) -> int:
        """Abort every value allocated before `allocated_before` (time.monotonic()
        seconds) and not yet committed, in every session (counted: INFO
        writing_expired). A later COMMIT of them is refused with `expired`.

        Each session is walked from its oldest allocation, so a pass costs the values it
        aborts plus one per session.

        Returns:
            How many values were aborted.
        """
        num_expired, pids = 0, []
        for session in self.sessions.values():
            if not session.writing:
                continue
            values = session.expire_pending(allocated_before)
            if not values:
                continue
            for value in values:
                self.tiers.abort(value.blocks)
            num_expired += len(values)
            pids.append(session.pid)
        if num_expired:  # one line per pass, however many sessions
            self.stats.writing_expired += num_expired
            logger.warning(
                "aborted %d values left WRITING for more than %g s (--writing-timeout) by "
                "%d sessions (pids %s); their COMMIT will be refused", num_expired,
                self.config.writing_timeout_s, len(pids), pids[:8],
            )
        return num_expired

    def close(self) -> None:
        """Stop the daemon's worker threads that read tier memory (before it is
        unmapped)."""
        if self.demoter is not None:
            self.demoter.close()
            self.demoter = None

    # ---------------------------------------------------------------- sessions
    def open_session(self, pid: int, uid: int, gid: int) -> Session:
        """Register a new connection's session."""
        session = Session(self._next_session_id, pid, uid, gid)
        self._next_session_id += 1
        self.sessions[session.session_id] = session
        self.stats.connections += 1
        return session

    def close_session(self, session: Session) -> None:
        """Release every pin and abort every pending value of an ended session, then
        free the namespaces that nothing uses any more."""
        if self.sessions.pop(session.session_id, None) is None:
            return
        self.events.unsubscribe(session.session_id)
        if self.pool is None:
            return
        tiers = self.tiers
        pinned = [block for blocks in session.leases.values() for block in blocks]
        if pinned:
            tiers.free(pinned)
        pending = {id(v): v for v in session.writing.values()}
        for value in pending.values():
            tiers.abort(value.blocks)
        if pinned or pending:
            logger.info(
                "session %d (pid %d) ended holding %d pins and %d pending values: released",
                session.session_id, session.pid, len(pinned), len(pending),
            )
        session.clear()
        end_namespaces(self, session)

    # ---------------------------------------------------------------- dispatch
    def handle(self, session: Session, request) -> object:
        """Answer one decoded request. Never raises for a client's mistake.

        The request's row of the command table (commands.py) says how: a `privileged`
        request from a peer (SO_PEERCRED uid) other than the daemon's uid or root is
        refused with `forbidden`, one not `while_loading` with `loading` while the
        daemon loads, one not `before_hello` with `no_session` before HELLO.
        `work_units` is set to the command's cost, or by a handler that prices the
        request by its work. With metrics on, the time from here to the reply Struct is
        observed in `latency` (decoding, encoding and sending are not).

        Returns:
            The reply Struct (an `Error` for a refused request), or None for a command
            whose `replies` is False (RELEASE, INVALIDATE): its refusal is counted and
            logged only.
        """
        command = COMMANDS[type(request)]
        self.work_units = command.cost
        if self.latency is None:
            return self._answer(session, request, command)
        started = time.perf_counter()
        reply = self._answer(session, request, command)
        self.latency.observe(command.request_type, time.perf_counter() - started)
        return reply

    def resume(self, session: Session, deferred: Deferred) -> object:
        """Answer a parked request from the arena, after its fetch ended or its wait
        passed (a fetch still running goes on installing for later lookups)."""
        if not deferred.job.done:
            deferred.stats.fetch_waits_timed_out += 1
        command = COMMANDS[type(deferred.request)]
        assert command.waits_for_fetch, f"a {command.name} cannot wait for a fetch: a bug"
        return self._answer(session, deferred.request, command, resumed=True)

    def _answer(self, session: Session, request, command: Command,
                resumed: bool = False) -> object:
        """The reply to `request` by its `command`'s handler, after the command's checks.
        `resumed`: the answer to a Deferred (`resume`), not counted again, its handler
        called with `resumed=True`."""
        if not resumed:
            self.stats.requests += 1
            session.num_requests += 1
        session.last_request_at = time.monotonic()
        try:
            if command.privileged and session.uid not in (0, os.geteuid()):
                raise RequestError(
                    "forbidden", f"{type(request).__name__.upper()} is allowed to the daemon's "
                    f"user (uid {os.geteuid()}) and root only, not to uid {session.uid}"
                )
            if self.loading is not None and not command.while_loading:
                raise RequestError("loading", f"{self.loading.describe()} (INFO: loading_*)")
            if not session.greeted and not command.before_hello:
                raise RequestError("no_session", "send HELLO before any other request")
            if resumed:
                return command.handler(self, session, request, resumed=True)
            return command.handler(self, session, request)
        except RequestError as exc:
            reply = self.error(exc.code, str(exc))
        except Exception:  # a bug in a handler: log it, answer, keep serving the others
            logger.exception("internal error handling %r", request)
            reply = self.error("internal", "internal error in the daemon (see its log)")
        return reply if command.replies else None

    def withdraw(self, session: Session, reply) -> None:
        """Undo what `reply` handed out when it cannot be sent (e.g. over the frame limit):
        the client never learns its lease or block ids, so nothing may stay held."""
        if isinstance(reply, BlocksReply) and reply.lease:
            blocks = session.take_leases([reply.lease])
            if blocks:
                self.tiers.free(blocks)
        elif isinstance(reply, AllocReply) and reply.block_ids:
            for value in session.take_pending(reply.block_ids) or ():
                self.tiers.abort(value.blocks)

    def error(self, code: str, message: str) -> Error:
        """An Error reply, counted under its code."""
        self.stats.errors[code] = self.stats.errors.get(code, 0) + 1
        logger.debug("refused request: %s: %s", code, message)
        return Error(code, message)


