"""The layers of docs/architecture.md hold: import-linter's contracts in pyproject.toml.

The distribution maps folders onto import names (shm/ -> lmcached.shm, client/ ->
lmcached.client, examples/ -> lmcached.examples), which grimp cannot follow in an
editable install. So the test copies the package as installed into a temporary folder
and runs `lint-imports` there, with that folder first on PYTHONPATH. A second test
imports the request semantics in a fresh interpreter and checks what came with them.

Run as a script (`make lint-imports`), it does the same by hand and prints
import-linter's report; its arguments go to `lint-imports` (e.g. `--contract layers`):

    python tests/docs/test_layers.py [--contract ID] [--verbose]

A bare `lint-imports` at the repository root fails ("Missing layer 'lmcached.examples'"):
it sees only the lmcached/ folder, without shm/, client/ and examples/.
"""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Import name -> folder of the repository, as pyproject.toml's [tool.setuptools.package-dir].
PACKAGE_DIRS = {
    "lmcached": "lmcached",
    "lmcached/shm": "shm",
    "lmcached/client": "client",
    "lmcached/examples": "examples",
}
# What `import lmcached.daemon.service` must not load (docs/architecture.md, "Layers").
NOT_WITH_SEMANTICS = ("click", "torch")
# Nor these: the daemon imports psutil and prometheus_client lazily, where it needs them.
NOT_WITH_SEMANTICS_LAZY = ("prometheus_client", "psutil")


def installed_tree(root: str) -> str:
    """Copy the package into `root` as an install lays it out; returns `root`."""
    for package, folder in PACKAGE_DIRS.items():
        shutil.copytree(os.path.join(REPO, folder), os.path.join(root, package),
                        ignore=shutil.ignore_patterns("__pycache__"))
    return root


def lint_imports(tree: str, *args: str) -> subprocess.CompletedProcess:
    """`lint-imports` with pyproject.toml's contracts over the copied tree (run as this
    interpreter's module, so the test's own import-linter checks it); `args` go to it."""
    pytest.importorskip("importlinter", reason="pip install 'lmcached[test]'")
    code = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"
    env = {**os.environ, "PYTHONPATH": tree}
    return subprocess.run(
        [sys.executable, "-c", code, "--no-cache", *args, os.path.join(REPO, "pyproject.toml")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def test_no_module_imports_across_the_layers(tmp_path):
    result = lint_imports(installed_tree(str(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def test_a_wrong_import_breaks_the_layers_contract(tmp_path):
    """The check can fail: the wire contract importing the client is caught."""
    tree = installed_tree(str(tmp_path))
    with open(os.path.join(tree, "lmcached", "wire", "protocol.py"), "a") as f:
        f.write("\nimport lmcached.client  # noqa: E402,F401 (the wrong import)\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    assert "lmcached.wire.protocol -> lmcached.client" in result.stdout, result.stdout


@pytest.mark.parametrize("wrong_import", ["lmcached.client.vllm.worker", "transformers"])
def test_a_wrong_import_breaks_the_serving_contract(tmp_path, wrong_import):
    """The serving core importing an engine's glue or an engine is caught."""
    tree = installed_tree(str(tmp_path))
    with open(os.path.join(tree, "lmcached", "client", "serving", "worker.py"), "a") as f:
        f.write(f"\nimport {wrong_import}  # noqa: E402,F401 (the wrong import)\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    assert "The serving core imports no engine" in result.stdout, result.stdout
    assert f"lmcached.client.serving.worker -> {wrong_import}" in result.stdout, result.stdout


def modules_loaded_with_semantics(names: tuple[str, ...]) -> list[str]:
    """Which of `names` a fresh interpreter has loaded after `import lmcached.daemon.service`."""
    code = ("import sys, lmcached.daemon.service; "
            f"print(sorted(m for m in {names!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60)
    return eval(result.stdout)  # a list of str literals printed by the child


def test_request_semantics_import_no_click_and_no_torch():
    assert modules_loaded_with_semantics(NOT_WITH_SEMANTICS) == []


def test_request_semantics_import_no_psutil_and_no_prometheus_client():
    assert modules_loaded_with_semantics(NOT_WITH_SEMANTICS_LAZY) == []


@pytest.mark.parametrize("wrong_import", ["transformers", "lmcached.client.hf_blend"])
def test_a_wrong_import_breaks_the_blend_contract(tmp_path, wrong_import):
    """CacheBlend's one layer loop stays engine-free: importing an engine, or an
    engine's adapter, from it is caught."""
    tree = installed_tree(str(tmp_path))
    with open(os.path.join(tree, "lmcached", "client", "blend", "layer_loop.py"), "a") as f:
        f.write(f"\nimport {wrong_import}  # noqa: E402,F401 (the wrong import)\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    assert f"lmcached.client.blend.layer_loop -> {wrong_import}" in result.stdout, result.stdout


def main(args: list[str]) -> int:
    """`make lint-imports`: the contracts over a copy of the tree laid out as installed,
    in a temporary folder (removed after); prints import-linter's report.

    Returns:
        lint-imports' exit status (0: every contract kept).
    """
    with tempfile.TemporaryDirectory(prefix="lmcached-lint-imports-") as root:
        result = lint_imports(installed_tree(root), *args)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
