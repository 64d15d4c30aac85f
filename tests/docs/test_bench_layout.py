"""The benchmarks are one package run from the repository root (`python -m benchmarks.G.M`).

Every benchmark lives in a group folder (engine/, tiers/, protocol/, blend/, hf/, vllm/,
sglang/) beside the shared library (common, report, memory, scaling, run, peers/); every
folder is a package; nothing patches `sys.path`; and every module imports from the root,
the optional engines (vLLM, SGLang, LMCache) excepted where they are not installed.
"""

import glob
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(REPO, "benchmarks")
# Packages a benchmark may need that `pip install .[test,hf,bench]` does not bring.
OPTIONAL = {"vllm", "sglang", "lmcache"}

# Imports each module named on the command line; prints {module: error or None}.
_CHILD = """
import importlib, json, sys
errors = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        errors[name] = None
    except ImportError as exc:
        errors[name] = [type(exc).__name__, getattr(exc, "name", None), str(exc)]
print(json.dumps(errors))
"""


def python_files() -> list[str]:
    """Every .py file under benchmarks/, relative to the repository root."""
    return sorted(os.path.relpath(p, REPO)
                  for p in glob.glob(os.path.join(BENCHMARKS, "**", "*.py"), recursive=True))


def module_name(path: str) -> str:
    return path[:-3].replace(os.sep, ".").removesuffix(".__init__")


def test_nothing_patches_sys_path():
    patching = [p for p in python_files()
                if re.search(r"\bsys\.path\.(insert|append)\b", open(os.path.join(REPO, p)).read())]
    assert patching == [], (
        f"import through the package (from benchmarks.common import ...): {patching}")


def test_every_folder_is_a_package():
    folders = {os.path.dirname(p) for p in python_files()}
    missing = sorted(f for f in folders if not os.path.isfile(os.path.join(REPO, f, "__init__.py")))
    assert missing == [], f"folders under benchmarks/ without __init__.py: {missing}"


def test_benchmarks_live_in_a_group():
    flat = sorted(os.path.basename(p) for p in glob.glob(os.path.join(BENCHMARKS, "bench_*.py")))
    assert flat == [], f"move these into a group folder (benchmarks/engine/, tiers/, ...): {flat}"


def test_every_module_imports_from_the_repository_root():
    modules = [module_name(p) for p in python_files()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    child = subprocess.run([sys.executable, "-c", _CHILD, *modules], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=240)
    assert child.returncode == 0, child.stderr
    errors = json.loads(child.stdout.splitlines()[-1])
    assert sorted(errors) == sorted(modules)
    broken = {name: error for name, error in errors.items()
              if error and not (error[0] == "ModuleNotFoundError"
                                and (error[1] or "").split(".")[0] in OPTIONAL)}
    assert broken == {}, broken
    assert errors["benchmarks.engine.bench_engine"] is None
    assert errors["benchmarks.run"] is None
