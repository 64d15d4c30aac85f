"""The daemon's command table: one row per request type, after Redis's `redisCommandTable`.

Why this file exists: everything the daemon knows about a request type as such (its
handler, who may send it, what it costs in the server's per-pass budget, whether it is
answered, while loading, before HELLO) is written here once, one row per request Struct
of the wire protocol (`lmcached.wire.protocol.Request`). The service's dispatch and its
privilege, loading and HELLO checks (`service.py`), the per-pass budget
(`connection.py`) and the request latency metrics (`stats.RequestLatency`) read this
table; no other module lists request types for these facts.

Whether a request is answered is a fact of the wire contract that the client needs too
(`wire.protocol.NO_REPLY_REQUESTS`, the client does not wait for a reply): the table
reads it from there rather than writing it a second time.
"""

import dataclasses
from collections.abc import Callable

from lmcached.daemon import admin_handlers, event_handlers, value_handlers
from lmcached.daemon.namespaces import hello
from lmcached.wire.protocol import (
    NO_REPLY_REQUESTS,
    Abort,
    Acquire,
    Alloc,
    Clear,
    Clients,
    Commit,
    ConfigGet,
    Delete,
    Events,
    Evict,
    Get,
    Hello,
    Info,
    Invalidate,
    Lookup,
    OpenTier,
    Ping,
    Put,
    Release,
    Scan,
    Shutdown,
    Subscribe,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    """One row of the command table: a request type and how the daemon serves it.

    Attributes:
        request_type: the request Struct (`lmcached.wire.protocol`).
        handler: `handler(state, session, request)` -> the reply Struct, None (a
            request without reply) or a `replies.Deferred`; raises `RequestError` to
            refuse. A function of its module (`value_handlers`, `admin_handlers`,
            `namespaces`, `event_handlers`) over the daemon state, the `CacheService`, whose
            parts the module names in its state protocol (`ValueState`, ...).
        name: the request's wire tag ("lookup", "config_get"): its label in the request
            latency metrics and in the frame of a malformed request.
        privileged: served to the daemon's uid and root only (SO_PEERCRED); any other
            peer is refused with `forbidden`: it changes or stops the cache for everyone.
        cost: units of the server's per-pass budget (`connection.PASS_BUDGET`) the
            request costs; a handler that prices it by its work (SCAN, CLIENTS) sets
            `CacheService.work_units` instead.
        replies: False for a request the daemon never answers, even to refuse it (its
            refusal is counted and logged): `wire.protocol.NO_REPLY_REQUESTS`.
        while_loading: answered while the daemon loads (the disk tier's index rebuilt,
            the arena prefaulted); the others are refused with `loading` and its progress
            (after Redis's -LOADING), PING and HELLO included.
        before_hello: answered on a connection that has not sent HELLO (admin tools);
            the others are refused with `no_session`.
        waits_for_fetch: its handler may answer a `Deferred` (a fetch from the disk tier
            or L2 to wait for), and `CacheService.resume` answers it later by calling the
            handler again with `resumed=True`.
    """

    request_type: type
    handler: Callable
    name: str
    privileged: bool
    cost: int
    replies: bool
    while_loading: bool
    before_hello: bool
    waits_for_fetch: bool


def _command(request_type: type, handler: Callable, *, privileged: bool = False,
             cost: int = 1, while_loading: bool = False, before_hello: bool = False,
             waits_for_fetch: bool = False) -> Command:
    """A row; its name and reply kind come from the wire protocol."""
    return Command(request_type, handler, request_type.__struct_config__.tag, privileged,
                   cost, request_type not in NO_REPLY_REQUESTS, while_loading, before_hello,
                   waits_for_fetch)


COMMAND_TABLE: tuple[Command, ...] = (
    # Sessions and the data path (namespaces.py, value_handlers.py).
    _command(Hello, hello, before_hello=True),
    _command(Lookup, value_handlers.lookup, waits_for_fetch=True),
    _command(Acquire, value_handlers.acquire, waits_for_fetch=True),
    _command(Release, value_handlers.release),
    _command(Alloc, value_handlers.alloc),
    _command(Commit, value_handlers.commit),
    _command(Abort, value_handlers.abort),
    _command(Invalidate, value_handlers.invalidate),
    _command(Put, value_handlers.put),
    _command(Get, value_handlers.get),
    _command(Delete, value_handlers.delete),
    # Admin requests (admin_handlers.py). SCAN and CLIENTS are priced by their work.
    _command(Scan, admin_handlers.scan),
    _command(OpenTier, admin_handlers.open_tier),
    _command(Info, admin_handlers.info, cost=8, while_loading=True, before_hello=True),
    _command(Clients, admin_handlers.clients, while_loading=True, before_hello=True),
    _command(ConfigGet, admin_handlers.config_get, while_loading=True, before_hello=True),
    _command(Ping, admin_handlers.ping, before_hello=True),
    # The chunk event feed (events.py; its requests: event_handlers.py), read by engines
    # and `lmcached events`.
    _command(Subscribe, event_handlers.subscribe, before_hello=True),
    _command(Events, event_handlers.events, before_hello=True),
    _command(Evict, admin_handlers.evict, privileged=True, before_hello=True),
    _command(Clear, admin_handlers.clear, privileged=True, before_hello=True),
    _command(Shutdown, admin_handlers.shutdown, privileged=True, while_loading=True,
             before_hello=True),
)

# The table by request type: what the dispatch looks up, once per request.
COMMANDS: dict[type, Command] = {command.request_type: command for command in COMMAND_TABLE}
