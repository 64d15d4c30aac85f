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

from lmcached.daemon import events
from lmcached.daemon.admin_handlers import AdminHandlers
from lmcached.daemon.namespaces import hello
from lmcached.daemon.value_handlers import ValueHandlers
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
        handler: `handler(service, session, request)` -> the reply Struct, None (a
            request without reply) or a `replies.Deferred`; raises `RequestError` to
            refuse. `service` is the `CacheService`.
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
    _command(Lookup, ValueHandlers._lookup, waits_for_fetch=True),
    _command(Acquire, ValueHandlers._acquire, waits_for_fetch=True),
    _command(Release, ValueHandlers._release),
    _command(Alloc, ValueHandlers._alloc),
    _command(Commit, ValueHandlers._commit),
    _command(Abort, ValueHandlers._abort),
    _command(Invalidate, ValueHandlers._invalidate),
    _command(Put, ValueHandlers._put),
    _command(Get, ValueHandlers._get),
    _command(Delete, ValueHandlers._delete),
    # Admin requests (admin_handlers.py). SCAN and CLIENTS are priced by their work.
    _command(Scan, AdminHandlers._scan),
    _command(OpenTier, AdminHandlers._open_tier),
    _command(Info, AdminHandlers._info, cost=8, while_loading=True, before_hello=True),
    _command(Clients, AdminHandlers._clients, while_loading=True, before_hello=True),
    _command(ConfigGet, AdminHandlers._config_get, while_loading=True, before_hello=True),
    _command(Ping, AdminHandlers._ping, before_hello=True),
    # The chunk event feed (events.py), read by engines and `lmcached events`.
    _command(Subscribe, events.subscribe, before_hello=True),
    _command(Events, events.events, before_hello=True),
    _command(Evict, AdminHandlers._evict, privileged=True, before_hello=True),
    _command(Clear, AdminHandlers._clear, privileged=True, before_hello=True),
    _command(Shutdown, AdminHandlers._shutdown, privileged=True, while_loading=True,
             before_hello=True),
)

# The table by request type: what the dispatch looks up, once per request.
COMMANDS: dict[type, Command] = {command.request_type: command for command in COMMAND_TABLE}
