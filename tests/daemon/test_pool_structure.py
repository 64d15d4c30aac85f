"""The block pool holds its value bookkeeping as an object, not as a base class.

`BlockPool` inherits nothing from our code, and pool_bookkeeping.py's `ValueLedger`
keeps its own state: it never reads a pool attribute through `self` (as a mixin would)
nor any other object's private attribute. A reader of either file knows what every
attribute is.
"""

import ast
import os

from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.pool_bookkeeping import ValueLedger
from lmcached.wire.record_format import ROOT_HASH
from test_block_pool import RecordingFeed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def self_reads_not_owned(source: str) -> dict[str, set[str]]:
    """Per class of `source`, the `self.<name>` it uses that the class itself neither
    assigns (`self.<name> = ...`) nor defines (a method, a class attribute with a
    value): state that something else (a subclass, a host class) must provide. An
    annotation without a value (`cached: dict`) defines nothing."""
    out = {}
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        owned, used = set(), set()
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owned.add(node.name)
            elif isinstance(node, ast.Assign):
                owned.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                if isinstance(node.target, ast.Name):
                    owned.add(node.target.id)
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "self"):
                (owned if isinstance(node.ctx, ast.Store) else used).add(node.attr)
        if used - owned:
            out[cls.name] = used - owned
    return out


def private_reads_of_others(source: str) -> set[str]:
    """The private attributes (`x._name`, not dunders) `source` reads of any object
    but `self`."""
    return {ast.unparse(node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")}


def our_bases(cls: type) -> list[type]:
    """Every class in `cls`'s MRO, itself excepted, that lmcached defines."""
    return [base for base in cls.__mro__[1:] if base.__module__.startswith("lmcached")]


def test_block_pool_has_no_base_from_our_code():
    assert our_bases(BlockPool) == []
    assert BlockPool.__mro__ == (BlockPool, object)


def test_the_pool_holds_its_ledger():
    pool = BlockPool(2)
    assert isinstance(pool.ledger, ValueLedger)
    assert BlockPool(2).ledger is not pool.ledger


def test_the_ledger_alone_counts_keeps_parents_and_announces():
    """Told without a pool: `stored` counts a new key's group (a replaced key stays
    counted once), keeps a named parent (ROOT_HASH is none; b"" keeps the one a
    replaced value had) and announces; `removed` announces, forgets the parent and
    reports the group it emptied."""
    ledger = ValueLedger()
    emptied = []
    ledger.group_of, ledger.on_group_empty = (lambda key: key[0]), emptied.append
    ledger.events = feed = RecordingFeed()
    ledger.stored("a1", b"p", 3)
    ledger.stored("a2", ROOT_HASH, 4)
    ledger.stored("a1", b"", 5, replaced=True)
    assert ledger.num_values_by_group == {"a": 2} and ledger.parents == {"a1": b"p"}
    ledger.check_invariants({"a1": None, "a2": None})
    ledger.removed("a1")
    assert emptied == [] and ledger.parents == {}
    ledger.removed("a2")
    assert emptied == ["a"] and ledger.num_values_by_group == {}
    assert feed.calls == [("stored", "a1", b"p", 3), ("stored", "a2", b"", 4),
                          ("stored", "a1", b"", 5), ("removed", "a1"), ("removed", "a2")]


def test_the_ledger_keeps_only_its_own_state():
    """pool_bookkeeping.py reads no pool attribute through `self`, no private
    attribute of another object, none of BlockPool's private names at all, and does
    not import the pool."""
    source = read("lmcached/daemon/pool_bookkeeping.py")
    assert self_reads_not_owned(source) == {}
    assert private_reads_of_others(source) == set()
    pool = BlockPool(2)
    pool_private = {name for name in [*vars(BlockPool), *vars(pool)]
                    if name.startswith("_") and not name.startswith("__")}
    named = {node.attr for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Attribute)}
    assert "_unindex" in pool_private  # the names checked are the pool's real ones
    assert named & pool_private == set()
    imported = {node.module for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.Import) for alias in node.names}
    assert "lmcached.daemon.block_pool" not in imported


def test_the_structure_checks_find_a_mixin():
    """The checks can fail: a planted mixin that works on its host's index and free
    queue, and a helper that reaches into a pool's private method, are both found."""
    planted = (
        "class Bookkeeping:\n"
        "    cached: dict\n"
        "    def __init__(self):\n"
        "        self.parents = {}\n"
        "    def evict(self, key):\n"
        "        self.parents.pop(key, None)\n"
        "        return self._unindex(key) and self.free_block_queue\n"
        "def evict(pool, key):\n"
        "    return pool._unindex(key) and pool.cached\n"
    )
    assert self_reads_not_owned(planted) == {
        "Bookkeeping": {"_unindex", "free_block_queue"}}
    assert private_reads_of_others(planted) == {"pool._unindex"}
    assert self_reads_not_owned("class A:\n    cached: dict\n"
                                "    def f(self):\n        return self.cached\n") == {
        "A": {"cached"}}

    class Mixin:
        pass

    Mixin.__module__ = "lmcached.daemon.planted"

    class Pool(Mixin):
        pass

    assert our_bases(Pool) == [Mixin]
