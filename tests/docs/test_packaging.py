"""The base install (daemon and CLI) needs no torch, and pyproject.toml says so.

The daemon-side processes run with torch, transformers and vllm made unimportable by a
`sitecustomize` on PYTHONPATH: a meta-path finder that refuses them and writes every
attempt to a log file. An empty log proves that no attempt was made (an import the code
caught and survived would still be logged), not only that nothing failed.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile

import pytest

from lmcached.launcher import stop_daemon
from lmcached.wire.connection import Connection, DaemonError
from lmcached.wire.protocol import Ping
from lmcached.shm.janitor import list_segments

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
START_DEADLINE_S = 30.0
BLOCKED = ("torch", "transformers", "vllm")

SITECUSTOMIZE = f'''
import importlib.abc, os, sys

class _RefuseHeavyImports(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            with open(os.environ["LMCACHED_TEST_IMPORT_LOG"], "a") as log:
                log.write(f"{{os.getpid()}} {{sys.argv}} imported {{name}}\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}} (refused by the test)", name=name)
        return None

sys.meta_path.insert(0, _RefuseHeavyImports())
'''


@pytest.fixture
def no_torch_env(short_tmp):
    """Environment for subprocesses in which torch, transformers and vllm cannot be
    imported; `env.import_log()` lists every attempt."""
    site_dir = os.path.join(short_tmp, "site")
    os.mkdir(site_dir)
    with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    log_path = os.path.join(short_tmp, "imports.log")
    env = dict(os.environ, LMCACHED_TEST_IMPORT_LOG=log_path,
               PYTHONPATH=os.pathsep.join(filter(None, [site_dir, os.environ.get("PYTHONPATH")])))

    class Env(dict):
        def import_log(self) -> list[str]:
            if not os.path.exists(log_path):
                return []
            with open(log_path) as f:
                return f.read().splitlines()

    return Env(env)


def _run(env, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_the_blocker_catches_a_torch_import(no_torch_env):
    """The fixture works: a process that imports torch fails and is logged."""
    proc = _run(no_torch_env, sys.executable, "-c", "import torch")
    assert proc.returncode == 1 and "refused by the test" in proc.stderr
    assert len(no_torch_env.import_log()) == 1


def test_cli_help_runs_without_torch(no_torch_env):
    for args in ([], ["serve"], ["info"]):
        proc = _run(no_torch_env, os.path.join(BIN, "lmcached"), *args, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "Usage: lmcached" in proc.stdout
    assert no_torch_env.import_log() == []


def test_daemon_serves_stores_and_stops_without_torch(no_torch_env, unique_name, short_tmp):
    """`lmcached serve`, `info` and `stop` with torch unimportable, while a client (this
    process, with torch) stores and retrieves KV through that daemon."""
    torch = pytest.importorskip("torch")
    from lmcached.client import CacheEngine, KVLayout

    socket = os.path.join(short_tmp, "d.sock")
    with open(os.path.join(short_tmp, "daemon.log"), "w") as log:
        daemon = subprocess.Popen(
            [os.path.join(BIN, "lmcached"), "serve", "--name", unique_name, "--socket", socket,
             "--capacity", "16MiB", "--block-size", "64KiB"],
            env=no_torch_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            assert daemon.poll() is None, open(os.path.join(short_tmp, "daemon.log")).read()
            try:
                with Connection(socket, timeout_s=5) as conn:
                    conn.request(Ping())
                break
            except (OSError, DaemonError) as exc:  # DaemonError: the arena still prefaults
                assert not isinstance(exc, DaemonError) or exc.code == "loading", exc
                assert time.monotonic() < deadline, "the daemon did not answer in time"
                time.sleep(0.05)

        layout = KVLayout("packaging-test", num_layers=2, num_kv_heads=2, head_size=16,
                          dtype="float32", chunk_size=16)
        tokens = torch.arange(64)
        kv = torch.randn(2, 2, 64, 2, 16)  # [layers, K/V, tokens, kv heads, head_size], fp32
        with CacheEngine.connect(layout, socket=socket, strict=True) as engine:
            engine.store(tokens, kv)
            kv_out, ret_mask = engine.retrieve(tokens, return_tuple=False)
        assert int(ret_mask.sum()) == 64 and torch.equal(kv_out, kv)

        info = _run(no_torch_env, os.path.join(BIN, "lmcached"), "info", "--socket", socket)
        assert info.returncode == 0, info.stderr
        assert f"name:{unique_name}" in info.stdout
        assert re.search(r"^stores:4$", info.stdout, re.MULTILINE), info.stdout

        stop = _run(no_torch_env, os.path.join(BIN, "lmcached"), "stop", "--socket", socket)
        assert stop.returncode == 0, stop.stderr
        assert daemon.wait(timeout=15) == 0
    finally:
        stop_daemon(daemon)
    assert not os.path.exists(socket)
    assert not [s for s in list_segments() if s.startswith(f"lmcached.{unique_name}.")]
    assert no_torch_env.import_log() == []


def test_client_import_without_torch_names_the_extra(no_torch_env):
    proc = _run(no_torch_env, sys.executable, "-c", "import lmcached.client")
    assert proc.returncode == 1
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: lmcached.client needs torch")
    assert ("pip install '.[client]' in a checkout of lmcached, or pip install "
            "'lmcached[client]' from a package index" in last_line)
    for extra in ("hf", "vllm", "vllm-cpu"):
        assert f" {extra} " in last_line


def test_demo_without_torch_is_one_error_line(no_torch_env):
    proc = _run(no_torch_env, os.path.join(BIN, "lmcached"), "demo", "--size", "tiny")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error: ") and "pip install 'lmcached[hf]'" in proc.stderr
    assert "pip install '.[hf]' in a checkout of lmcached" in proc.stderr


def test_every_install_hint_names_the_checkout_and_the_index_form():
    """lmcached is installed from a checkout as often as from an index: a hint in the
    code is `install_hint(extra)` (both commands), never one `pip install` spelled by
    hand (`pip install 'lmcached[l2]'` alone fails in a checkout that is not on an index)."""
    from lmcached.wire.extras import install_hint

    assert install_hint("l2") == ("pip install '.[l2]' in a checkout of lmcached, or "
                                  "pip install 'lmcached[l2]' from a package index")
    by_hand = []
    for folder in ("lmcached", "client", "shm", "examples"):
        for dirpath, _, filenames in os.walk(os.path.join(REPO, folder)):
            for name in filenames:
                path = os.path.join(dirpath, name)
                if not name.endswith(".py") or path.endswith(os.path.join("wire", "extras.py")):
                    continue
                by_hand += [f"{os.path.relpath(path, REPO)}:{line}: {text!r}"
                            for line, text in _string_literals(path)
                            if re.search(r"pip install '?lmcached\[", text)]
    assert not by_hand, "hints spelled by hand (use install_hint):\n" + "\n".join(by_hand)


def _string_literals(path: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal of a module but its docstrings (what the
    code may print)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


# ------------------------------------------------------------------ pyproject.toml
def _pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement, normalized (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)[1]).lower()


def _requirement(requirements: list[str], name: str) -> str:
    found = [r for r in requirements if _name(r) == name]
    assert len(found) == 1, f"{name} in {requirements}"
    return found[0]


def test_base_dependencies_need_no_torch():
    base = {_name(r) for r in _pyproject()["project"]["dependencies"]}
    assert not base & {"torch", "transformers", "tokenizers", "vllm", "vllm-cpu"}
    assert {"numpy", "posix-ipc", "xxhash", "psutil", "click", "msgspec", "prometheus-client"} <= base


def test_extras_exist_with_upper_bounds_where_apis_change():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert {"client", "hf", "vllm", "vllm-cpu", "test", "bench"} <= set(extras)
    assert "<" in _requirement(extras["client"], "torch")
    for name in ("transformers", "tokenizers"):
        assert "<" in _requirement(extras["hf"], name), name
    # the releases the connector is written and tested against (client/vllm/connector.py)
    assert _requirement(extras["vllm"], "vllm").replace(" ", "") == "vllm>=0.32,<0.34"
    assert _requirement(extras["vllm-cpu"], "vllm-cpu").replace(" ", "") == "vllm-cpu>=0.32,<0.34"
    # the SGLang release whose HiCacheStorage the backend is written against (make test-sglang)
    assert _requirement(extras["sglang"], "sglang").replace(" ", "") == "sglang==0.5.23"
    for extra in ("hf", "vllm", "vllm-cpu", "sglang"):  # each brings the client's torch
        assert "lmcached[client]" in extras[extra], extra


def test_installed_versions_satisfy_the_extras():
    """The versions this venv was tested with (torch 2.13.0, transformers 5.x) fit the ranges."""
    from importlib.metadata import PackageNotFoundError, version

    specifiers = pytest.importorskip("packaging.specifiers")
    extras = _pyproject()["project"]["optional-dependencies"]
    for extra, name in (("client", "torch"), ("hf", "transformers"), ("hf", "tokenizers")):
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        spec = specifiers.SpecifierSet(_requirement(extras[extra], name)[len(name):])
        assert spec.contains(installed.split("+")[0]), f"{name} {installed} not in {spec}"


def test_license_is_an_spdx_expression_with_a_setuptools_that_reads_it():
    pyproject = _pyproject()
    assert pyproject["project"]["license"] == "Apache-2.0"
    setuptools = _requirement(pyproject["build-system"]["requires"], "setuptools")
    minimum = re.search(r">=\s*(\d+)", setuptools)
    assert minimum and int(minimum[1]) >= 77, setuptools  # PEP 639 license strings


def test_every_package_folder_is_shipped():
    """Each folder under a package-dir root that holds Python modules is listed in
    [tool.setuptools] packages (e.g. client/blend/ as lmcached.client.blend)."""
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for import_root, folder in setuptools["package-dir"].items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if any(f.endswith(".py") for f in filenames):
                relative = os.path.relpath(dirpath, os.path.join(REPO, folder))
                name = import_root if relative == "." else f"{import_root}.{relative.replace(os.sep, '.')}"
                assert name in listed, f"{dirpath} is not shipped: add {name!r} to packages"


@pytest.mark.slow
def test_wheel_builds_without_warnings_and_holds_every_module(tmp_path):
    """`pip wheel` of a copy of the tree (the build backend's output shown with -v):
    no deprecation warning, every module of the package folders inside, no torch in the
    base requirements."""
    setuptools_version = pytest.importorskip("setuptools").__version__
    if int(setuptools_version.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools_version} here; the build needs >= 77")
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
        ".hypothesis", "results"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    warning = re.compile(r"deprecat|[a-z]Warning\b", re.IGNORECASE)  # e.g. SetuptoolsDeprecationWarning
    assert not [line for line in output.splitlines() if warning.search(line)]
    (wheel,) = (tmp_path / "dist").glob("lmcached-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    package_dir = _pyproject()["tool"]["setuptools"]["package-dir"]
    for import_root, folder in package_dir.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for filename in filenames:
                if filename.endswith(".py"):
                    relative = os.path.relpath(os.path.join(dirpath, filename), os.path.join(REPO, folder))
                    member = "/".join([*import_root.split("."), *relative.split(os.sep)])
                    assert member in names, f"{member} is missing from the wheel"
    assert "License-Expression: Apache-2.0" in metadata
    unconditional = [line for line in metadata.splitlines()
                     if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert unconditional and not [line for line in unconditional if "torch" in line]
    assert "Provides-Extra: vllm-cpu" in metadata
