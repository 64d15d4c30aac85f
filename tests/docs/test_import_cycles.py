"""No import circle between the project's modules, type-checking imports included.

A circle (a imports b, b imports a, directly or around several modules) means that
neither module can be read, tested or moved without the other, and that the layers of
pyproject.toml's contracts cannot be drawn between them. grimp (which import-linter
uses) builds the graph of every import, in functions and under `if TYPE_CHECKING:`
too, over a copy of the package as installed (tests/docs/test_layers.py says why); the
circles are its strongly connected components of more than one module.
"""

import json
import os
import subprocess
import sys

import pytest

from test_layers import installed_tree

# Run in a child with the copied tree first on sys.path: in this process `lmcached` is
# the editable install, whose shm/ and client/ grimp cannot find.
FIND_CIRCLES = r'''
import json, sys
import grimp

graph = grimp.build_graph("lmcached", cache_dir=None)
edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m)
                   if i.startswith("lmcached")) for m in graph.modules}
index, low, stack, on_stack, circles = {}, {}, [], set(), []

def visit(root):
    # Tarjan's strongly connected components, iteratively (no recursion limit).
    work = [(root, 0)]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
        module, i = work.pop()
        if i < len(edges[module]):
            work.append((module, i + 1))
            target = edges[module][i]
            if target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, 0))
            elif target in on_stack:
                low[module] = min(low[module], index[target])
            continue
        if work:
            parent = work[-1][0]
            low[parent] = min(low[parent], low[module])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

for module in sorted(edges):
    if module not in index:
        visit(module)
out = []
for members in sorted(circles):
    lines = []
    for a in members:
        for b in edges[a]:
            if b in members:
                for d in graph.get_import_details(importer=a, imported=b):
                    lines.append(f"{a} -> {b} (l.{d['line_number']}: {d['line_contents']})")
    out.append(lines)
print(json.dumps(out))
'''


def import_circles(tree: str) -> list[list[str]]:
    """Each import circle among the modules of the package copied to `tree`: the imports
    between its modules, as "importer -> imported (l.N: source line)"."""
    pytest.importorskip("grimp", reason="pip install 'lmcached[test]' (import-linter)")
    result = subprocess.run([sys.executable, "-c", FIND_CIRCLES], cwd=tree,
                            env={**os.environ, "PYTHONPATH": tree},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_no_import_circle_between_modules(tmp_path):
    circles = import_circles(installed_tree(str(tmp_path)))
    assert circles == [], "import circles:\n" + "\n\n".join("\n".join(c) for c in circles)


@pytest.mark.parametrize("planted", [
    "import lmcached.daemon.block_pool",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
    "    from lmcached.daemon.block_pool import BlockPool",
], ids=["import", "type-checking import"])
def test_a_planted_circle_is_found(tmp_path, planted):
    """The check can fail: free_queue importing block_pool (which imports free_queue)
    is a circle, under `if TYPE_CHECKING:` too."""
    tree = installed_tree(str(tmp_path))
    with open(os.path.join(tree, "lmcached", "daemon", "free_queue.py"), "a") as f:
        f.write(f"\n{planted}  # noqa: E402,F401 (the circle)\n")
    circles = import_circles(tree)
    assert len(circles) == 1, circles
    assert any(line.startswith("lmcached.daemon.free_queue -> lmcached.daemon.block_pool")
               for line in circles[0]), circles
