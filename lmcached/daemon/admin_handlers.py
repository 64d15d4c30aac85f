"""The daemon's admin requests: SCAN, PING, SHUTDOWN, CONFIG GET, EVICT, CLEAR, OPEN_TIER,
CLIENTS, INFO.

Why this file exists: these answer operators and tools (after Redis's admin commands);
the ones that walk many blocks or sessions are paged and priced by their work
(`work_units`). Each handler is a function `handler(state, session, request)` of the
command table (`commands.py`) over the daemon state it reads and changes (`AdminState`).
"""

import bisect
import os
from typing import TYPE_CHECKING, Protocol

from lmcached.daemon import keys
from lmcached.daemon import request_checks as checks
from lmcached.daemon.info import (
    INFO_SECTIONS,
    DaemonState,
    client_rows,
    info_sections,
    own_tenant_fields,
)
from lmcached.wire.protocol import (
    Clear,
    Clients,
    ClientsReply,
    ConfigGet,
    CountReply,
    Evict,
    Info,
    InfoReply,
    KeysReply,
    Ok,
    OpenTier,
    Ping,
    Scan,
    Shutdown,
    TierHandle,
)
from lmcached.daemon.session import Session
from lmcached.daemon.replies import RequestError
from lmcached.wire.logger import init_logger

if TYPE_CHECKING:  # named for the AdminState protocol only (no import at run time)
    from lmcached.daemon.namespaces import NamespaceRegistry

logger = init_logger(__name__)

MAX_SCAN_KEYS = 10_000  # keeps a SCAN reply far below the frame limit
# A request's price in the server's per-pass budget (connection.py, PASS_BUDGET) follows
# the work it costs the loop: a SCAN page walks blocks (~80 ns each here), a CLIENTS
# row reads /proc twice (psutil, ~60 us here); one unit is about an ordinary request.
SCAN_DEFAULT_COUNT = 1024  # blocks a SCAN page walks when it names no count
MAX_SCAN_COUNT = 4096  # blocks a SCAN page walks at most (~0.3 ms)
SCAN_BLOCKS_PER_UNIT = 256
MAX_CLIENTS_PER_PAGE = 16  # sessions a CLIENTS page lists at most (~1 ms)
CLIENT_ROW_UNITS = 2


class AdminState(DaemonState, Protocol):
    """The daemon state the admin handlers read and change: the `CacheService`
    (service.py; see it for each attribute), what INFO reads (`info.DaemonState`) and
    these."""

    ns_registry: "NamespaceRegistry"
    stop_requested: bool
    work_units: int


def scan(state: AdminState, session: Session, req: Scan) -> KeysReply:
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
    checks.check_namespace(session, req.ns)
    pool = state.pool
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
    state.work_units = 1 + (position - start) // SCAN_BLOCKS_PER_UNIT
    return KeysReply(names, position if position < pool.num_blocks else 0)


def ping(state: AdminState, session: Session, req: Ping) -> Ok:
    return Ok()


def shutdown(state: AdminState, session: Session, req: Shutdown) -> Ok:
    logger.info("SHUTDOWN requested by session %d (pid %d)", session.session_id, session.pid)
    state.stop_requested = True
    return Ok()


def config_get(state: AdminState, session: Session, req: ConfigGet) -> InfoReply:
    return InfoReply({"config": state.config.as_dict()})


def evict(state: AdminState, session: Session, req: Evict) -> CountReply:
    if state.pool is None:
        return CountReply(0)
    if req.key is not None:
        named = keys.keys_named(state.ns_registry.prefixes, req.key)
        return CountReply(sum(state.tiers.evict(key) | any([tier.evict(key)
                                                           for tier in state.spill_tiers])
                              for key in named))
    if req.lru < 0:
        raise RequestError("bad_request", "EVICT needs lru >= 0")
    return CountReply(state.pool.evict_lru(req.lru))


def clear(state: AdminState, session: Session, req: Clear) -> CountReply:
    """Remove every value from every tier (docs/operator.md, "CLEAR"): the disk
    tier's index and slots, L2 by its clear generation (lmcached/daemon/l2/tier.py,
    `L2Tier.clear`; in the background), then every block pool, pinned values too
    (their readers keep their bytes). The pool's clear advances its
    `clear_generation`, so that no fetch started before installs after; the tiers
    go first, so that the chains their fetches pin are unpinned by then.

    Returns:
        The values removed from the arena and device tiers plus the chunks the disk
        tier forgot (L2's are not counted: INFO l2_generation, l2_clear_pending).
    """
    num_values = sum(tier.clear() for tier in state.spill_tiers)
    if state.pool is not None:
        num_values += state.tiers.clear()
    return CountReply(num_values)


def open_tier(state: AdminState, session: Session, req: OpenTier) -> TierHandle:
    tier = state.tiers.device_tier(req.tier_id)
    if tier is None or tier.device not in session.devices:
        raise RequestError(
            "bad_tier", f"OPEN_TIER of tier {req.tier_id}: not a device tier of this "
            f"session (HELLO devices {session.devices}; the daemon has "
            f"{[t.device for t in state.tiers.device_tiers]})"
        )
    if tier.tier_id in session.opened_tiers:
        # Once per session: every descriptor in flight on a Unix socket counts against
        # the daemon's open-file limit until the peer reads it (unix(7), ETOOMANYREFS),
        # so a client that asks again and again without reading cannot exhaust it.
        raise RequestError("bad_request", f"tier {tier.tier_id} was already opened on "
                           "this connection: map the descriptor you were sent")
    session.opened_tiers.add(tier.tier_id)
    session.reply_fds = [tier.memory.export_fd()]  # the server sends it with the reply
    return TierHandle(tier.tier_id, state.arena.generation, tier.kind, tier.device,
                      tier.size_bytes)


def clients(state: AdminState, session: Session, req: Clients) -> ClientsReply:
    """One page of CLIENTS: at most MAX_CLIENTS_PER_PAGE sessions (or `req.count`)
    from session id `req.cursor` on, in id order; priced per row (`work_units`).

    Returns:
        Their rows and the next page's cursor: the id after the last row's, or 0
        when no session follows.
    """
    sessions = state.sessions  # in id order: ids grow, a dict keeps insertion order
    ids = list(sessions)
    first = bisect.bisect_left(ids, req.cursor)
    count = min(req.count or MAX_CLIENTS_PER_PAGE, MAX_CLIENTS_PER_PAGE)
    page = ids[first : first + count]
    state.work_units = max(1, CLIENT_ROW_UNITS * len(page))
    more = first + count < len(ids)
    return ClientsReply(client_rows(sessions[i] for i in page),
                        page[-1] + 1 if more else 0)


def info(state: AdminState, session: Session, req: Info) -> InfoReply:
    """INFO; the `tenants` section shows a session outside the daemon's uid (and
    root) only the rows of the fingerprints it sent itself: one tenant's client
    never reads another's counts, nor learns its fingerprint."""
    sections = info_sections(state)
    if session.uid not in (0, os.geteuid()):
        sections["tenants"] = own_tenant_fields(sections["tenants"], session.tenants)
    if req.section is not None:
        name = req.section.lower()
        if name not in sections:
            raise RequestError(
                "bad_request", f"no INFO section {req.section!r}; sections: "
                f"{', '.join(INFO_SECTIONS)}"
            )
        sections = {name: sections[name]}
    return InfoReply(sections)
