"""`DaemonLink` and the vLLM connector hold their parts; they inherit none of ours.

A mixin shares its host's state through `self`: a reader of the mixin's file cannot know
what an attribute is. The link's reconnect policy (client/link_reconnect.py) and the
connector's guarded-hook bookkeeping (client/serving/guarded_hooks.py) are objects with
their own state, which the link and the connector hold (`link.reconnect`,
`connector.hooks`). The check reads the classes' sources (the connector's needs no vLLM)
and, where it can import them, their method resolution order. What the policy reads and
changes of its link is the link's public surface, declared by `LinkSession`: no private
attribute of the link is named in client/link_reconnect.py.
"""

import ast
import os

import pytest

from lmcached.client.daemon_link import DaemonLink
from lmcached.client.link_reconnect import LinkSession, ReconnectPolicy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def bases_from_our_code(source: str, name: str, module: str) -> list[str]:
    """The bases, as written, of class `name` in Python `source` (the module `module`)
    that are lmcached's: classes of that module, or names imported from `lmcached.*`."""
    tree = ast.parse(source)
    origin = {node.name: module for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            origin.update({alias.asname or alias.name: node.module for alias in node.names})
        elif isinstance(node, ast.Import):
            origin.update({alias.asname or alias.name.split(".")[0]: alias.name
                           for alias in node.names})
    ours = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            for base in node.bases:
                root = ast.unparse(base).split(".")[0]
                if origin.get(root, module).split(".")[0] == "lmcached":
                    ours.append(ast.unparse(base))
    return ours


def read(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


@pytest.mark.parametrize("path, module, name", [
    ("client/daemon_link.py", "lmcached.client.daemon_link", "DaemonLink"),
    ("client/vllm/connector.py", "lmcached.client.vllm.connector", "LMCachedConnector"),
])
def test_the_link_and_the_connector_inherit_no_part_of_ours(path, module, name):
    assert bases_from_our_code(read(path), name, module) == []


def test_the_link_holds_its_reconnect_policy():
    assert DaemonLink.__mro__ == (DaemonLink, object)
    link = DaemonLink("/nonexistent/lmcached.sock", data_timeout_s=0.05)
    assert isinstance(link.reconnect, ReconnectPolicy)
    assert link.num_reconnects == 0


def test_the_connector_holds_its_guarded_hooks():
    pytest.importorskip("vllm", reason="vLLM is not installed here: the source check above "
                                       "covers the connector")
    from lmcached.client.vllm.connector import LMCachedConnector

    assert [cls.__module__ for cls in LMCachedConnector.__mro__[1:]
            if cls.__module__.startswith("lmcached")] == []


def test_the_bases_check_finds_a_mixin():
    planted = ("from lmcached.client.link_reconnect import ReconnectPolicy\n"
               "import lmcached.client.serving.guarded_hooks as gh\n"
               "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
               "class Local:\n    pass\n"
               "class DaemonLink(ReconnectPolicy, gh.GuardedHooks, Local, KVConnectorBase_V1):\n"
               "    pass\n")
    assert bases_from_our_code(planted, "DaemonLink", "lmcached.client.daemon_link") == [
        "ReconnectPolicy", "gh.GuardedHooks", "Local"]


def private_members_of_the_link(source: str, protocol: str = "LinkSession") -> list[str]:
    """What Python `source` names of the link that is private (`_name`): members declared
    in class `protocol`, and `link._name` / `getattr(link, "_name")` in every function
    where `link` is a parameter annotated `protocol`."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == protocol:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    member = item.target.id
                elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    member = item.name
                else:
                    continue
                if member.startswith("_"):
                    found.append(f"{protocol}.{member}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            links = {arg.arg for arg in args
                     if arg.annotation is not None and ast.unparse(arg.annotation) == protocol}
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id in links and sub.attr.startswith("_")):
                    found.append(f"{node.name}: {ast.unparse(sub)}")
                elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name)
                        and sub.func.id in ("getattr", "setattr", "hasattr") and sub.args
                        and isinstance(sub.args[0], ast.Name) and sub.args[0].id in links
                        and len(sub.args) > 1 and isinstance(sub.args[1], ast.Constant)
                        and str(sub.args[1].value).startswith("_")):
                    found.append(f"{node.name}: {ast.unparse(sub)}")
    return found


def test_the_reconnect_policy_names_no_private_member_of_the_link():
    assert private_members_of_the_link(read("client/link_reconnect.py")) == []


def test_the_link_has_every_member_the_policy_uses():
    link = DaemonLink("/nonexistent/lmcached.sock", data_timeout_s=0.05)
    members = set(LinkSession.__annotations__) | {
        name for name, value in vars(LinkSession).items()
        if (callable(value) or isinstance(value, property)) and not name.startswith("__")}
    assert {"lock", "closed", "connect"} <= members
    assert [name for name in sorted(members) if not hasattr(link, name)] == []


def test_the_private_member_check_finds_them():
    planted = ("class LinkSession(Protocol):\n"
               "    lock: object\n    _conn: object\n"
               "    def _drop_session(self) -> None: ...\n"
               "def reopen(self, link: LinkSession, other) -> None:\n"
               "    conn = link._conn\n    link.lock\n    other._private\n"
               "    getattr(link, '_closed')\n    link._drop_session()\n")
    assert private_members_of_the_link(planted) == [
        "LinkSession._conn", "LinkSession._drop_session", "reopen: link._conn",
        "reopen: getattr(link, '_closed')", "reopen: link._drop_session"]
