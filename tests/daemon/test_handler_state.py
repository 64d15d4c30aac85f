"""The request handlers are functions over an explicit daemon state, not parts of
`CacheService`: the service inherits nothing (no mixin shares its state through
`self`), and each handler module names, in its state protocol, every attribute of the
state its functions read or change (after Redis's command table over explicit state).
"""

import ast
import inspect
import os
import typing

import pytest

from lmcached.daemon import admin_handlers, namespaces, request_checks, value_handlers
from lmcached.daemon.commands import COMMAND_TABLE
from lmcached.daemon.service import CacheService
from test_service import make_service, service  # noqa: F401 (fixtures)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANDLER_MODULES = [request_checks, value_handlers, admin_handlers, namespaces]


def class_bases(source: str, name: str) -> list[str]:
    """The bases, as written, of every class called `name` in Python `source`."""
    return [ast.unparse(base) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.name == name for base in node.bases]


def test_cache_service_inherits_no_handlers():
    """CacheService's bases are `object` alone, in its source and at run time: a
    handler written as a method of a mixin class would share the service's state
    through `self` again, where a reader of one file cannot know what it is."""
    with open(os.path.join(REPO, "lmcached/daemon/service.py")) as f:
        assert class_bases(f.read(), "CacheService") in ([], ["object"])
    assert CacheService.__mro__ == (CacheService, object)


def test_the_service_has_no_properties():
    """Every attribute of the service is a part of the state or a method: no
    property names one tier (the disk tier is `spill_tier("disk")`; the tiers under
    the arena are iterated as `spill_tiers`)."""
    assert [name for name, value in vars(CacheService).items()
            if isinstance(value, property)] == []
    assert not hasattr(CacheService, "disk") and not hasattr(CacheService, "l2")


def test_the_bases_check_finds_a_mixin():
    planted = ("class RequestChecks:\n    def _check_hashes(self, hashes): ...\n"
               "class CacheService(RequestChecks, value_handlers.ValueHandlers):\n    pass\n")
    assert class_bases(planted, "CacheService") == [
        "RequestChecks", "value_handlers.ValueHandlers"]


def protocol_members(protocol: type) -> set[str]:
    """The attributes and methods a state protocol declares, its protocol bases'
    included."""
    names = set()
    for cls in protocol.__mro__:
        if cls in (typing.Protocol, typing.Generic, object):
            continue
        names.update(cls.__dict__.get("__annotations__", {}))
        names.update(name for name, value in cls.__dict__.items()
                     if inspect.isfunction(value) and not name.startswith("__"))
    return names


def state_protocols(module) -> list[type]:
    """The protocols `module` defines."""
    return [value for value in vars(module).values()
            if getattr(value, "_is_protocol", False) and value.__module__ == module.__name__]


# The part of the service a protocol describes, where it is not the service itself.
PROTOCOL_PARTS = {request_checks.NamespacePrefixes: lambda service: service.ns_registry}


def undeclared_state_reads(source: str, scope: dict) -> dict[str, set[str]]:
    """Function name -> the attributes it reads or sets on its state argument (the
    first argument, annotated with a protocol found in `scope`) that the protocol does
    not declare. Functions whose first argument is not so annotated are skipped."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or not node.args.args:
            continue
        first = node.args.args[0]
        annotation = ast.unparse(first.annotation).strip("\"'") if first.annotation else ""
        protocol = scope.get(annotation)
        if not getattr(protocol, "_is_protocol", False):
            continue
        used = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == first.arg}
        missing = used - protocol_members(protocol)
        if missing:
            found[node.name] = missing
    return found


@pytest.mark.parametrize("module", HANDLER_MODULES, ids=lambda m: m.__name__)
def test_each_handler_module_declares_the_state_it_reads(module):
    with open(module.__file__) as f:
        source = f.read()
    assert undeclared_state_reads(source, vars(module)) == {}
    assert state_protocols(module), "no state protocol in the module"
    for command in COMMAND_TABLE:  # every handler's state argument names its protocol
        if command.handler.__module__ == module.__name__:
            first = next(iter(inspect.signature(command.handler).parameters.values()))
            assert getattr(first.annotation, "_is_protocol", False), command.name


def test_the_state_check_finds_an_undeclared_attribute():
    planted = ("def lookup(state: CheckState, session, req):\n"
               "    state.stats.lookups += 1\n    return state.spill_tiers\n")
    assert undeclared_state_reads(planted, vars(request_checks)) == {
        "lookup": {"spill_tiers"}}


@pytest.mark.parametrize("module", HANDLER_MODULES, ids=lambda m: m.__name__)
def test_the_service_has_every_part_the_handler_modules_declare(service, module):
    """The protocols name the service's real attributes: a part renamed in the service
    and not in a protocol (or the reverse) fails here, not at a request."""
    for protocol in state_protocols(module):
        target = PROTOCOL_PARTS.get(protocol, lambda s: s)(service)
        missing = {name for name in protocol_members(protocol) if not hasattr(target, name)}
        assert missing == set(), f"{protocol.__name__} names what the service lacks"
