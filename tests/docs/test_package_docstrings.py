"""Each package's docstring names every module in it.

A package docstring is where a reader starts ("What lives here"); a module it leaves out
is one nobody finds, and a list that has drifted from the folder is a list nobody trusts.
"""

import ast
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The folders of the distribution's packages (pyproject.toml's package-dir).
ROOTS = ("lmcached", "shm", "client", "examples")


def packages() -> list[str]:
    """Every package folder of the distribution, relative to the repository."""
    found = []
    for root in ROOTS:
        for folder, dirs, files in os.walk(os.path.join(REPO, root)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            if "__init__.py" in files:
                found.append(os.path.relpath(folder, REPO))
    return sorted(found)


def children(folder: str) -> list[str]:
    """The modules and subpackages directly in `folder` (not `__init__`)."""
    names = []
    for entry in sorted(os.listdir(folder)):
        if entry.endswith(".py") and entry != "__init__.py":
            names.append(entry[:-3])
        elif os.path.isfile(os.path.join(folder, entry, "__init__.py")):
            names.append(entry)
    return names


def named_in(doc: str, name: str) -> bool:
    """Whether `doc` names module `name`: `name.py`, `name/` or `name` in backquotes."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(\.py\b|/)|`{re.escape(name)}`", doc) \
        is not None


@pytest.mark.parametrize("package", packages())
def test_package_docstring_names_every_module(package):
    folder = os.path.join(REPO, package)
    with open(os.path.join(folder, "__init__.py")) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    missing = [name for name in children(folder) if not named_in(doc, name)]
    assert missing == [], (
        f"{package}/__init__.py's docstring does not name {missing}: say in it what each "
        "holds")
