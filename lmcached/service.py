"""Request semantics of the daemon: one method per request type, no sockets.

Why this file exists: it is everything the daemon decides, separated from how bytes
arrive (`server.py`), so that the semantics of DESIGN.md's protocol table can be read
and tested in one place. Each handler validates its request completely before it
changes anything; a bad request gets an `Error` reply and is counted, and the daemon
goes on serving. What the keys of the block pool are is `keys.py`; the fields of INFO
and CLIENTS are built in `info.py`.
"""

import os
import time

from lmcached import keys
from lmcached.config import ServerConfig
from lmcached.info import INFO_SECTIONS, client_rows, info_sections
from lmcached.logger import init_logger
from lmcached.protocol import (
    ALLOCATED,
    EXISTS,
    HASH_BYTES,
    MAX_CHUNKS_PER_REQUEST,
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
    KeysReply,
    Layout,
    Lookup,
    LookupReply,
    Ok,
    Ping,
    Put,
    Release,
    Scan,
    Shutdown,
)
from lmcached.session import PendingValue, Session
from lmcached.shm.arena import HEADER_BYTES, Arena
from lmcached.shm.block_pool import BlockPool
from lmcached.shm.free_queue import KVCacheBlock

logger = init_logger(__name__)

BLOCK_ALIGN_BYTES = 4096  # a block size chosen from a layout is rounded up to this
MIN_DERIVED_BLOCKS = 64  # a block size derived from a layout leaves at least this many
_ADMIN_REQUESTS = (Info, Clients, Evict, Clear, Ping, Shutdown, ConfigGet)
# Requests that change or stop the cache for everyone: the daemon's uid and root only.
PRIVILEGED_REQUESTS = frozenset({Evict, Clear, Shutdown})
MAX_SCAN_KEYS = 10_000  # keeps a SCAN reply far below the frame limit


class RequestError(Exception):
    """A request the daemon refuses: becomes an `Error(code, message)` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class CacheService:
    """The daemon's state and request handlers (single-threaded: no locks).

    Args:
        config: effective configuration.
        arena: the owned arena; cut into blocks now if its block size is known, else at
            the first HELLO that carries a layout.

    Attributes:
        pool: the block pool, or None until the block size is known.
        sessions: session id -> Session.
        stop_requested: set by SHUTDOWN; the server loop then stops gracefully.
    """

    def __init__(self, config: ServerConfig, arena: Arena) -> None:
        self.config = config
        self.arena = arena
        self.pool: BlockPool | None = BlockPool(arena.num_blocks) if arena.block_bytes else None
        self.sessions: dict[int, Session] = {}
        self._next_session_id = 1
        self.namespaces: dict[Layout, int] = {}
        self._ns_prefix: dict[int, bytes] = {}
        self.started_at = time.time()
        self.stop_requested = False
        self.stat_requests = 0
        self.stat_stores = 0
        self.stat_lookups = 0
        self.stat_connections = 0
        self.stat_errors: dict[str, int] = {}
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
        }

    # ---------------------------------------------------------------- sessions
    def open_session(self, pid: int, uid: int, gid: int) -> Session:
        """Register a new connection's session."""
        session = Session(self._next_session_id, pid, uid, gid)
        self._next_session_id += 1
        self.sessions[session.session_id] = session
        self.stat_connections += 1
        return session

    def close_session(self, session: Session) -> None:
        """Release every pin and abort every pending value of an ended session."""
        if self.sessions.pop(session.session_id, None) is None:
            return
        pool = self.pool
        if pool is None:
            return
        pinned = [
            pool.blocks[block_id]
            for block_id, count in session.pins.items()
            for _ in range(count)
        ]
        if pinned:
            pool.free(pinned)
        pending = {id(v): v for v in session.writing.values()}
        for value in pending.values():
            pool.abort(value.blocks)
        if pinned or pending:
            logger.info(
                "session %d (pid %d) ended holding %d pins and %d pending values: released",
                session.session_id, session.pid, len(pinned), len(pending),
            )
        session.pins.clear()
        session.writing.clear()

    # ---------------------------------------------------------------- dispatch
    def handle(self, session: Session, request) -> object:
        """Answer one decoded request. Never raises for a client's mistake.

        PRIVILEGED_REQUESTS from a peer (SO_PEERCRED uid) other than the daemon's uid or
        root are refused with `forbidden`.

        Returns:
            The reply Struct (an `Error` for a refused request).
        """
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
            return self.error(exc.code, str(exc))
        except Exception:  # a bug in a handler: log it, answer, keep serving the others
            logger.exception("internal error handling %r", request)
            return self.error("internal", "internal error in the daemon (see its log)")

    def error(self, code: str, message: str) -> Error:
        """An Error reply, counted under its code."""
        self.stat_errors[code] = self.stat_errors.get(code, 0) + 1
        logger.debug("refused request: %s: %s", code, message)
        return Error(code, message)

    # -------------------------------------------------------------- validation
    def _check_namespace(self, session: Session, ns: int) -> None:
        """Refuse a namespace other than the one this session's HELLO registered."""
        if ns not in self._ns_prefix or ns != session.ns:
            raise RequestError(
                "bad_namespace", f"namespace {ns} is not this session's (HELLO gave {session.ns})"
            )

    def _chunk_keys(self, session: Session, ns: int, hashes: bytes) -> list[bytes]:
        """The block-pool keys of a request's chunk hashes, after validating them."""
        self._check_namespace(session, ns)
        if len(hashes) % HASH_BYTES:
            raise RequestError(
                "bad_request", f"hashes are {len(hashes)} bytes, not a multiple of {HASH_BYTES}"
            )
        if len(hashes) > MAX_CHUNKS_PER_REQUEST * HASH_BYTES:
            raise RequestError(
                "bad_request", f"more than {MAX_CHUNKS_PER_REQUEST} chunks in one request"
            )
        return keys.chunk_keys(self._ns_prefix[ns], hashes)

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

    def _allocate_value(self, session: Session, key: bytes, nbytes: int, replace: bool):
        """Allocate WRITING blocks for one value of `nbytes`; None when nothing is evictable."""
        pool = self.pool
        block_bytes = self.arena.block_bytes
        num_blocks = -(-nbytes // block_bytes)
        blocks = pool.allocate(num_blocks)
        if blocks is None:
            return None
        for block in blocks:
            block.num_bytes = block_bytes
        blocks[-1].num_bytes = nbytes - (num_blocks - 1) * block_bytes
        session.add_pending(PendingValue(key, blocks, replace))
        return blocks

    @staticmethod
    def _blocks_reply(spans: list[list[KVCacheBlock]]) -> BlocksReply:
        if all(len(span) == 1 for span in spans):  # one block per value: the usual case
            return BlocksReply([span[0].block_id for span in spans], [1] * len(spans),
                               [span[0].num_bytes for span in spans])
        block_ids, num_blocks, nbytes = [], [], []
        for span in spans:
            if len(span) == 1:
                block_ids.append(span[0].block_id)
                nbytes.append(span[0].num_bytes)
            else:
                block_ids.extend(b.block_id for b in span)
                nbytes.append(sum(b.num_bytes for b in span))
            num_blocks.append(len(span))
        return BlocksReply(block_ids, num_blocks, nbytes)

    # ---------------------------------------------------------------- requests
    def _hello(self, session: Session, req: Hello) -> HelloReply:
        if session.greeted:
            raise RequestError("bad_request", "HELLO was already sent on this connection")
        if req.version != PROTOCOL_VERSION:
            raise RequestError(
                "version", f"protocol version {req.version}; this daemon speaks {PROTOCOL_VERSION}"
            )
        ns = None
        if req.layout is not None:
            ns = self._register_layout(req.layout)
        session.greeted = True
        session.name = req.name[:128]
        session.ns = ns
        return HelloReply(
            session.session_id,
            self.config.name,
            self.arena.generation,
            self.arena.block_bytes,
            self.arena.num_blocks,
            self.arena.capacity_bytes,
            ns,
            os.getpid(),
        )

    def _register_layout(self, layout: Layout) -> int:
        for field in ("world_size", "num_layers", "num_kv_heads", "head_size", "chunk_size",
                      "chunk_bytes"):
            if getattr(layout, field) < 1:
                raise RequestError("bad_request", f"layout.{field} must be >= 1")
        if not 0 <= layout.worker_id < layout.world_size:
            raise RequestError("bad_request", "layout.worker_id must be in [0, world_size)")
        if self.pool is None:
            block_bytes = self.config.block_bytes or self._block_bytes_for(layout)
            try:
                self.arena.set_block_bytes(block_bytes)
            except ValueError as exc:
                raise RequestError("too_large", str(exc)) from None
            self.pool = BlockPool(self.arena.num_blocks)
            logger.info(
                "first layout (%s, chunk %d bytes) set block_bytes=%d: %d blocks",
                layout.model_name, layout.chunk_bytes, block_bytes, self.arena.num_blocks,
            )
        if layout.chunk_bytes > self.arena.num_blocks * self.arena.block_bytes:
            raise RequestError(
                "too_large",
                f"a chunk of {layout.chunk_bytes} bytes does not fit in the arena",
            )
        ns = self.namespaces.get(layout)
        if ns is None:
            ns = len(self.namespaces) + 1
            self.namespaces[layout] = ns
            self._ns_prefix[ns] = keys.chunk_prefix(ns)
        return ns

    def _block_bytes_for(self, layout: Layout) -> int:
        """Block size derived from the first layout when `--block-size` is unset: its
        record size rounded up to BLOCK_ALIGN_BYTES, but never so large that the arena
        has fewer than MIN_DERIVED_BLOCKS blocks (a larger record then spans several
        blocks), so that no client can shrink the usable arena for the others."""
        wanted = -(-layout.chunk_bytes // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES
        usable = self.arena.capacity_bytes - HEADER_BYTES
        ceiling = usable // MIN_DERIVED_BLOCKS // BLOCK_ALIGN_BYTES * BLOCK_ALIGN_BYTES
        return max(BLOCK_ALIGN_BYTES, min(wanted, ceiling))

    def _lookup(self, session: Session, req: Lookup) -> LookupReply:
        keys = self._chunk_keys(session, req.ns, req.hashes)
        self.stat_lookups += 1
        return LookupReply(self._require_pool().num_ready_prefix(keys))

    def _acquire(self, session: Session, req: Acquire) -> BlocksReply:
        keys = self._chunk_keys(session, req.ns, req.hashes)
        spans = self._require_pool().acquire_prefix(keys)
        for span in spans:
            session.add_pins(span)
        return self._blocks_reply(spans)

    def _release(self, session: Session, req: Release) -> Ok:
        if not session.take_pins(req.block_ids):
            raise RequestError("not_owner", "RELEASE of blocks this session did not pin")
        if req.block_ids:
            pool = self.pool
            pool.free([pool.blocks[i] for i in req.block_ids])
        return Ok()

    def _alloc(self, session: Session, req: Alloc) -> AllocReply:
        keys = self._chunk_keys(session, req.ns, req.hashes)
        pool = self._require_pool()
        if len(req.nbytes) != len(keys) or any(n < 1 for n in req.nbytes):
            raise RequestError("bad_request", "ALLOC needs one positive nbytes per hash")
        status, block_ids, num_blocks = [], [], []
        held = []  # existing values pinned for the duration, so this ALLOC cannot evict them
        no_space = False
        for key, nbytes in zip(keys, req.nbytes):
            span = pool.cached.get(key)
            if span is not None:
                pool.touch(span)
                held.extend(span)
                status.append(EXISTS)
                continue
            blocks = None if no_space else self._allocate_value(session, key, nbytes, False)
            if blocks is None:
                no_space = True
                status.append(NOSPACE)
                continue
            status.append(ALLOCATED)
            block_ids.extend(b.block_id for b in blocks)
            num_blocks.append(len(blocks))
        if held:
            pool.free(held)
        return AllocReply(status, block_ids, num_blocks)

    def _commit(self, session: Session, req: Commit) -> Ok:
        values = session.take_pending(req.block_ids)
        if values is None:
            raise RequestError("not_owner", "COMMIT of blocks this session did not allocate")
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
                else:  # another session committed the same chunk first
                    pool.abort(value.blocks)
            self.stat_stores += sum(indexed)
            if committed:
                pool.free(committed)  # the writer's reference; tail first
        return Ok()

    def _abort(self, session: Session, req: Abort) -> Ok:
        values = session.take_pending(req.block_ids)
        if values is None:
            raise RequestError("not_owner", "ABORT of blocks this session did not allocate")
        for value in values:
            self.pool.abort(value.blocks)
        return Ok()

    def _put(self, session: Session, req: Put) -> AllocReply:
        key = self._string_key(session, req.ns, req.key)
        if req.nbytes < 1:
            raise RequestError("bad_request", "PUT needs nbytes >= 1")
        self._require_pool()
        blocks = self._allocate_value(session, key, req.nbytes, True)
        if blocks is None:
            return AllocReply([NOSPACE], [], [])
        return AllocReply([ALLOCATED], [b.block_id for b in blocks], [len(blocks)])

    def _get(self, session: Session, req: Get) -> BlocksReply:
        key = self._string_key(session, req.ns, req.key)
        spans = self._require_pool().acquire_prefix([key])
        for span in spans:
            session.add_pins(span)
        return self._blocks_reply(spans)

    def _delete(self, session: Session, req: Delete) -> CountReply:
        key = self._string_key(session, req.ns, req.key)
        return CountReply(int(self._require_pool().evict(key)))

    def _scan(self, session: Session, req: Scan) -> KeysReply:
        self._check_namespace(session, req.ns)
        ns_prefix = keys.string_prefix(req.ns)
        prefix = ns_prefix + req.prefix.encode()
        limit = min(req.limit, MAX_SCAN_KEYS)
        names = []
        if self.pool is not None and limit > 0:
            for key in self.pool.cached:
                if key.startswith(prefix):
                    names.append(key[len(ns_prefix) :].decode())
                    if len(names) >= limit:
                        break
        return KeysReply(names)

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
            return CountReply(sum(self.pool.evict(key) for key in named))
        if req.lru < 0:
            raise RequestError("bad_request", "EVICT needs lru >= 0")
        return CountReply(self.pool.evict_lru(req.lru))

    def _clear(self, session: Session, req: Clear) -> CountReply:
        return CountReply(self.pool.clear() if self.pool is not None else 0)

    def _clients(self, session: Session, req: Clients) -> ClientsReply:
        return ClientsReply(client_rows(self.sessions.values()))

    def _info(self, session: Session, req: Info) -> InfoReply:
        sections = info_sections(self)
        if req.section is not None:
            name = req.section.lower()
            if name not in sections:
                raise RequestError(
                    "bad_request", f"no INFO section {req.section!r}; sections: {INFO_SECTIONS}"
                )
            sections = {name: sections[name]}
        return InfoReply(sections)
