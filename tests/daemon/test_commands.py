"""The command table (lmcached/daemon/commands.py): one row per request type of the
protocol, the only place a request type's handler, privilege, cost, reply kind, loading
and HELLO rules are written, and what the service does follows its rows.
"""

import ast
import os
import typing

import pytest

from lmcached.daemon.commands import COMMAND_TABLE, COMMANDS
from lmcached.daemon.connection import answer_frame
from lmcached.daemon.progress import Loading, PrefaultProgress
from lmcached.daemon.replies import Deferred
from lmcached.wire.frames import encode_frame
from lmcached.wire.protocol import (
    NO_REPLY_REQUESTS,
    PROTOCOL_VERSION,
    Abort,
    Acquire,
    Alloc,
    Clear,
    Clients,
    Commit,
    ConfigGet,
    Delete,
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
    Request,
    Scan,
    Shutdown,
    Subscribe,
    Events,
)
from test_disk_tier import (  # noqa: F401 (disk_service is a fixture)
    HASHES_A,
    assert_nothing_held,
    disk_service,
    settle,
    stored_and_settled,
)
from test_service import (  # noqa: F401 (make_service and service are fixtures)
    LAYOUT,
    OTHER_UID,
    chunk_hashes,
    error_code,
    greeted,
    make_service,
    service,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUEST_TYPES = typing.get_args(Request)
# One valid-looking request of each type, for the rules every row is checked by.
SAMPLES = [
    Hello(PROTOCOL_VERSION, os.getpid(), "again", [LAYOUT]), Lookup([1], chunk_hashes([0])),
    Acquire([1], chunk_hashes([0])), Release([123]), Alloc(1, chunk_hashes([0]), [1]),
    Commit([0]), Abort([0]), Invalidate(1, chunk_hashes([0]), [0]), Put(1, "k", 1),
    Get(1, "k"), Delete(1, "k"), Scan(1, "", 10), OpenTier(1), Info(), Clients(),
    ConfigGet(), Ping(), Evict(lru=0), Clear(), Shutdown(), Subscribe(), Events(1),
]
# Lists of request types the wire contract and the client keep for facts of their own
# (not the daemon's): the reply type the client expects, and which requests the serving
# path sends with its short timeout.
OTHER_LAYERS_LISTS = {
    ("lmcached/wire/protocol.py", "NO_REPLY_REQUESTS"),
    ("lmcached/wire/connection.py", "REPLY_TYPES"),
    ("client/daemon_link.py", "DATA_PATH_REQUESTS"),
}


def test_every_request_type_of_the_protocol_has_exactly_one_row():
    rows = [command.request_type for command in COMMAND_TABLE]
    assert sorted(rows, key=repr) == sorted(REQUEST_TYPES, key=repr)
    assert len(rows) == len(set(rows)) == len(COMMANDS)
    assert all(COMMANDS[t].request_type is t for t in REQUEST_TYPES)
    assert sorted(map(type, SAMPLES), key=repr) == sorted(REQUEST_TYPES, key=repr)


def test_names_and_reply_kinds_come_from_the_wire_contract():
    assert {c.request_type for c in COMMAND_TABLE if not c.replies} == NO_REPLY_REQUESTS
    assert NO_REPLY_REQUESTS == {Release, Invalidate}
    assert [c.name for c in COMMAND_TABLE] == [
        c.request_type.__struct_config__.tag for c in COMMAND_TABLE]
    assert COMMANDS[ConfigGet].name == "config_get"


def request_type_lists(path: str) -> list[tuple[str, int]]:
    """(assigned name, line) of every dict, set, tuple or list display in the Python file
    at `path` that names a request type of the protocol ("<expr>" for a display
    assigned to nothing)."""
    names = {t.__name__ for t in REQUEST_TYPES}
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    targets = {}  # id(display node) -> the name it is assigned to
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            label = ast.unparse(target)
            for inner in ast.walk(node.value) if node.value is not None else ():
                targets[id(inner)] = label
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            elements = node.keys
        elif isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            elements = node.elts
        else:
            continue
        if any(isinstance(e, ast.Name) and e.id in names
               or isinstance(e, ast.Attribute) and e.attr in names for e in elements):
            found.append((targets.get(id(node), "<expr>"), node.lineno))
    return found


def python_files() -> list[str]:
    """Every module of the package, relative to the repository."""
    paths = []
    for folder in ("lmcached", "client", "shm"):
        for directory, _, files in os.walk(os.path.join(REPO, folder)):
            paths.extend(os.path.relpath(os.path.join(directory, name), REPO)
                         for name in files if name.endswith(".py"))
    return sorted(paths)


def test_the_command_table_is_the_only_daemon_list_of_request_types():
    """No module but commands.py keeps a table (dict, set, tuple, list) of request
    types: a second one for a handler, a privilege, a cost or a loading rule would be a
    copy that can drift from the table. The wire contract's and the client's own facts
    are the exceptions listed in OTHER_LAYERS_LISTS."""
    found = {}
    for path in python_files():
        if path == "lmcached/daemon/commands.py":
            continue
        for name, line in request_type_lists(os.path.join(REPO, path)):
            if (path, name) not in OTHER_LAYERS_LISTS:
                found[f"{path}:{line}"] = name
    assert found == {}, "request types listed outside lmcached/daemon/commands.py"


def test_the_check_finds_a_table_of_request_types(tmp_path):
    """The check can fail: the kinds of table the command table replaced are found."""
    planted = tmp_path / "planted.py"
    planted.write_text("COST = {Info: 8}\nPRIVILEGED = frozenset({Evict, Clear})\n"
                       "class S:\n    def f(self):\n        self.h = {p.Ping: self.ping}\n"
                       "        return isinstance(r, (Hello, *ADMIN))\n")
    assert request_type_lists(str(planted)) == [
        ("COST", 1), ("PRIVILEGED", 2), ("self.h", 5), ("<expr>", 6)]


def count_of(service, code: str) -> int:
    return service.stats.errors.get(code, 0)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda r: type(r).__name__)
def test_another_uid_is_refused_exactly_the_privileged_commands(service, sample):
    command = COMMANDS[type(sample)]
    greeted(service, LAYOUT)
    stranger = greeted(service, LAYOUT, uid=OTHER_UID)
    reply = service.handle(stranger, sample)
    assert count_of(service, "forbidden") == int(command.privileged)
    assert (error_code(reply) == "forbidden") == (command.privileged and command.replies)
    assert service.stop_requested is False


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda r: type(r).__name__)
def test_before_hello_only_the_before_hello_commands_are_served(service, sample):
    command = COMMANDS[type(sample)]
    greeted(service, LAYOUT)
    session = service.open_session(os.getpid(), os.geteuid(), 0)
    reply = service.handle(session, sample)
    assert count_of(service, "no_session") == int(not command.before_hello)
    if command.replies:
        assert (error_code(reply) == "no_session") == (not command.before_hello)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda r: type(r).__name__)
def test_while_loading_only_the_while_loading_commands_are_served(service, sample):
    command = COMMANDS[type(sample)]
    session = greeted(service, LAYOUT)
    service.start_loading(Loading([PrefaultProgress(1 << 30)]))
    reply = service.handle(session, sample)
    assert count_of(service, "loading") == int(not command.while_loading)
    if command.replies:
        assert (error_code(reply) == "loading") == (not command.while_loading)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda r: type(r).__name__)
def test_a_request_costs_its_commands_cost_and_is_answered_by_its_reply_kind(service, sample):
    """Through the connection's `answer_frame`: the cost in the per-pass budget is the
    row's (SCAN and CLIENTS: what their handler priced them, at least 1), and a frame
    comes back exactly for the commands that reply."""
    command = COMMANDS[type(sample)]
    session = greeted(service, LAYOUT)
    frame, cost = answer_frame(service, session, encode_frame(sample)[4:])
    if type(sample) in (Scan, Clients):
        assert cost >= 1
    else:
        assert cost == command.cost
    assert (frame is not None) == command.replies


def test_the_rows_keep_the_daemons_rules():
    """Who may send what, when, and at what price (docs/architecture.md's request table,
    "Trust model"; after Redis's -LOADING and its admin commands)."""
    def having(flag: str) -> set[type]:
        return {c.request_type for c in COMMAND_TABLE if getattr(c, flag)}
    assert having("privileged") == {Evict, Clear, Shutdown}
    assert having("while_loading") == {Info, Clients, ConfigGet, Shutdown}
    assert having("before_hello") == {Hello, Info, Clients, Evict, Clear, Ping, Shutdown,
                                      ConfigGet, Subscribe, Events}
    assert having("waits_for_fetch") == {Lookup, Acquire}
    assert {c.request_type: c.cost for c in COMMAND_TABLE if c.cost != 1} == {Info: 8}


@pytest.mark.parametrize("request_type", [Lookup, Acquire], ids=lambda t: t.__name__)
def test_a_resumed_request_is_answered_from_the_arena_without_a_second_fetch(
        disk_service, request_type):
    """A LOOKUP or ACQUIRE that waits for a disk fetch is answered by `resume` from the
    arena as it is then, even while the fetch still runs: it neither joins nor starts a
    fetch (no second Deferred) and is counted once; the next request fetches again."""
    service = disk_service
    session = stored_and_settled(service)
    parked = service.handle(session, request_type([1], HASHES_A))
    assert isinstance(parked, Deferred) and not parked.job.done
    requests, lookups = service.stats.requests, service.stats.lookups
    reply = service.resume(session, parked)  # the wait ran out: the fetch goes on
    assert not isinstance(reply, Deferred), reply
    assert (service.stats.requests, service.stats.lookups) == (requests, lookups)
    assert parked.stats.fetch_waits_timed_out == 1
    if request_type is Acquire:
        service.handle(session, Release([reply.lease]))
    settle(service, lambda: parked.job.done)
    assert service.handle(session, Lookup([1], HASHES_A)).num_chunks == 4
    assert service.stats.lookups == lookups + 1
    assert_nothing_held(service)
