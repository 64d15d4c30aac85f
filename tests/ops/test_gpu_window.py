"""The GPU window's dry run (`benchmarks/gpu_window.sh collect`) on CPU: every test marked
`cuda` is collected by marker over the whole tree and the GPU benchmarks import, so a
moved file, a stale path or a broken import is found here, not in a scarce GPU run."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_window.sh")


def collect(env_extra=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **(env_extra or {})}
    return subprocess.run(["bash", SCRIPT, "collect"], capture_output=True, text=True,
                          env=env, timeout=240)


@pytest.mark.slow
def test_collect_lists_every_cuda_marked_test_and_imports_the_gpu_benchmarks():
    proc = collect()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    count = re.search(r"^cuda tests: (\d+) in (\d+) files$", proc.stdout, re.M)
    assert count and int(count.group(1)) > 0, proc.stdout
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert len(ids) == int(count.group(1))
    # Tests that skip without a GPU are listed too (a module-level skip would hide them).
    files = {i.split("::")[0] for i in ids}
    assert {"tests/system/test_gpu_tier.py", "tests/client/hf/test_attention.py",
            "tests/client/blend/test_blend_hf.py", "tests/client/cuda/test_cuda.py"} <= files, files
    assert "benchmarks imported: engine.bench_cuda vllm.bench_vllm_worker" in proc.stdout


def test_collect_fails_on_a_benchmark_that_is_gone():
    proc = collect({"GPU_WINDOW_BENCHES": "engine.bench_cuda engine.bench_moved_away"})
    assert proc.returncode != 0
    assert "benchmarks/engine/bench_moved_away.py is gone" in proc.stderr, proc.stderr
    assert "cuda tests:" not in proc.stdout
