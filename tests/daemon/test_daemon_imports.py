"""Request semantics never load what only operations and exporters need: importing
`lmcached.daemon.service` loads no prometheus_client (metrics.py, with --metrics-port),
and the daemon's own modules import neither psutil nor click (INFO and CLIENTS import
psutil when they read /proc)."""

import ast
import pathlib
import subprocess
import sys

import lmcached.daemon

PROBE = "import sys, lmcached.daemon.service; print('prometheus_client' in sys.modules)"


def test_request_semantics_load_no_exporter_and_no_operations_package():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    prometheus_line = proc.stdout.splitlines()[-1]
    assert prometheus_line == "False", "import lmcached.daemon.service loaded prometheus_client"


def test_no_daemon_module_imports_psutil_click_or_prometheus_at_module_level():
    """Module-level imports only (a function may import psutil when it reads /proc);
    prometheus_client only in the exporter's modules."""
    daemon = pathlib.Path(lmcached.daemon.__file__).parent
    found = []
    for path in sorted(daemon.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                top = name.partition(".")[0]
                if top in ("psutil", "click") or (
                        top == "prometheus_client" and path.name != "metrics.py"):
                    found.append(f"{path.relative_to(daemon)}: {name}")
    assert found == []
