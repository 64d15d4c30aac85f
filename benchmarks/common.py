"""Shared pieces of the benchmark scripts: a private daemon, timing, report lines.

Benchmarks are not tests: they print figures and ratios against a baseline measured in
the same run (these machines are shared and noisy; ratios taken together hold).
"""

import contextlib
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Callable, Iterator

import torch

from lmcached.client.layout import KVLayout
from lmcached.launcher import temporary_daemon
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Info

GB = 1e9

# KV shapes of the benchmarks (bfloat16, chunk 256, vllm format).
# Llama-3-8B: 32 layers x 8 KV heads x 128 = 128 KiB per token, 32 MiB per chunk.
LLAMA_8B = KVLayout("llama-3-8b", num_layers=32, num_kv_heads=8, head_size=128,
                    dtype="bfloat16", chunk_size=256)
# A small model, Llama-3.2-1B: 16 layers x 8 KV heads x 64 = 32 KiB per token, 8 MiB per chunk.
LLAMA_1B = KVLayout("llama-3.2-1b", num_layers=16, num_kv_heads=8, head_size=64,
                    dtype="bfloat16", chunk_size=256)


@contextlib.contextmanager
def running_daemon(capacity: str, block_size: str | None = None,
                   name: str | None = None) -> Iterator[str]:
    """A private `lmcached serve` on a temp socket (lmcached.launcher); yields the socket path.

    The daemon is stopped by pid on exit whatever happens, its socket directory removed and
    any arena segment it left (only after a SIGKILL) unlinked.

    Args:
        capacity: arena size ("512MiB", "2GiB").
        block_size: --block-size (default: the chunk size of the first layout).
        name: daemon name (arena segment /lmcached.<name>.<gen>); default bench-<pid>.

    Its `--max-session-share` is 100: one session may fill the arena.
    """
    # One client at a time fills most of the arena here: the per-session cap (50% by
    # default, a guard among many clients) would refuse the longest stores.
    args = ["--capacity", capacity, "--log-level", "WARNING", "--max-session-share", "100"]
    if block_size:
        args += ["--block-size", block_size]
    with temporary_daemon(*args, name=name or f"bench-{os.getpid()}") as socket:
        yield socket


def record_block_size(layout) -> str:
    """`--block-size` for one chunk record of `layout` per block, rounded up to 4 KiB, as
    production sets it (a daemon that derives it cuts a record over several blocks when
    the arena holds fewer than 16 records, and views then copy the layers that cross a
    block boundary)."""
    return str(-(-layout.record_bytes(layout.chunk_size) // 4096) * 4096)


def write_results(results: dict, out_dir: str | None) -> None:
    """Print `results` as JSON, and write them to `out_dir`/results.json when given."""
    print(json.dumps(results, indent=2))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)


def daemon_info(socket: str, section: str | None = None) -> dict:
    """INFO of the daemon on `socket`: {section: {field: value}} (one admin round trip)."""
    with Connection(socket, timeout_s=30) as conn:
        hello(conn, "bench-info")
        return conn.request(Info(section)).sections


def summary(samples: list[float], nbytes: int | None = None) -> dict:
    """Median / p90 / min seconds of `samples` (and GB/s of the median if `nbytes`)."""
    out = {"median_s": median(samples), "p90_s": p90(samples), "min_s": min(samples),
           "n": len(samples), "samples_s": list(samples)}
    if nbytes:
        out["gbps"] = nbytes / out["median_s"] / GB
    return out


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0-100) of `samples`, linear interpolation."""
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def machine_info() -> dict:
    """What the figures were measured on: CPU, cores, memory, OS, libraries, load."""
    import numpy
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    threshold = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        tunables = subprocess.run(["/lib64/ld-linux-x86-64.so.2", "--list-tunables"],
                                  capture_output=True, text=True, timeout=10).stdout
        for line in tunables.splitlines():
            if line.startswith("glibc.cpu.x86_non_temporal_threshold:"):
                threshold = int(line.split(":")[1].split()[0], 16)
    memory = psutil.virtual_memory()
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "memory_bytes": memory.total,
        "available_bytes_at_start": memory.available,
        "kernel": platform.release(),
        "libc": " ".join(platform.libc_ver()),
        "x86_non_temporal_threshold_bytes": threshold,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "loadavg_at_start": os.getloadavg(),
    }


def synced(fn: Callable[[], object], device: str = "cuda") -> Callable[[], None]:
    """`fn` followed by a wait for the GPU's queued work (for timing CUDA copies); on
    "cpu" just `fn`."""
    def run() -> None:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    return run


def time_it(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None,
            warmup: int = 1) -> list[float]:
    """Seconds per call of `fn` over `repeat` runs (after `warmup`), `setup` untimed."""
    samples = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            samples.append(elapsed)
    return samples


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def p90(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=10)[-1] if len(samples) > 1 else samples[0]
