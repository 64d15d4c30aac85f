"""The layers inside the daemon and inside the client hold: pyproject.toml's contracts
`daemon-layers` and `client-layers`, run by tests/docs/test_layers.py's
`test_no_module_imports_across_the_layers` with the others.

Here: every module of both packages is in a layer (a new one has to be placed), and a
planted wrong import breaks each contract, so the check can fail.
"""

import os
import tomllib

import pytest

from test_layers import REPO, installed_tree, lint_imports

# Contract id -> (container, its folder in the repository).
INNER_CONTRACTS = {
    "daemon-layers": ("lmcached.daemon", os.path.join(REPO, "lmcached", "daemon")),
    "client-layers": ("lmcached.client", os.path.join(REPO, "client")),
}


def contract(contract_id: str) -> dict:
    """The import-linter contract `contract_id` of pyproject.toml."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["id"] == contract_id)


def layered_names(layers: list[str]) -> set[str]:
    """The module names of `layers` ("a | b", "a : b", "(optional)" spellings)."""
    names = set()
    for layer in layers:
        for name in layer.replace("|", ":").split(":"):
            names.add(name.strip().strip("()"))
    return names


def child_modules(folder: str) -> set[str]:
    """The modules and packages directly in `folder` (not `__init__`)."""
    names = set()
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if entry.endswith(".py") and entry != "__init__.py":
            names.add(entry[:-3])
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            names.add(entry)
    return names


@pytest.mark.parametrize("contract_id", sorted(INNER_CONTRACTS))
def test_every_module_is_in_a_layer(contract_id):
    """A module in no layer is free to import anything: place each new one."""
    container, folder = INNER_CONTRACTS[contract_id]
    layers = contract(contract_id)
    assert layers["containers"] == [container]
    missing = child_modules(folder) - layered_names(layers["layers"])
    assert missing == set(), (
        f"modules of {container} in no layer of the contract {contract_id!r} in "
        f"pyproject.toml: {sorted(missing)}; add each to the layer it belongs to")


# (file to plant in, relative to the installed tree; the wrong import; what lint-imports
# names). Each goes against one layer of the two contracts.
PLANTED = {
    # The disk tier importing the connection (and through it the service).
    "disk tier -> connection": (
        "lmcached/daemon/disk/tier.py", "lmcached.daemon.connection",
        "lmcached.daemon.disk.tier -> lmcached.daemon.connection"),
    # The block pool importing request semantics.
    "block pool -> service": (
        "lmcached/daemon/block_pool.py", "lmcached.daemon.service",
        "lmcached.daemon.block_pool -> lmcached.daemon.service"),
    # INFO importing the service it describes.
    "info -> service": (
        "lmcached/daemon/info.py", "lmcached.daemon.service",
        "lmcached.daemon.info -> lmcached.daemon.service"),
    # The chunk-chain core importing the engine built on it.
    "chain -> engine": (
        "lmcached/client/chain/core.py", "lmcached.client.engine",
        "lmcached.client.chain.core -> lmcached.client.engine"),
    # One engine's glue importing another's.
    "vllm -> hf": (
        "lmcached/client/vllm/specs.py", "lmcached.client.hf",
        "lmcached.client.vllm.specs -> lmcached.client.hf"),
    # Records importing the daemon link.
    "records -> daemon link": (
        "lmcached/client/records.py", "lmcached.client.daemon_link",
        "lmcached.client.records -> lmcached.client.daemon_link"),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_wrong_import_breaks_an_inner_contract(tmp_path, case):
    path, wrong_import, expected = PLANTED[case]
    tree = installed_tree(str(tmp_path))
    with open(os.path.join(tree, path), "a") as f:
        f.write(f"\nimport {wrong_import}  # noqa: E402,F401 (the wrong import)\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    assert expected in result.stdout, result.stdout
