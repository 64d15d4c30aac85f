"""Figures for the vLLM connector on CPU (one vLLM process at a time, in-process mode).

    .venv-vllm/bin/python -m benchmarks.vllm.bench_vllm --out-dir /tmp/lmc-measure [--rounds 2]
        [--salted-only]

Starts its own daemon (stopped at the end) and runs tests/vllm_e2e.py instances:
    1. instance A (connector) computes prompts whose 1792-token prefixes B shares;
    2. instance B (connector), a new process: TTFT per prompt, tokens served by lmcached;
    3. instance B without the connector: TTFT per prompt (everything computed);
    4. per-step time when nothing hits: fresh prompts with and without the connector,
       alternated --rounds times (every prompt is new, so the connector only stores);
    5. the salted round (tenants by cache salt): instance A under salt "tenant-a" computes
       the prompts, then B's TTFT under the same salt and under another one ("tenant-b"),
       against B without the connector, and the connector's time per step with salted
       fresh prompts against unsalted ones, alternated --rounds times (--salted-only: this
       round alone, ~2 minutes).
Prints one JSON object and writes it to OUT_DIR/figures.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

from benchmarks import REPO
from benchmarks.common import daemon_info
from lmcached.launcher import temporary_daemon

E2E = os.path.join(REPO, "tests", "vllm_e2e.py")


def instance(out_dir: str, name: str, model: str, prompts, socket=None, **opts) -> dict:
    prompts_path, out_path = (os.path.join(out_dir, f"{name}.in.json"),
                              os.path.join(out_dir, f"{name}.json"))
    with open(prompts_path, "w") as f:
        json.dump(prompts, f)
    cmd = [sys.executable, E2E, "run", "--model", model, "--prompts", prompts_path,
           "--out", out_path]
    if socket:
        cmd += ["--socket", socket]
    for key, value in opts.items():
        cmd += [f"--{key.replace('_', '-')}"] + ([str(value)] if value != "" else [])
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with open(os.path.join(out_dir, f"{name}.log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True,
                       timeout=600)
    with open(out_path) as f:
        return json.load(f)


def per_step_ms(run: dict) -> float:
    """Median over generate() calls (the first, a warm-up, left out) of time per step."""
    calls = list(zip(run["generate_s"], run["num_steps"]))[1:]
    return 1000 * statistics.median(t / n for t, n in calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--salted-only", action="store_true", help="the salted round alone")
    args = parser.parse_args()
    out = os.path.abspath(args.out_dir)
    os.makedirs(out, exist_ok=True)
    model = os.path.join(out, "model")
    if not os.path.exists(os.path.join(out, "model", "config.json")):
        subprocess.run([sys.executable, E2E, "build-model", model], check=True, timeout=600)
    with temporary_daemon("--capacity", "512MiB", name=f"bench-vllm-{os.getpid()}") as socket:
        figures = {} if args.salted_only else measure(out, model, socket, args.rounds)
        figures["salted"] = measure_salted(out, model, socket, args.rounds)
    print(json.dumps(figures, indent=1))
    with open(os.path.join(out, "figures.json"), "w") as f:
        json.dump(figures, f, indent=1)
    return 0


def measure(out: str, model: str, socket: str, rounds: int) -> dict:
    rng = np.random.default_rng(1)
    new = lambda n: rng.integers(3, 1000, n).tolist()  # noqa: E731
    prefixes = [new(1792) for _ in range(8)]  # 7 chunks of 256 tokens
    prompts_a = [p + new(64) for p in prefixes]
    prompts_b = [p + new(64) for p in prefixes]
    instance(out, "a", model, prompts_a, socket, max_tokens=8)
    stored = daemon_info(socket, "stats")["stats"]["stores"]
    with_cache = instance(out, "b", model, prompts_b, socket, mode="ttft")
    hits = daemon_info(socket, "stats")["stats"]["hits"]
    without = instance(out, "b-nocache", model, prompts_b, mode="ttft")
    num_prompt_tokens = sum(len(p) for p in prompts_b)
    served = sum(with_cache["num_cached_tokens"])
    figures = {
        "b_prompt_tokens": num_prompt_tokens,
        "b_tokens_from_lmcached": served,
        "b_tokens_recomputed": num_prompt_tokens - served,
        "daemon_stores_after_a": stored,
        "daemon_hits_after_b": hits,
        "b_ttft_ms_median_with_connector": 1000 * statistics.median(with_cache["ttft_s"]),
        "b_ttft_ms_median_without_connector": 1000 * statistics.median(without["ttft_s"]),
        "b_ttft_ms_with_connector": [round(1000 * t, 1) for t in with_cache["ttft_s"]],
        "b_ttft_ms_without_connector": [round(1000 * t, 1) for t in without["ttft_s"]],
    }
    step_ms = {"with": [], "without": []}
    hook_ms, hook_share = [], []
    for round_ in range(rounds):
        for kind in ("without", "with"):
            fresh = [new(600) for _ in range(20)]  # never seen: nothing can hit
            opts = dict(batch=4, max_tokens=32)
            if kind == "with":
                opts["time_hooks"] = ""
            run = instance(out, f"steps-{kind}-{round_}", model, fresh,
                           socket if kind == "with" else None, **opts)
            assert not any(run["num_cached_tokens"]), "a fresh prompt hit"
            step_ms[kind].append(per_step_ms(run))
            if kind == "with":
                calls = list(zip(run["connector_s"], run["num_steps"], run["generate_s"]))[1:]
                hook_ms.append(1000 * statistics.median(c / n for c, n, _ in calls))
                hook_share.append(statistics.median(c / g for c, _, g in calls))
    figures["step_ms_without_connector"] = step_ms["without"]
    figures["step_ms_with_connector_no_hits"] = step_ms["with"]
    figures["step_time_ratio"] = (statistics.median(step_ms["with"])
                                  / statistics.median(step_ms["without"]))
    figures["connector_ms_per_step_no_hits"] = hook_ms
    figures["connector_share_of_step_time"] = hook_share
    return figures


def measure_salted(out: str, model: str, socket: str, rounds: int) -> dict:
    """Step 5 of the module docstring: what a tenant gains from its own salt, what
    another tenant gets (nothing: it computes everything), and what a salt costs."""
    rng = np.random.default_rng(2)
    new = lambda n: rng.integers(3, 1000, n).tolist()  # noqa: E731
    prefixes = [new(1792) for _ in range(8)]
    prompts_a = [p + new(64) for p in prefixes]
    prompts_b = [p + new(64) for p in prefixes]
    instance(out, "salted-a", model, prompts_a, socket, max_tokens=8, cache_salt="tenant-a")
    same = instance(out, "salted-b-same", model, prompts_b, socket, mode="ttft",
                    cache_salt="tenant-a")
    other = instance(out, "salted-b-other", model, prompts_b, socket, mode="ttft",
                     cache_salt="tenant-b")
    without = instance(out, "salted-b-nocache", model, prompts_b, mode="ttft",
                       cache_salt="tenant-a")
    median_ms = lambda run: 1000 * statistics.median(run["ttft_s"])  # noqa: E731
    figures = {
        "b_tokens_from_lmcached_same_salt": sum(same["num_cached_tokens"]),
        "b_tokens_from_lmcached_other_salt": sum(other["num_cached_tokens"]),
        "b_ttft_ms_median_same_salt": median_ms(same),
        "b_ttft_ms_median_other_salt": median_ms(other),
        "b_ttft_ms_median_without_connector": median_ms(without),
        "ttft_ratio_same_salt_vs_without": median_ms(same) / median_ms(without),
        "ttft_ratio_other_salt_vs_without": median_ms(other) / median_ms(without),
        "daemon_salted_hits": daemon_info(socket, "stats")["stats"]["salted_hits"],
    }
    hook_ms = {"unsalted": [], "salted": []}
    for round_ in range(rounds):
        for kind in ("unsalted", "salted"):
            fresh = [new(600) for _ in range(20)]  # never seen: nothing can hit
            opts = dict(batch=4, max_tokens=32, time_hooks="")
            if kind == "salted":
                opts["cache_salt"] = f"tenant-{round_}"
            run = instance(out, f"salted-steps-{kind}-{round_}", model, fresh, socket, **opts)
            assert not any(run["num_cached_tokens"]), "a fresh prompt hit"
            calls = list(zip(run["connector_s"], run["num_steps"]))[1:]
            hook_ms[kind].append(1000 * statistics.median(c / n for c, n in calls))
    figures["connector_ms_per_step_unsalted_no_hits"] = hook_ms["unsalted"]
    figures["connector_ms_per_step_salted_no_hits"] = hook_ms["salted"]
    figures["connector_step_cost_ratio_salted_vs_unsalted"] = (
        statistics.median(hook_ms["salted"]) / statistics.median(hook_ms["unsalted"]))
    return figures


if __name__ == "__main__":
    sys.exit(main())
