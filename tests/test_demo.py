"""The demo path end to end, in small: a daemon, 2 worker processes, a real transformer."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.mark.slow
def test_tiny_demo_shares_prefixes_across_processes_with_identical_outputs():
    lmcached = os.path.join(os.path.dirname(sys.executable), "lmcached")
    proc = subprocess.Popen([lmcached, "demo", "--size", "tiny", "--capacity", "64MiB", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["requests"] == 8 and summary["workers"] == 2
    assert summary["cross_process_hit_tokens"] > 0
    assert summary["outputs_identical"] is True
    assert summary["daemon"]["hits"] > 0 and summary["daemon"]["stores"] > 0
    assert summary["ttft_cold_median_s"] is not None and summary["ttft_warm_median_s"] is not None
    # progress and the per-request table went to stderr
    assert "worker 2 ready" in stderr and "cross-process hit tokens" in stderr
    # the demo (its daemon is named after the demo's pid) stopped its daemon and removed its segment
    assert not [s for s in os.listdir("/dev/shm") if s.startswith(f"lmcached.demo-{proc.pid}")]


def test_demo_refuses_a_single_worker():
    from lmcached.examples.demo import run_demo

    with pytest.raises(ValueError, match="at least 2 workers"):
        run_demo(num_workers=1)
