"""What a restart keeps, with a disk tier: prompts that hit after a stop and a start, the
stop's duration, the prewarm's duration and its cost to requests meanwhile.

Each scenario starts a daemon (`lmcached.launcher`) on a temporary directory under
--dir (default /var/tmp: a disk, not tmpfs), stores --prompts prompts of two chunks into
an arena that holds about --arena-share of them, waits for the disk writes, stops the
daemon, starts another on the same directory and name, and measures:

    stop_s        SIGTERM until the process exited (kill -9: the SIGKILL's wait)
    saved         chunks the stop wrote (the save on stop, from the log)
    prewarm_s     the restarted daemon's prewarm (INFO disk_prewarm_s), and its chunks
    arena_hits    prompts of the last `fit` (the arena holds `fit` prompts and the
                  probes) whose every chunk is in the arena once the prewarm ended:
                  looked up newest first, no disk fetch for them (INFO
                  disk_fetch_hit_chunks unchanged)
    hits          prompts hit whole, from the arena or the disk (lookups newest first,
                  --disk-fetch-wait 5), of --prompts
    lookup_ms     median LOOKUP + retrieve of 8 probe prompts stored after the restart
                  (in the arena), while the prewarm runs and after it ended

Scenarios: on-evict with the save on stop (the default), on-evict with
--disk-save-on-stop 0 (what a stop kept before the save existed), write-through, and
on-evict stopped by kill -9.

    python -m benchmarks.tiers.bench_restart [--prompts 100] [--arena-share 0.6] [--dir /var/tmp]
                                       [--out FILE.json]
"""

import argparse
import json
import os
import re
import shutil
import signal
import tempfile
import time

import torch


from benchmarks.common import daemon_info, machine_info, median, record_block_size
from lmcached import launcher
from lmcached.client import CacheEngine, KVLayout

LAYOUT = KVLayout("restart-bench", num_layers=4, num_kv_heads=4, head_size=64, chunk_size=256)
PROMPT_TOKENS = 2 * LAYOUT.chunk_size
PROBES = 8


def disk_info(socket: str) -> dict:
    return daemon_info(socket, "disk")["disk"]


def prompt(i: int) -> list[int]:
    return list(range(i * 100_000, i * 100_000 + PROMPT_TOKENS))


def kv_of(tokens: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens[0])
    return torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=gen).to(LAYOUT.torch_dtype)


def wait_until(check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.01)


def connect(socket: str) -> CacheEngine:
    return CacheEngine.connect(LAYOUT, socket=socket, strict=True, data_timeout_s=60)


def probe_ms(engine: CacheEngine, probes: list[list[int]]) -> float:
    started = time.perf_counter()
    for tokens in probes:
        assert engine.lookup(tokens) == PROMPT_TOKENS
        engine.retrieve(tokens, return_tuple=False)
    return (time.perf_counter() - started) * 1000 / len(probes)


def run_scenario(root: str, scenario: str, num_prompts: int, arena_share: float) -> dict:
    block = int(record_block_size(LAYOUT))
    fit = int(num_prompts * arena_share)
    capacity = 4096 + 2 * (fit + PROBES) * block  # room for the probes after the restart
    directory = tempfile.mkdtemp(prefix="restart-", dir=root)
    socket = os.path.join(tempfile.mkdtemp(prefix="lmcd-", dir="/tmp"), "d.sock")
    name = f"bench-restart-{os.getpid()}"
    policy = "write-through" if scenario == "write-through" else "on-evict"
    args = ["--capacity", str(capacity), "--block-size", str(block), "--disk-path",
            os.path.join(directory, "disk"), "--disk-capacity", str(8 * num_prompts * block),
            "--disk-policy", policy, "--disk-fetch-wait", "5"]
    save = ["--disk-save-on-stop", "0"] if scenario == "on-evict, no save" else []
    logs = [os.path.join(directory, f"{i}.log") for i in range(2)]
    proc = launcher.start_daemon(name, socket, *args, *save, log_path=logs[0])
    out = {"scenario": scenario, "prompts": num_prompts, "fit": fit,
           "chunk_bytes": LAYOUT.record_bytes(LAYOUT.chunk_size)}
    try:
        with connect(socket) as engine:
            for i in range(num_prompts):
                tokens = prompt(i)
                engine.store(tokens, kv_of(tokens))
        wait_until(lambda: not disk_info(socket)["disk_queue_values"])
        started = time.monotonic()
        if scenario == "kill -9":
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
        else:
            launcher.stop_daemon(proc, 60)
        out["stop_s"] = round(time.monotonic() - started, 3)
        with open(logs[0]) as f:
            saved = re.search(r"saved (\d+)(?: of \d+)? chunks of the arena", f.read())
        out["saved"] = int(saved[1]) if saved else 0
        started = time.monotonic()
        proc = launcher.start_daemon(name, socket, *args, log_path=logs[1])
        out["start_s"] = round(time.monotonic() - started, 3)
        with connect(socket) as engine:  # its HELLO plans the prewarm
            probes = [prompt(10_000 + i) for i in range(PROBES)]
            for tokens in probes:
                engine.store(tokens, kv_of(tokens))
            during = []
            while disk_info(socket)["disk_prewarm_state"] in ("idle", "running"):
                during.append(probe_ms(engine, probes))
                if len(during) > 10_000:
                    break
            info = disk_info(socket)
            out["prewarm_state"] = info["disk_prewarm_state"]
            out["prewarm_s"] = info["disk_prewarm_s"]
            out["prewarm_chunks"] = info["disk_prewarm_chunks"]
            after = [probe_ms(engine, probes) for _ in range(max(20, len(during)))]
            out["probe_ms_during_prewarm"] = round(median(during), 3) if during else None
            out["probe_samples_during_prewarm"] = len(during)
            out["probe_ms_after_prewarm"] = round(median(after), 3)
            fetched = info["disk_fetch_hit_chunks"]
            recent = [prompt(i) for i in range(num_prompts - 1, num_prompts - 1 - fit, -1)]
            arena_hits = 0
            for tokens in recent:
                before = disk_info(socket)["disk_fetch_hit_chunks"]
                hit = engine.lookup(tokens) == PROMPT_TOKENS
                arena_hits += hit and disk_info(socket)[
                    "disk_fetch_hit_chunks"] == before
            out["arena_hits_of_fit"] = arena_hits
            out["hits"] = sum(engine.lookup(prompt(i)) == PROMPT_TOKENS
                              for i in range(num_prompts - 1, -1, -1))
            out["disk_fetched_chunks"] = disk_info(socket)[
                "disk_fetch_hit_chunks"] - fetched
        launcher.stop_daemon(proc, 60)
    finally:
        if proc.poll() is None:
            launcher.stop_daemon(proc, 60)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(os.path.dirname(socket), ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--arena-share", type=float, default=0.6)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--out")
    opts = parser.parse_args()
    results = {"machine": machine_info(), "scenarios": []}
    for scenario in ("on-evict, save on stop", "on-evict, no save", "write-through",
                     "kill -9"):
        result = run_scenario(opts.dir, scenario, opts.prompts, opts.arena_share)
        print(json.dumps(result), flush=True)
        results["scenarios"].append(result)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
