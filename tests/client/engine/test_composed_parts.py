"""`DaemonLink` and the vLLM connector hold their parts; they inherit none of ours.

A mixin shares its host's state through `self`: a reader of the mixin's file cannot know
what an attribute is. The link's reconnect policy (client/link_reconnect.py) and the
connector's guarded-hook bookkeeping (client/serving/guarded_hooks.py) are objects with
their own state, which the link and the connector hold (`link.reconnect`,
`connector.hooks`). The check reads the classes' sources (the connector's needs no vLLM)
and, where it can import them, their method resolution order.
"""

import ast
import os

import pytest

from lmcached.client.daemon_link import DaemonLink
from lmcached.client.link_reconnect import ReconnectPolicy

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
