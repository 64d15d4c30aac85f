"""Device tiers without a GPU: what the tier machinery costs, on "fake" tiers (memfd
host memory behind the device-tier interface, `lmcached serve --gpu-backend fake`).
Ratios are to baselines measured in the same run. The GPU figures (device-to-device
copies, CUDA demotion) are benchmarks/engine/bench_cuda.py's, on a GPU.

    store/retrieve  CacheEngine.store (new tokens each time) and retrieve of a prompt
                    through a fake device tier against the same on the host arena, on
                    one daemon, used in turn, in a tier large enough that nothing is
                    demoted: the cost of block references, tier dispatch and the second
                    mapping (both are memcpy into shared memory)
    demotion        a tier filled past its size: demotion GB/s (INFO demoted_bytes /
                    demotion_busy_us, the worker thread's copy time) against one
                    np.copyto of the same bytes between two touched buffers
    loop            PING round trips of another process while demotions run (a burst
                    of stores into a full tier), against PINGs of an idle daemon: the
                    copy runs on the daemon's worker thread, never in its loop (both
                    share the daemon's GIL and this machine's 2 cores)

    python -m benchmarks.tiers.bench_tiers [--quick] [--json PATH]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch


from benchmarks.common import GB, machine_info, median, record_block_size
from lmcached.client import CacheEngine
from lmcached.client.layout import KVLayout
from lmcached.launcher import temporary_daemon
from lmcached.wire.connection import Connection
from lmcached.wire.protocol import Info, Ping

MiB = 1 << 20
LAYOUT = KVLayout("llama-3.2-1b", num_layers=16, num_kv_heads=8, head_size=64,
                  dtype="bfloat16", chunk_size=64)  # 2 MiB per chunk
DEVICE = "fake-0"


def stats(socket: str) -> dict:
    with Connection(socket, timeout_s=30) as conn:
        return conn.request(Info("stats")).sections["stats"]


def wait_demotions_done(socket: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with Connection(socket, timeout_s=30) as conn:
            blocks = conn.request(Info("blocks")).sections["blocks"]
        if not blocks.get("tier1_demoting_blocks"):
            return
        time.sleep(0.01)
    raise TimeoutError("demotions did not finish")


def store_retrieve(socket: str, tokens_per_prompt: int, repeat: int) -> dict:
    """Median GB/s of store and retrieve through the tier and through the host arena."""
    kv = torch.randn(LAYOUT.num_layers, 2, tokens_per_prompt, LAYOUT.num_kv_heads,
                     LAYOUT.head_size).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    out = torch.empty_like(kv)
    engines = {"tier": CacheEngine.connect(LAYOUT, socket=socket, strict=True, tier_device=DEVICE,
                                           data_timeout_s=30),
               "host": CacheEngine.connect(LAYOUT, socket=socket, strict=True, data_timeout_s=30)}
    times = {f"{where}_{op}": [] for where in engines for op in ("store", "retrieve")}
    next_token = 0
    for _ in range(repeat):
        for where, engine in engines.items():  # used in turn: the same machine conditions
            tokens = torch.arange(next_token, next_token + tokens_per_prompt)
            next_token += tokens_per_prompt
            start = time.perf_counter()
            stored = engine.store(tokens, kv)
            times[f"{where}_store"].append(time.perf_counter() - start)
            assert stored == tokens_per_prompt // LAYOUT.chunk_size, stored
            start = time.perf_counter()
            _, mask = engine.retrieve(tokens, return_tuple=False, out=out)
            times[f"{where}_retrieve"].append(time.perf_counter() - start)
            assert int(mask.sum()) == tokens_per_prompt and torch.equal(out, kv)
            wait_demotions_done(socket)
    where_refs = {where: [] for where in engines}
    for where, engine in engines.items():
        run = engine.acquire(torch.arange(next_token - tokens_per_prompt
                                          * (1 if where == "host" else 2),
                                          next_token - tokens_per_prompt
                                          * (0 if where == "host" else 1)))
        where_refs[where] = sorted({span[0] >> 32 for span in run.spans})
        run.release()
        engine.close()
    result = {"bytes": nbytes, "tiers_used": where_refs}
    for key, samples in times.items():
        result[key + "_gbps"] = round(nbytes / median(samples) / GB, 2)
    for op in ("store", "retrieve"):
        result[f"{op}_ratio_tier_to_host"] = round(
            result[f"tier_{op}_gbps"] / result[f"host_{op}_gbps"], 2)
    return result


def memcpy_gbps(nbytes: int, repeat: int = 5) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.ones(nbytes, np.uint8)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - start)
    return nbytes / median(samples) / GB


def pings(socket: str, seconds: float) -> list[float]:
    out = []
    with Connection(socket, timeout_s=30) as conn:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            conn.request(Ping())
            out.append(time.perf_counter() - start)
    return out


PINGER = """
import json, os, sys, time
from lmcached.wire.connection import Connection
from lmcached.wire.protocol import Ping
out = []
with Connection(sys.argv[1], timeout_s=30) as conn:
    while not os.path.exists(sys.argv[2]):
        start = time.perf_counter()
        conn.request(Ping())
        out.append(time.perf_counter() - start)
print(json.dumps(out))
"""


def demotion_and_loop(socket: str, num_chunks: int) -> dict:
    """Fill the tier many times over; measure demotion GB/s and PINGs meanwhile."""
    idle = pings(socket, 1.0)
    before = stats(socket)
    engine = CacheEngine.connect(LAYOUT, socket=socket, strict=True, tier_device=DEVICE,
                                 data_timeout_s=30)
    tokens_per_prompt = 8 * LAYOUT.chunk_size
    kv = torch.randn(LAYOUT.num_layers, 2, tokens_per_prompt, LAYOUT.num_kv_heads,
                     LAYOUT.head_size).to(torch.bfloat16)
    # Another process pings while this one stores: its latency is the daemon's loop's,
    # not this process's GIL (which the stores' copies hold at times).
    stop_file = f"/tmp/bench-tiers-stop-{os.getpid()}"
    pinger = subprocess.Popen([sys.executable, "-c", PINGER, socket, stop_file],
                              stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        for p in range(num_chunks // 8):
            engine.store(torch.arange(10**7 + p * tokens_per_prompt,
                                      10**7 + (p + 1) * tokens_per_prompt), kv)
        wait_demotions_done(socket)
    finally:
        open(stop_file, "w").close()
        out, _ = pinger.communicate(timeout=60)
        os.unlink(stop_file)
        engine.close()
    busy = json.loads(out)
    after = stats(socket)
    demoted = after["demoted_bytes"] - before["demoted_bytes"]
    busy_s = (after["demotion_busy_us"] - before["demotion_busy_us"]) / 1e6
    baseline = memcpy_gbps(64 * MiB)
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e6  # noqa: E731
    return {
        "demotions": after["demotions"] - before["demotions"],
        "demoted_bytes": demoted,
        "demotion_gbps": round(demoted / busy_s / GB, 2) if busy_s else None,
        "memcpy_gbps": round(baseline, 2),
        "demotion_ratio_to_memcpy": round(demoted / busy_s / GB / baseline, 2) if busy_s else None,
        "ping_idle_us": {"p50": round(q(idle, 50), 1), "p99": round(q(idle, 99), 1),
                         "n": len(idle)},
        "ping_during_demotion_us": {"p50": round(q(busy, 50), 1), "p99": round(q(busy, 99), 1),
                                    "n": len(busy)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke)")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    repeat = 3 if args.quick else 25
    block = record_block_size(LAYOUT)
    results = {"machine": machine_info(), "layout": "llama-3.2-1b, 64-token chunks (2 MiB)"}
    # A 1 GiB tier (511 chunks): every stored prompt fits, nothing is demoted.
    with temporary_daemon("--capacity", "2GiB", "--block-size", block, "--gpu-capacity",
                          "1GiB", "--gpu-backend", "fake", "--log-level", "WARNING",
                          name=f"bench-tiers-{os.getpid()}") as socket:
        print("store/retrieve, 1024-token prompts (32 MiB) ...", file=sys.stderr)
        results["store_retrieve"] = store_retrieve(socket, 1024, repeat)
    # A 256 MiB tier (127 chunks) filled 2.5 times over: demotions all along.
    with temporary_daemon("--capacity", "2GiB", "--block-size", block, "--gpu-capacity",
                          "256MiB", "--gpu-backend", "fake", "--log-level", "WARNING",
                          name=f"bench-tiers-{os.getpid()}") as socket:
        print("demotion and loop latency ...", file=sys.stderr)
        results["demotion"] = demotion_and_loop(socket, 320 if not args.quick else 160)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
