"""The demo: its headline on constructed numbers, and the whole path in small (a daemon,
2 worker processes, a real transformer)."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lmcached.examples.demo import print_summary, speedup_headline, summarize  # noqa: E402


def _result(request_id: str, cached_tokens: int, ttft_s: float, ttft_no_cache_s: float) -> dict:
    """One worker result as `worker_main` sends it."""
    return {"event": "result", "worker": 1, "id": request_id, "prompt_tokens": 1300,
            "cached_tokens": cached_tokens, "cross_process_tokens": 0, "ttft_s": ttft_s,
            "ttft_no_cache_s": ttft_no_cache_s, "identical": True, "max_logit_diff": 0.0}


INFO = {"stats": {"hits": 10, "misses": 5, "stores": 5, "evictions": 0, "connections_received": 3},
        "memory": {"stored_bytes": 112407347, "stored_human": "107.20M"}}


def test_headline_compares_the_same_prompts_not_the_cold_ones():
    # The run: the cold prompts (other prompts) had a median of 7.26 s, the warm
    # ones 0.875 s with lmcached and 5.788 s without it. 8.3x would be against the cold
    # prompts; against the same prompts it is 6.6x.
    results = [
        _result("g0-q0", 0, 7.26, 7.30), _result("g1-q1", 0, 7.00, 7.10),
        _result("g2-q2", 0, 7.50, 7.40),
        _result("g0-q5", 1024, 0.875, 5.788), _result("g1-q6", 1024, 0.80, 5.70),
        _result("g0-q2", 1024, 0.90, 5.90),
    ]
    summary = summarize(results, INFO, num_workers=2, wall_s=60.0)
    assert summary["ttft_warm_median_s"] == pytest.approx(0.875)
    assert summary["ttft_warm_no_cache_median_s"] == pytest.approx(5.788)
    assert summary["ttft_warm_speedup"] == pytest.approx(5.788 / 0.875)
    assert summary["ttft_cold_median_s"] == pytest.approx(7.26)
    assert summary["headline"] == (
        "875 ms median with lmcached, 5788 ms for the same 3 prompts without it: 6.6x faster"
    )


def test_headline_says_slower_when_the_cache_is_slower():
    # `--size tiny` in the issue: 253 ms with the cache, 170 ms without.
    headline = speedup_headline(0.253, 0.170, 5)
    assert headline == "253 ms median with lmcached, 170 ms for the same 5 prompts without it: 1.5x slower"
    assert "faster" not in headline


@pytest.mark.parametrize("ttft_s, no_cache_s, verdict", [
    (0.100, 0.102, "1.02x faster"),
    (0.102, 0.100, "1.02x slower"),
    (0.100, 0.100, "as fast"),
    (0.100, 0.250, "2.5x faster"),
])
def test_headline_verdict_near_and_far_from_one(ttft_s, no_cache_s, verdict):
    assert speedup_headline(ttft_s, no_cache_s, 2).endswith(": " + verdict)


def test_headline_without_a_cached_prefix_compares_nothing():
    summary = summarize([_result("g0-q0", 0, 1.0, 1.0)], INFO, num_workers=2, wall_s=1.0)
    assert summary["ttft_warm_speedup"] is None
    assert summary["headline"] == "no prompt found a cached prefix: nothing to compare"


def test_summary_prints_the_headline_first_and_explains_stored():
    results = [_result("g0-q0", 0, 2.0, 2.0), _result("g0-q1", 512, 0.5, 2.2)]
    lines = []
    print_summary(summarize(results, INFO, num_workers=2, wall_s=9.0), lines.append)
    text = [line for line in lines if line]
    assert text[0].startswith("TTFT with a cached prefix") and text[0].endswith("4.4x faster")
    assert "stored=107.20M" in "\n".join(lines)
    assert any("stored: KV bytes held" in line and "MiB" in line for line in lines)


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
    # The printed headline says what the JSON's same-prompt medians say.
    faster = summary["ttft_warm_median_s"] < summary["ttft_warm_no_cache_median_s"]
    headline = next(line for line in stderr.splitlines() if line.startswith("TTFT with a cached"))
    assert re.search(r"x faster$" if faster else r"(x slower|as fast)$", headline), headline
    # progress of each worker's start, a legend line per column, then the table and summary
    for worker in (1, 2):
        assert f"worker {worker}: building the 2-layer model" in stderr
        assert f"worker {worker} ready" in stderr
    for column in ("worker", "request", "prompt", "cached", "cross", "TTFT ms", "no-cache", "same"):
        assert re.search(rf"^  {re.escape(column)} +\S", stderr, re.MULTILINE), column
    assert "cross-process hit tokens" in stderr
    # no library warning among the table's lines (transformers' deprecations)
    assert not re.search(r"deprecat|Warning\b", stderr, re.IGNORECASE), stderr
    # the demo (its daemon is named after the demo's pid) stopped its daemon and removed its segment
    assert not [s for s in os.listdir("/dev/shm") if s.startswith(f"lmcached.demo-{proc.pid}")]


def test_demo_refuses_a_single_worker():
    from lmcached.examples.demo import run_demo

    with pytest.raises(ValueError, match="at least 2 workers"):
        run_demo(num_workers=1)
