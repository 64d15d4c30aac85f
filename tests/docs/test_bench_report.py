"""The benchmark report writes its figures before it draws anything.

A benchmark run takes minutes; its JSON must survive a machine without matplotlib
(`pip install .[test]` has none) or a plot that fails.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "benchmarks", "results", "2026-11-23-quick.json")

# Runs report.write_outputs in a child whose matplotlib import fails.
_CHILD = """
import json, sys
sys.modules["matplotlib"] = None
sys.path.insert(0, sys.argv[1])
from benchmarks import report
with open(sys.argv[2]) as f:
    results = json.load(f)
print(json.dumps(report.write_outputs(results, sys.argv[3], "run")))
"""


def test_results_written_without_matplotlib(tmp_path):
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, REPO, RESULTS, str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert "matplotlib is not installed; plots skipped" in child.stderr
    paths = json.loads(child.stdout.splitlines()[-1])
    assert sorted(paths) == ["json", "markdown"]
    with open(tmp_path / "run.json") as f:
        written = json.load(f)
    with open(RESULTS) as f:
        original = json.load(f)
    assert written["lmcached"] == original["lmcached"]
    assert "![" not in (tmp_path / "run.md").read_text()
    assert sorted(os.listdir(tmp_path)) == ["run.json", "run.md"]
