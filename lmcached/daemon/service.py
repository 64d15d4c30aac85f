"""Request semantics of the daemon: one method per request type, no sockets.

Why this file exists: it is everything the daemon decides, separated from how bytes
arrive (`server.py`), so that the semantics of docs/architecture.md's request table can be read
and tested in one place. Each handler validates its request completely before it
changes anything; a bad request gets an `Error` reply and is counted, and the daemon
goes on serving. What the keys of the block pool are is `keys.py`; the fields of INFO
and CLIENTS are built in `info.py`.
"""

import bisect
import heapq
import os
import time
from typing import TYPE_CHECKING

import msgspec

from lmcached.daemon import keys
from lmcached.daemon.server_config import ServerConfig
from lmcached.daemon.info import INFO_SECTIONS, client_rows, info_sections
from lmcached.wire.logger import init_logger
from lmcached.daemon.metrics import RequestLatency
from lmcached.wire.protocol import (
    ALLOCATED,
    EXISTS,
    HASH_BYTES,
    MAX_CHUNKS_PER_REQUEST,
    NO_REPLY_REQUESTS,
    NOSPACE,
    PROTOCOL_VERSION,
    Abort,
    Acquire,
    Alloc,
    AllocReply,
    BlocksReply,
    Clear,
    Clients,
    ClientsReply,
    Commit,
    ConfigGet,
    CountReply,
    Delete,
    Error,
    Evict,
    Get,
    Hello,
    HelloReply,
    Info,
    InfoReply,
    Invalidate,
    KeysReply,
    Layout,
    Lookup,
    LookupReply,
    Ok,
    OpenTier,
    Ping,
    Put,
    Release,
    Scan,
    Shutdown,
    TierHandle,
    tier_of,
)
from lmcached.daemon.session import PendingValue, Session
from lmcached.shm.arena import HEADER_BYTES, Arena
from lmcached.shm.geometry import MIN_BLOCK_BYTES
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import KVCacheBlock
from lmcached.daemon.tiers import TierSet

if TYPE_CHECKING:  # the L2 tier imports redis-py, only with --l2
    from lmcached.daemon.demotion import Demoter
    from lmcached.daemon.l2.tier import L2Tier

logger = init_logger(__name__)

BLOCK_ALIGN_BYTES = 4096  # a block size chosen from a layout is rounded up to this
MIN_DERIVED_BLOCKS = 64  # a block size derived from a layout leaves at least this many
MAX_DERIVED_BLOCKS = 1 << 16  # ... and at most this many (a client may not choose more)
_ADMIN_REQUESTS = (Info, Clients, Evict, Clear, Ping, Shutdown, ConfigGet)
# Chunk formats a device tier may hold: records of one block whose KV a GPU reader uses
# in place (the key-value adapters' values and multi-block records stay on the host).
DEVICE_TIER_FORMATS = frozenset({"vllm", "huggingface"})
# Requests that change or stop the cache for everyone: the daemon's uid and root only.
PRIVILEGED_REQUESTS = frozenset({Evict, Clear, Shutdown})
MAX_SCAN_KEYS = 10_000  # keeps a SCAN reply far below the frame limit
# A request's price in the server's per-pass budget (connection.py, PASS_BUDGET) follows
# the work it costs the loop: a SCAN page walks blocks (~80 ns each here), a CLIENTS
# row reads /proc twice (psutil, ~60 us here); one unit is about an ordinary request.
SCAN_DEFAULT_COUNT = 1024  # blocks a SCAN page walks when it names no count
MAX_SCAN_COUNT = 4096  # blocks a SCAN page walks at most (~0.3 ms)
SCAN_BLOCKS_PER_UNIT = 256
MAX_CLIENTS_PER_PAGE = 16  # sessions a CLIENTS page lists at most (~1 ms)
CLIENT_ROW_UNITS = 2
# Namespaces (docs/architecture.md, "Namespaces"): one HELLO registers one layout per
# rank it serves (a vLLM scheduler: TP x PP ranks, 8 on a node, 64 across 8 nodes'
# pipeline); the daemon keeps a namespace while a session or a cached value uses it,
# and at most MAX_NAMESPACES at once (~1 KiB each: a few MiB at most).
MAX_LAYOUTS_PER_SESSION = 64
MAX_NAMESPACES = 4096


def _namespace_layout(layout: Layout) -> Layout:
    """The layout as its namespace is keyed: a key-value adapter's record_bytes is only a
    size hint, so its layouts of every hint share one namespace."""
    if layout.fmt == "kv":
        return msgspec.structs.replace(layout, record_bytes=1)
    return layout


class RequestError(Exception):
    """A request the daemon refuses: becomes an `Error(code, message)` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Deferred:
    """A LOOKUP or ACQUIRE that waits for an L2 fetch (docs/l2.md, "How a fetch looks to
    a client"): the server parks its connection until `job.done` or `deadline`
    (time.monotonic()), then answers it with `CacheService.resume`."""

    __slots__ = ("request", "job", "deadline")

    def __init__(self, request, job, deadline: float) -> None:
        self.request = request
        self.job = job
        self.deadline = deadline


class CacheService:
    """The daemon's state and request handlers (single-threaded: no locks).

    Args:
        config: effective configuration.
        arena: the owned arena; cut into blocks now if its block size is known, else at
            the first HELLO that carries a layout.
        device_memories: one device tier memory per `--gpu-device`
            (shm/device_memory.py), tiers 1, 2, ...; cut into blocks of the
            arena's block size with it.

    Attributes:
        pool: the host arena's block pool (tier 0), or None until the block size is
            known.
        tiers: every tier and its pool (lmcached/daemon/tiers.py).
        demoter: moves device-tier chunks to the host arena (lmcached/daemon/demotion.py);
            None without device tiers or before the block size is known.
        wake: wakes the server's loop from another thread (set by the server); the
            loop then calls `process_completions`.
        sessions: session id -> Session.
        namespaces: layout -> namespace id, of every namespace alive: used by an open
            session or by a value cached in some tier. A freed id is given again, the
            smallest first, once no value and no session uses it.
        stop_requested: set by SHUTDOWN; the server loop then stops gracefully.
        stat_ns_hits / stat_ns_misses: chunks (and GET values) found / not found, by
            namespace id, of the namespaces alive; with `stat_freed_namespaces` they add
            up to the pools' stat_hits / stat_misses.
        stat_freed_namespaces: namespaces freed since start ("namespaces") and the
            hits and misses they had, in chunks and in tokens.
        latency: time per request type, observed when metrics are on (`metrics.py`),
            else None.
        work_units: what the last request cost in the server's per-pass budget, when
            its handler priced it by its work (SCAN, CLIENTS); 0 for a request of fixed
            price (connection.py, REQUEST_COST).
        l2: the L2 tier (`lmcached/daemon/l2/tier.py`), or None without --l2; set by the server
            before it serves.
    """

    def __init__(self, config: ServerConfig, arena: Arena, device_memories=()) -> None:
        self.config = config
        self.arena = arena
        self.tiers = TierSet(arena, device_memories)
        self.demoter: "Demoter | None" = None
        self.wake = lambda: None
        self.pool: BlockPool | None = None
        self.l2: "L2Tier | None" = None
        self._resuming = False  # answering a Deferred: do not start another fetch
        self.sessions: dict[int, Session] = {}
        self._next_session_id = 1
        self._next_lease = 1  # daemon-wide: a lease of an ended session is never reused
        self.namespaces: dict[Layout, int] = {}
        self._ns_layout: dict[int, Layout] = {}
        self._ns_prefix: dict[int, bytes] = {}
        self._ns_sessions: dict[int, int] = {}  # ns -> open sessions that registered it
        self._free_ns_ids: list[int] = []  # a heap: the smallest freed id is given first
        self._next_ns = 1
        self.started_at = time.time()
        self.stop_requested = False
        self.stat_requests = 0
        self.stat_stores = 0
        self.stat_lookups = 0
        self.stat_connections = 0
        self.stat_errors: dict[str, int] = {}
        self.stat_stored_bytes = 0  # bytes of the values committed, since start
        self.stat_served_bytes = 0  # bytes of the values pinned for readers, since start
        self.stat_writing_expired = 0  # values aborted after --writing-timeout
        self.stat_invalidated = 0  # chunks dropped by INVALIDATE
        self.stat_ns_hits: dict[int, int] = {}
        self.stat_ns_misses: dict[int, int] = {}
        self.stat_freed_namespaces = dict.fromkeys(
            ("namespaces", "hit_chunks", "miss_chunks", "hit_tokens", "miss_tokens"), 0)
        self.work_units = 0
        self._handlers = {
            Hello: self._hello,
            Lookup: self._lookup,
            Acquire: self._acquire,
            Release: self._release,
            Alloc: self._alloc,
            Commit: self._commit,
            Abort: self._abort,
            Put: self._put,
            Get: self._get,
            Delete: self._delete,
            Scan: self._scan,
            Info: self._info,
            Clients: self._clients,
            Evict: self._evict,
            Clear: self._clear,
            Ping: self._ping,
            Shutdown: self._shutdown,
            ConfigGet: self._config_get,
            OpenTier: self._open_tier,
            Invalidate: self._invalidate,
        }
        self.latency = RequestLatency(self._handlers) if config.metrics_port else None
        if arena.block_bytes:
            self._make_pool()

    def attach_l2(self, tier: "L2Tier") -> None:
        """Use `tier` for every namespace and pool from now on (before serving)."""
        self.l2 = tier
        for layout, ns in self.namespaces.items():
            tier.register_namespace(ns, layout)
        if self.pool is not None:
            self.pool.on_evict = tier.spill

    def _make_pool(self) -> None:
        tiers = self.tiers
        tiers.make_pools(self.l2.spill if self.l2 is not None else None)
        self.pool = tiers.pools[0]
        for pool in tiers.pools:  # each counts its values by namespace
            if pool is not None:
                pool.group_of = keys.namespace_tag_of
                pool.on_group_empty = self._namespace_emptied
        if any(pool is not None for pool in tiers.pools[1:]):
            from lmcached.daemon.demotion import Demoter

            self.demoter = Demoter(tiers, lambda: self.wake(), self._host_committed)
        for tier in tiers.device_tiers:
            logger.info("device tier %d (%s %s): %d blocks of %d bytes", tier.tier_id,
                        tier.kind, tier.device, tier.memory.num_blocks, tier.memory.block_bytes)

    def _host_committed(self, values: list) -> None:
        """Values just committed in the host arena by a demotion: L2 write-through."""
        if self.l2 is not None:
            self.l2.write_through(self.pool, values)

    def process_completions(self) -> None:
        """Finish what the daemon's threads completed (demotions); loop thread, after
        a wake-up."""
        if self.demoter is not None:
            self.demoter.finish()

    def housekeeping(self) -> None:
        """Periodic work of the loop thread: start demotions a device tier needs, and
        abort the values that stayed WRITING longer than `--writing-timeout`."""
        if self.demoter is not None:
            self.demoter.plan()
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
            self.stat_writing_expired += num_expired
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
        self.stat_connections += 1
        return session

    def close_session(self, session: Session) -> None:
        """Release every pin and abort every pending value of an ended session, then
        free the namespaces that nothing uses any more."""
        if self.sessions.pop(session.session_id, None) is None:
            return
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
        self._end_namespaces(session)

    # ---------------------------------------------------------------- dispatch
    def handle(self, session: Session, request) -> object:
        """Answer one decoded request. Never raises for a client's mistake.

        PRIVILEGED_REQUESTS from a peer (SO_PEERCRED uid) other than the daemon's uid or
        root are refused with `forbidden`. With metrics on, the time from here to the
        reply Struct is observed in `latency` (decoding, encoding and sending are not).
        A handler that prices the request by its work sets `work_units`.

        Returns:
            The reply Struct (an `Error` for a refused request), or None for a request
            of NO_REPLY_REQUESTS (RELEASE): its refusal is counted and logged only.
        """
        self.work_units = 0
        if self.latency is None:
            return self._answer(session, request)
        started = time.perf_counter()
        reply = self._answer(session, request)
        self.latency.observe(type(request), time.perf_counter() - started)
        return reply

    def resume(self, session: Session, deferred: Deferred) -> object:
        """Answer a parked request from the arena, after its fetch ended or its wait
        passed (a fetch still running goes on installing for later lookups)."""
        if not deferred.job.done:
            self.l2.stats["fetch_waits_timed_out"] += 1
        self._resuming = True
        try:
            return self._answer(session, deferred.request, count=False)
        finally:
            self._resuming = False

    def _answer(self, session: Session, request, count: bool = True) -> object:
        if count:
            self.stat_requests += 1
            session.num_requests += 1
        session.last_request_at = time.monotonic()
        try:
            if type(request) in PRIVILEGED_REQUESTS and session.uid not in (0, os.geteuid()):
                raise RequestError(
                    "forbidden", f"{type(request).__name__.upper()} is allowed to the daemon's "
                    f"user (uid {os.geteuid()}) and root only, not to uid {session.uid}"
                )
            if not session.greeted and not isinstance(request, (Hello, *_ADMIN_REQUESTS)):
                raise RequestError("no_session", "send HELLO before any other request")
            return self._handlers[type(request)](session, request)
        except RequestError as exc:
            reply = self.error(exc.code, str(exc))
        except Exception:  # a bug in a handler: log it, answer, keep serving the others
            logger.exception("internal error handling %r", request)
            reply = self.error("internal", "internal error in the daemon (see its log)")
        return None if type(request) in NO_REPLY_REQUESTS else reply

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
        self.stat_errors[code] = self.stat_errors.get(code, 0) + 1
        logger.debug("refused request: %s: %s", code, message)
        return Error(code, message)

    # -------------------------------------------------------------- validation
    def _check_namespace(self, session: Session, ns: int) -> None:
        """Refuse a namespace that is not one of this session's HELLO layouts."""
        if ns not in session.namespaces:
            raise RequestError(
                "bad_namespace",
                f"namespace {ns} is not this session's (HELLO gave {session.namespaces})",
            )

    def _check_hashes(self, hashes: bytes, num_namespaces: int = 1) -> int:
        """The chunk count of a request's hashes, after validating their length."""
        if len(hashes) % HASH_BYTES:
            raise RequestError(
                "bad_request", f"hashes are {len(hashes)} bytes, not a multiple of {HASH_BYTES}"
            )
        num_chunks = len(hashes) // HASH_BYTES
        if num_chunks * max(num_namespaces, 1) > MAX_CHUNKS_PER_REQUEST:
            raise RequestError(
                "bad_request", f"more than {MAX_CHUNKS_PER_REQUEST} chunks (over all "
                "namespaces) in one request: split it"
            )
        return num_chunks

    def _chunk_keys(self, session: Session, ns: int, hashes: bytes) -> list[bytes]:
        """The block-pool keys of a request's chunk hashes, after validating them."""
        self._check_namespace(session, ns)
        self._check_hashes(hashes)
        return keys.chunk_keys(self._ns_prefix[ns], hashes)

    def _chunk_keys_per_namespace(self, session: Session, namespaces: list[int],
                                  hashes: bytes) -> list[list[bytes]]:
        """The block-pool keys of `hashes` in each listed namespace (LOOKUP, ACQUIRE)."""
        if not namespaces:
            raise RequestError("bad_request", "no namespace listed")
        if len(set(namespaces)) != len(namespaces):
            raise RequestError("bad_request", f"namespace listed twice in {namespaces}")
        for ns in namespaces:
            self._check_namespace(session, ns)
        self._check_hashes(hashes, len(namespaces))
        return [keys.chunk_keys(self._ns_prefix[ns], hashes) for ns in namespaces]

    def _string_key(self, session: Session, ns: int, key: str) -> bytes:
        """The block-pool key of a request's string key, after validating it."""
        self._check_namespace(session, ns)
        if not key:
            raise RequestError("bad_request", "empty key")
        return keys.string_key(ns, key)

    def _require_pool(self) -> BlockPool:
        if self.pool is None:
            raise RequestError("no_layout", "no layout has attached yet: the arena has no blocks")
        return self.pool

    def _allocate_value(self, session: Session, key: bytes, num_bytes: int, replace: bool,
                        device_pool: BlockPool | None = None):
        """Allocate WRITING blocks for one value of `num_bytes`: in `device_pool` when it
        has an empty block for a one-block value, else in the host arena (which may
        evict); None when nothing is evictable, or when the session would then hold
        more than its share of the host arena (`_session_room`): nothing is evicted."""
        block_bytes = self.arena.block_bytes
        num_blocks = -(-num_bytes // block_bytes)
        blocks = None
        if device_pool is not None and num_blocks == 1:
            blocks = device_pool.allocate_empty(1)
        if blocks is None:
            if num_blocks > self._session_room(session):
                return None
            blocks = self.pool.allocate(num_blocks)
        if blocks is None:
            return None
        for block in blocks:
            block.num_bytes = block_bytes
        blocks[-1].num_bytes = num_bytes - (num_blocks - 1) * block_bytes
        session.add_pending(PendingValue(key, blocks, replace, session.last_request_at))
        return blocks

    def _session_cap_blocks(self) -> int:
        """Host arena blocks one session may hold, WRITING and pinned together:
        `--max-session-share` percent of them, at least one."""
        return max(1, int(self.pool.num_blocks * self.config.max_session_share / 100))

    def _session_room(self, session: Session) -> int:
        """Host arena blocks `session` may still allocate or pin (its share, less what it
        holds), so that one session never keeps the rest of the arena from the others."""
        return self._session_cap_blocks() - session.num_host_blocks_held

    def _max_value_bytes(self) -> int:
        """The largest value a PUT (or an ALLOC in a key-value namespace) may ask for:
        the blocks of one session's share."""
        return self._session_cap_blocks() * self.arena.block_bytes

    def _check_value_sizes(self, session: Session, ns: int, num_bytes: list[int]) -> None:
        """Refuse an ALLOC's record sizes beyond the namespace's full chunk record (or, in
        a key-value namespace, beyond `_max_value_bytes`), before anything is allocated
        or evicted.

        Raises:
            RequestError: `bad_request`, naming the size asked for and the limit.
        """
        limit = session.record_bytes.get(ns)
        largest = max(num_bytes)
        if limit is not None and largest > limit:
            raise RequestError(
                "bad_request", f"ALLOC of a {largest}-byte record in namespace {ns}, whose "
                f"layout's full chunk record is {limit} bytes: num_bytes is at most that"
            )
        if limit is None and largest > self._max_value_bytes():
            raise RequestError(
                "bad_request", f"ALLOC of a {largest}-byte value in key-value namespace "
                f"{ns}: a value is at most {self._max_value_bytes()} bytes "
                f"(--max-session-share {self.config.max_session_share:g}% of the arena)"
            )

    def _pinnable_prefix(self, session: Session, namespaces: list[int],
                         per_namespace: list[list[bytes]], num_chunks: int) -> int:
        """How many of the first `num_chunks` chunks (in every namespace) `session` may
        pin without holding more than its share of the host arena (`_session_room`);
        fewer where a chunk is not READY.

        A block the session already pins takes no more room. The chunks' spans are
        walked only when the room may be too small for them: a chunk takes at most the
        blocks of its namespace's full record (ALLOC refuses larger ones), a value of a
        key-value namespace at most a share.
        """
        room = self._session_room(session)
        block_bytes, cap = self.arena.block_bytes, self._session_cap_blocks()
        record_bytes = session.record_bytes
        most = sum(-(-record_bytes[ns] // block_bytes) if ns in record_bytes else cap
                   for ns in namespaces)
        if num_chunks * most <= room:
            return num_chunks
        find, readable, pins = self.tiers.find, session.readable, session.pins
        taken: set[int] = set()  # host blocks the chunks so far would newly pin
        for i in range(num_chunks):
            for chunk_keys in per_namespace:
                span = find(chunk_keys[i], readable)
                if span is None:
                    return i
                taken.update(b.ref for b in span if not tier_of(b.ref) and b.ref not in pins)
            if len(taken) > room:
                return i
        return num_chunks

    def _lease(self, session: Session, spans: list[list[KVCacheBlock]]) -> int:
        """A new lease holding the pins of `spans` (0, and no lease, when empty)."""
        if not spans:
            return 0
        lease = self._next_lease
        self._next_lease += 1
        session.add_lease(lease, [block for span in spans for block in span])
        return lease

    def _blocks_reply(self, lease: int, spans: list[list[KVCacheBlock]]) -> BlocksReply:
        """The reply to a pinning request; counts the bytes served."""
        if all(len(span) == 1 for span in spans):  # one block per value: the usual case
            num_bytes = [span[0].num_bytes for span in spans]
            self.stat_served_bytes += sum(num_bytes)
            return BlocksReply(lease, [span[0].ref for span in spans], [1] * len(spans),
                               num_bytes)
        block_ids, span_lengths, num_bytes = [], [], []
        for span in spans:
            block_ids.extend(b.ref for b in span)
            span_lengths.append(len(span))
            num_bytes.append(sum(b.num_bytes for b in span))
        self.stat_served_bytes += sum(num_bytes)
        return BlocksReply(lease, block_ids, span_lengths, num_bytes)

    # ---------------------------------------------------------------- requests
    def _hello(self, session: Session, req: Hello) -> HelloReply:
        if session.greeted:
            raise RequestError("bad_request", "HELLO was already sent on this connection")
        if req.version != PROTOCOL_VERSION:
            raise RequestError(
                "version", f"protocol version {req.version}; this daemon speaks {PROTOCOL_VERSION}"
            )
        if len(req.layouts) > MAX_LAYOUTS_PER_SESSION:
            raise RequestError(
                "bad_request", f"{len(req.layouts)} layouts in one HELLO (at most "
                f"{MAX_LAYOUTS_PER_SESSION})"
            )
        if len(set(req.layouts)) != len(req.layouts):
            raise RequestError("bad_request", "the same layout twice in one HELLO")
        self._check_namespace_room(req.layouts)
        namespaces = []
        try:
            for layout in req.layouts:
                namespaces.append(self._register_layout(layout))
        except RequestError:
            for ns in namespaces:  # registered for this HELLO alone
                self._free_namespace_if_unused(ns)
            raise
        for ns in namespaces:
            self._ns_sessions[ns] = self._ns_sessions.get(ns, 0) + 1
        session.greeted = True
        session.name = req.name[:128]
        session.namespaces = namespaces
        session.record_bytes = {ns: layout.record_bytes for ns, layout in
                                zip(namespaces, req.layouts) if layout.fmt != "kv"}
        session.devices = list(req.devices)
        session.readable = self.tiers.readable_for(session.devices)
        return HelloReply(
            session.session_id,
            self.config.name,
            self.arena.generation,
            self.arena.block_bytes,
            self.arena.num_blocks,
            self.arena.capacity_bytes,
            namespaces,
            os.getpid(),
            self.tiers.infos(),
        )

    def _register_layout(self, layout: Layout) -> int:
        # The schema (protocol.Layout) has already checked every field's range.
        if self.pool is None:
            block_bytes = self.config.block_bytes or self._block_bytes_for(layout)
            try:
                self.arena.set_block_bytes(block_bytes)
            except ValueError as exc:
                raise RequestError("too_large", str(exc)) from None
            self._make_pool()
            logger.info(
                "first layout (%s, chunk record %d bytes) set block_bytes=%d: %d blocks",
                layout.model_name, layout.record_bytes, block_bytes, self.arena.num_blocks,
            )
        if layout.record_bytes > self.arena.num_blocks * self.arena.block_bytes:
            raise RequestError(
                "too_large",
                f"a chunk record of {layout.record_bytes} bytes does not fit in the arena",
            )
        layout = _namespace_layout(layout)
        ns = self.namespaces.get(layout)
        if ns is None:
            if self._free_ns_ids:
                ns = heapq.heappop(self._free_ns_ids)
            else:
                ns = self._next_ns
                self._next_ns += 1
            self.namespaces[layout] = ns
            self._ns_layout[ns] = layout
            self._ns_prefix[ns] = keys.chunk_prefix(ns)
            self.stat_ns_hits[ns] = 0
            self.stat_ns_misses[ns] = 0
            if self.l2 is not None:
                self.l2.register_namespace(ns, layout)
        return ns

    def _check_namespace_room(self, layouts: list[Layout]) -> None:
        """Refuse a HELLO whose new layouts would take the namespaces alive over
        MAX_NAMESPACES (before any is registered)."""
        new = {_namespace_layout(layout) for layout in layouts} - self.namespaces.keys()
        if len(self.namespaces) + len(new) > MAX_NAMESPACES:
            raise RequestError(
                "max_namespaces", f"this HELLO's {len(new)} new layout(s) would take the "
                f"daemon over {MAX_NAMESPACES} namespaces, each used by an open session or "
                f"a cached value ({len(self.namespaces)} now): close the sessions of layouts "
                "no longer served, evict their chunks (lmcached clear), or run one daemon "
                "per model (lmcached@NAME)"
            )

    def _end_namespaces(self, session: Session) -> None:
        """An ended session no longer uses its namespaces: free those nothing else uses."""
        for ns in session.namespaces:
            left = self._ns_sessions[ns] - 1
            if left:
                self._ns_sessions[ns] = left
            else:
                del self._ns_sessions[ns]
                self._free_namespace_if_unused(ns)

    def _namespace_emptied(self, tag: bytes) -> None:
        """`BlockPool.on_group_empty`: a pool's last value of a namespace left it."""
        ns = int.from_bytes(tag, "little")
        if ns in self._ns_layout:
            self._free_namespace_if_unused(ns)

    def _free_namespace_if_unused(self, ns: int) -> None:
        """Free namespace `ns` when no open session and no cached value (any tier) uses
        it: its id may then be given to another layout, which can never find a value of
        this one (none is left, and the L2 tier drops the fetches still in flight for it,
        `L2Tier.unregister_namespace`). Its hit and miss counts go to
        `stat_freed_namespaces`."""
        if ns in self._ns_sessions:
            return
        tag = keys.namespace_tag(ns)
        if any(pool is not None and tag in pool.num_values_by_group for pool in self.tiers.pools):
            return
        layout = self._ns_layout.pop(ns)
        del self.namespaces[layout]
        del self._ns_prefix[ns]
        hits, misses = self.stat_ns_hits.pop(ns), self.stat_ns_misses.pop(ns)
        freed = self.stat_freed_namespaces
        freed["namespaces"] += 1
        freed["hit_chunks"] += hits
        freed["miss_chunks"] += misses
        freed["hit_tokens"] += hits * layout.chunk_size
        freed["miss_tokens"] += misses * layout.chunk_size
        if self.l2 is not None:
            self.l2.unregister_namespace(ns)
        heapq.heappush(self._free_ns_ids, ns)
        logger.debug("namespace %d (%s) freed: no session and no cached value uses it", ns,
                     layout.model_name)

    def _block_bytes_for(self, layout: Layout) -> int:
        """Block size derived from the first layout when `--block-size` is unset: its
        record size rounded up to BLOCK_ALIGN_BYTES, but never so large that the arena
        has fewer than MIN_DERIVED_BLOCKS blocks (a larger record then spans several
        blocks), so that no client can shrink the usable arena for the others, and never
        so small that it has more than MAX_DERIVED_BLOCKS blocks or blocks below
        MIN_BLOCK_BYTES (a smaller record then leaves the rest of its block unused), so
        that no client can make every walk over the cached values long."""
        wanted = -(-layout.record_bytes // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES
        usable = self.arena.capacity_bytes - HEADER_BYTES
        ceiling = usable // MIN_DERIVED_BLOCKS // BLOCK_ALIGN_BYTES * BLOCK_ALIGN_BYTES
        floor = -(-usable // (MAX_DERIVED_BLOCKS * BLOCK_ALIGN_BYTES)) * BLOCK_ALIGN_BYTES
        return max(MIN_BLOCK_BYTES, floor, min(wanted, ceiling))

    def _fetch_rest(self, req: Lookup | Acquire, per_namespace: list[list[bytes]],
                    num_chunks: int) -> Deferred | None:
        """Start (or join) an L2 fetch of the chunks after the arena's `num_chunks`; a
        Deferred when the request is to wait for it (docs/l2.md). A new fetch pins the
        arena's part of the chain until it ends, so that installing the rest never
        evicts it."""
        if self.l2 is None or self._resuming or num_chunks * HASH_BYTES >= len(req.hashes):
            return None
        cached = self.pool.cached
        # The host arena's part of the prefix is pinned while the rest is installed; a
        # part on a device tier cannot be evicted by host allocations, and is not pinned.
        job = self.l2.start_fetch(
            self.pool, req.namespaces, [self._ns_prefix[ns] for ns in req.namespaces],
            req.hashes, num_chunks,
            lambda: [b for chunk_keys in per_namespace for key in chunk_keys[:num_chunks]
                     if key in cached for b in cached[key]])
        if job is None or not self.l2.fetch_wait_s:
            return None
        return Deferred(req, job, time.monotonic() + self.l2.fetch_wait_s)

    def _lookup(self, session: Session, req: Lookup) -> LookupReply | Deferred:
        per_namespace = self._chunk_keys_per_namespace(session, req.namespaces, req.hashes)
        self._require_pool()
        if not self._resuming:
            self.stat_lookups += 1
        num_chunks = len(per_namespace[0])
        readable = session.readable
        for chunk_keys in per_namespace:
            num_chunks = self.tiers.ready_prefix(chunk_keys[:num_chunks], readable)
            if num_chunks == 0:
                break
        return self._fetch_rest(req, per_namespace, num_chunks) or LookupReply(num_chunks)

    def _acquire(self, session: Session, req: Acquire) -> BlocksReply | Deferred:
        per_namespace = self._chunk_keys_per_namespace(session, req.namespaces, req.hashes)
        pool = self._require_pool()
        tiers, readable = self.tiers, session.readable
        num_chunks = len(per_namespace[0])
        if len(per_namespace) > 1 or self.l2 is not None:  # the prefix READY everywhere
            for chunk_keys in per_namespace:
                num_chunks = tiers.ready_prefix(chunk_keys[:num_chunks], readable)
            deferred = self._fetch_rest(req, per_namespace, num_chunks)
            if deferred is not None:
                return deferred
        num_chunks = self._pinnable_prefix(session, req.namespaces, per_namespace, num_chunks)
        spans = []
        for ns, chunk_keys in zip(req.namespaces, per_namespace):
            found = tiers.acquire_prefix(chunk_keys[:num_chunks], readable)
            spans.extend(found)
            pool.stat_misses += len(chunk_keys) - num_chunks
            self.stat_ns_hits[ns] += len(found)
            self.stat_ns_misses[ns] += len(chunk_keys) - len(found)
        return self._blocks_reply(self._lease(session, spans), spans)

    def _release(self, session: Session, req: Release) -> None:
        blocks = session.take_leases(req.leases)
        if blocks is None:
            raise RequestError("not_owner", f"RELEASE of leases this session does not hold "
                               f"({req.leases[:8]}{'...' if len(req.leases) > 8 else ''})")
        if blocks:
            self.tiers.free(blocks)
        return None

    def _alloc(self, session: Session, req: Alloc) -> AllocReply:
        keys = self._chunk_keys(session, req.ns, req.hashes)
        self._require_pool()
        if len(req.num_bytes) != len(keys) or any(n < 1 for n in req.num_bytes):
            raise RequestError("bad_request", "ALLOC needs one positive num_bytes per hash")
        if keys:
            self._check_value_sizes(session, req.ns, req.num_bytes)
        device_pool = self._device_pool(session, req) if req.tier else None
        tiers, readable = self.tiers, session.readable
        if readable == (0,):  # host only: the pool's own methods, no per-chunk dispatch
            find, touch, free = self.pool.cached.get, self.pool.touch, self.pool.free
        else:
            find, touch, free = (lambda key: tiers.find(key, readable)), tiers.touch, tiers.free
        status, block_ids, span_lengths = [], [], []
        held = []  # existing values pinned for the duration, so this ALLOC cannot evict them
        no_space = False
        for key, num_bytes in zip(keys, req.num_bytes):
            span = find(key)
            if span is not None:
                touch(span)
                held.extend(span)
                status.append(EXISTS)
                continue
            blocks = None if no_space else self._allocate_value(
                session, key, num_bytes, False, device_pool)
            if blocks is None:
                no_space = True
                status.append(NOSPACE)
                continue
            status.append(ALLOCATED)
            block_ids.extend(b.ref for b in blocks)
            span_lengths.append(len(blocks))
        if held:
            free(held)
        if device_pool is not None:
            self._make_room(device_pool, block_ids, span_lengths)
        return AllocReply(status, block_ids, span_lengths)

    def _make_room(self, device_pool: BlockPool, refs: list[int], span_lengths: list[int]) -> None:
        """After an ALLOC for a device tier: when some of its one-block chunks found no
        empty device block (and went to the host arena), demote enough for a store of
        this size, so that the tier keeps the newest chunks."""
        one_block, overflow, pos = 0, 0, 0
        for length in span_lengths:
            if length == 1:
                one_block += 1
                overflow += not tier_of(refs[pos])
            pos += length
        self.demoter.plan({device_pool.tier_id: one_block} if overflow else None)

    def _device_pool(self, session: Session, req: Alloc) -> BlockPool | None:
        """The pool of ALLOC's preferred device tier, or None when its chunks go to the
        host arena (a failed or unusable tier, or a format a device tier does not hold).

        Raises:
            RequestError: `bad_tier`, the tier is not one of the session's devices.
        """
        tier = self.tiers.device_tier(req.tier)
        if tier is None or tier.device not in session.devices:
            raise RequestError(
                "bad_tier", f"ALLOC for tier {req.tier}, which is not a device tier of this "
                f"session (HELLO devices {session.devices})"
            )
        layout = next(layout for layout, ns in self.namespaces.items() if ns == req.ns)
        if tier.failed or tier.pool is None or layout.fmt not in DEVICE_TIER_FORMATS:
            return None
        return tier.pool

    def _commit(self, session: Session, req: Commit) -> Ok:
        values = session.take_pending(req.block_ids)
        if values is None:
            if self._forget_expired(session, req.block_ids):
                raise RequestError(
                    "expired", f"COMMIT of blocks allocated more than "
                    f"{self.config.writing_timeout_s:g} s ago: the daemon aborted them "
                    "(--writing-timeout); these chunks were not stored"
                )
            raise RequestError("not_owner", "COMMIT of blocks this session did not allocate")
        if len(self.tiers.tiers) > 1 and any(v.tier_id for v in values):
            self._commit_device([v for v in values if v.tier_id])
            values = [v for v in values if not v.tier_id]
        pool = self.pool
        for replace in (False, True):
            group = [v for v in values if v.replace == replace]
            if not group:
                continue
            indexed = pool.commit_many([v.blocks for v in group], [v.key for v in group], replace)
            committed = []
            for value, ok in zip(group, indexed):
                if ok:
                    committed.extend(value.blocks)
                    self.stat_stored_bytes += sum(b.num_bytes for b in value.blocks)
                else:  # another session committed the same chunk first
                    pool.abort(value.blocks)
            self.stat_stores += sum(indexed)
            if self.l2 is not None and not replace:
                self.l2.write_through(pool, [(v.key, v.blocks) for v, ok in zip(group, indexed)
                                             if ok])
            if committed:
                pool.free(committed)  # the writer's reference; tail first
        return Ok()

    def _commit_device(self, values: list[PendingValue]) -> None:
        """COMMIT of chunks written to device tiers (first writer wins per tier)."""
        pools = self.tiers.pools
        for value in values:
            pool = pools[value.tier_id]
            if pool.commit_many([value.blocks], [value.key])[0]:
                self.stat_stores += 1
                self.stat_stored_bytes += sum(b.num_bytes for b in value.blocks)
                pool.free(value.blocks)
            else:
                pool.abort(value.blocks)
        self.demoter.plan()

    def _abort(self, session: Session, req: Abort) -> Ok:
        values = session.take_pending(req.block_ids)
        if values is None:
            if self._forget_expired(session, req.block_ids):
                return Ok()  # what the timeout left is aborted now: as asked
            raise RequestError("not_owner", "ABORT of blocks this session did not allocate")
        for value in values:
            self.tiers.abort(value.blocks)
        return Ok()

    def _forget_expired(self, session: Session, refs: list[int]) -> bool:
        """For a COMMIT or ABORT that names blocks `expire_writing` aborted: abort the
        values it names that are still WRITING (their writer gave them up with the
        rest), forget the expired refs, and return True. False (nothing changed) when it
        names no expired block and some block the session is not writing: `not_owner`."""
        expired = session.expired
        if not expired or not any(ref in expired for ref in refs):
            return False
        pending = [ref for ref in refs if ref in session.writing]
        for value in session.take_pending(pending) or ():
            self.tiers.abort(value.blocks)
        expired.difference_update(refs)
        return True

    def _put(self, session: Session, req: Put) -> AllocReply:
        key = self._string_key(session, req.ns, req.key)
        if req.num_bytes < 1:
            raise RequestError("bad_request", "PUT needs num_bytes >= 1")
        self._require_pool()
        if req.num_bytes > self._max_value_bytes():
            raise RequestError(
                "bad_request", f"PUT of a {req.num_bytes}-byte value: a value is at most "
                f"{self._max_value_bytes()} bytes (--max-session-share "
                f"{self.config.max_session_share:g}% of the arena)"
            )
        blocks = self._allocate_value(session, key, req.num_bytes, True)
        if blocks is None:
            return AllocReply([NOSPACE], [], [])
        return AllocReply([ALLOCATED], [b.ref for b in blocks], [len(blocks)])

    def _get(self, session: Session, req: Get) -> BlocksReply:
        key = self._string_key(session, req.ns, req.key)
        pool = self._require_pool()
        span = pool.cached.get(key)
        if span is not None and session.num_new_host_blocks(span) > self._session_room(session):
            pool.stat_misses += 1  # this session holds its share: a miss for it alone
            spans = []
        else:
            spans = pool.acquire_prefix([key])
        self.stat_ns_hits[req.ns] += len(spans)
        self.stat_ns_misses[req.ns] += 1 - len(spans)
        return self._blocks_reply(self._lease(session, spans), spans)

    def _invalidate(self, session: Session, req: Invalidate) -> None:
        """Drop the chunks a reader found corrupt, each only while the index still maps
        it to the block the reader read (counted: INFO invalidated_chunks). Any session
        may: any session can already overwrite those bytes. Pinned blocks keep their
        bytes for their readers (detached) until released."""
        chunk_keys = self._chunk_keys(session, req.ns, req.hashes)
        if len(req.block_ids) != len(chunk_keys):
            raise RequestError("bad_request", f"INVALIDATE of {len(chunk_keys)} hashes needs "
                               f"as many block ids, got {len(req.block_ids)}")
        self._require_pool()
        pools = self.tiers.pools
        for key, ref in zip(chunk_keys, req.block_ids):
            tier_id = tier_of(ref)
            pool = pools[tier_id] if 0 <= tier_id < len(pools) else None
            span = pool.cached.get(key) if pool is not None else None
            if span is not None and span[0].ref == ref and pool.evict(key):
                self.stat_invalidated += 1
        return None

    def _delete(self, session: Session, req: Delete) -> CountReply:
        key = self._string_key(session, req.ns, req.key)
        return CountReply(int(self._require_pool().evict(key)))

    def _scan(self, session: Session, req: Scan) -> KeysReply:
        """One page of a SCAN (after Redis's SCAN): walk at most `count` host blocks from
        block `cursor` on, and list the string keys of `req.ns` starting with
        `req.prefix` whose value begins in them, stopping early at `limit` keys.

        The cursor is a block id: blocks never move, so a value cached for the whole
        scan begins in one block and is listed exactly once, whatever is stored or
        evicted meanwhile. String keys live in the host arena only (device tiers hold
        KV chunks). Priced by the blocks walked (`work_units`).

        Returns:
            The keys found and the next page's cursor (0: the walk reached the last
            block).
        """
        self._check_namespace(session, req.ns)
        pool = self.pool
        limit = min(req.limit, MAX_SCAN_KEYS)
        if pool is None or limit <= 0 or req.cursor >= pool.num_blocks:
            return KeysReply([], 0)
        ns_prefix = keys.string_prefix(req.ns)
        prefix = ns_prefix + req.prefix.encode()
        start = req.cursor
        end = min(pool.num_blocks, start + min(req.count or SCAN_DEFAULT_COUNT, MAX_SCAN_COUNT))
        names = []
        position = start
        for block in pool.blocks[start:end]:
            position += 1
            key = block.block_hash  # not None: READY and indexed
            if key is not None and key.startswith(prefix) and block.span[0] is block:
                names.append(key[len(ns_prefix) :].decode())
                if len(names) >= limit:
                    break
        self.work_units = 1 + (position - start) // SCAN_BLOCKS_PER_UNIT
        return KeysReply(names, position if position < pool.num_blocks else 0)

    # ------------------------------------------------------------------- admin
    def _ping(self, session: Session, req: Ping) -> Ok:
        return Ok()

    def _shutdown(self, session: Session, req: Shutdown) -> Ok:
        logger.info("SHUTDOWN requested by session %d (pid %d)", session.session_id, session.pid)
        self.stop_requested = True
        return Ok()

    def _config_get(self, session: Session, req: ConfigGet) -> InfoReply:
        return InfoReply({"config": self.config.as_dict()})

    def _evict(self, session: Session, req: Evict) -> CountReply:
        if self.pool is None:
            return CountReply(0)
        if req.key is not None:
            named = keys.keys_named(self._ns_prefix, req.key)
            return CountReply(sum(self.tiers.evict(key) for key in named))
        if req.lru < 0:
            raise RequestError("bad_request", "EVICT needs lru >= 0")
        return CountReply(self.pool.evict_lru(req.lru))

    def _clear(self, session: Session, req: Clear) -> CountReply:
        return CountReply(self.tiers.clear() if self.pool is not None else 0)

    def _open_tier(self, session: Session, req: OpenTier) -> TierHandle:
        tier = self.tiers.device_tier(req.tier_id)
        if tier is None or tier.device not in session.devices:
            raise RequestError(
                "bad_tier", f"OPEN_TIER of tier {req.tier_id}: not a device tier of this "
                f"session (HELLO devices {session.devices}; the daemon has "
                f"{[t.device for t in self.tiers.device_tiers]})"
            )
        if tier.tier_id in session.opened_tiers:
            # Once per session: every descriptor in flight on a Unix socket counts against
            # the daemon's open-file limit until the peer reads it (unix(7), ETOOMANYREFS),
            # so a client that asks again and again without reading cannot exhaust it.
            raise RequestError("bad_request", f"tier {tier.tier_id} was already opened on "
                               "this connection: map the descriptor you were sent")
        session.opened_tiers.add(tier.tier_id)
        session.reply_fds = [tier.memory.export_fd()]  # the server sends it with the reply
        return TierHandle(tier.tier_id, self.arena.generation, tier.kind, tier.device,
                          tier.size_bytes)

    def _clients(self, session: Session, req: Clients) -> ClientsReply:
        """One page of CLIENTS: at most MAX_CLIENTS_PER_PAGE sessions (or `req.count`)
        from session id `req.cursor` on, in id order; priced per row (`work_units`).

        Returns:
            Their rows and the next page's cursor: the id after the last row's, or 0
            when no session follows.
        """
        sessions = self.sessions  # in id order: ids grow, a dict keeps insertion order
        ids = list(sessions)
        first = bisect.bisect_left(ids, req.cursor)
        count = min(req.count or MAX_CLIENTS_PER_PAGE, MAX_CLIENTS_PER_PAGE)
        page = ids[first : first + count]
        self.work_units = max(1, CLIENT_ROW_UNITS * len(page))
        more = first + count < len(ids)
        return ClientsReply(client_rows(sessions[i] for i in page),
                            page[-1] + 1 if more else 0)

    def _info(self, session: Session, req: Info) -> InfoReply:
        sections = info_sections(self)
        if req.section is not None:
            name = req.section.lower()
            if name not in sections:
                raise RequestError(
                    "bad_request", f"no INFO section {req.section!r}; sections: "
                    f"{', '.join(INFO_SECTIONS)}"
                )
            sections = {name: sections[name]}
        return InfoReply(sections)
