"""The benchmark suite: lmcached beside the memcpy limit, Redis and LMCache.

    python -m benchmarks.run [--quick] [--peers lmcache]      (make bench / make bench-quick)

One command, one run, every figure as a ratio to what was measured next to it (these
machines are shared and noisy: absolute times drift, ratios taken together hold). It
starts its own daemons on temp sockets and its own redis-server, stops them by pid, and
writes benchmarks/results/<date>[-quick].json (every sample, for later comparison),
<date>[-quick].md (the tables) and two PNG plots (bandwidth vs prompt length, latency vs
concurrent clients).

Scenarios (each op: median and p90 of --repeat runs after a warm-up run):
  1. the limit: np.copyto of the same bytes between touched buffers (bench_engine.py);
  2. lmcached: store cold, store of a stored prompt, lookup, retrieve (copy, into a touched
     buffer or allocating), retrieve_views, views+copy, cross-process retrieve
     (bench_engine.py's `bench_length`);
  3. Redis: a real redis-server (Debian's, installed if missing), TCP loopback, no
     persistence, redis-py + hiredis, chunks as bytes, pipelined (peers/redis_peer.py);
  4. LMCache (--peers lmcache): its in-process CPU engine and its multi-process server,
     in a separate venv (peers/lmcache_peer.py);
  5. scaling: 1, 2, 4, 8 client processes, 80% retrieve / 20% store, small arena
     (scaling.py);
  6. memory: daemon RSS and arena bytes before and after 10,000 store/evict cycles
     (memory.py).
KV shapes: Llama-3-8B (128 KiB/token) and Llama-3.2-1B (32 KiB/token), bf16, chunk 256;
prompts of 1k, 4k and 16k tokens (--quick: 1k and 4k, under 3 minutes on 2 cores).
"""

import argparse
import contextlib
import dataclasses
import datetime
import gc
import os
import shlex
import sys
import time
import traceback

import psutil
import torch

from benchmarks import RESULTS, module_env, report, report_targets
from benchmarks.engine.bench_engine import bench_length, filled_blob
from benchmarks.common import (
    LLAMA_1B,
    LLAMA_8B,
    machine_info,
    record_block_size,
    running_daemon,
    summary,
    time_it,
)
from lmcached.client import CacheEngine
from lmcached.wire.connection import Connection, hello
from lmcached.wire.protocol import Clear

SCENARIOS = ("engine", "redis", "scaling", "memory")
NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
NON_TEMPORAL_NOTE = (
    "Scenario 1 (memcpy) is one np.copyto of the whole prompt. glibc copies more than "
    "x86_non_temporal_threshold ({threshold}) with non-temporal stores, which run at "
    "~15-17 GB/s here, while copies of 32 MiB (one Llama-3-8B chunk) run at ~9.5-10 GB/s. "
    "The limit is reported as measured, so prompts above the threshold (Llama-3-8B at 4k "
    "and 16k tokens) have a higher limit than smaller ones; the engine copies chunk by chunk "
    "on 2 threads (ChunkCopier) to reach ~13-14 GB/s ('memcpy chunked' is that copy "
    "without the daemon)."
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def needed_bytes(prompt_bytes: int) -> int:
    """Memory one prompt length needs: source, destination, one allocating op, the
    cross-process writer's blob, the arena (1.25x) and Redis' copy, plus 1 GiB."""
    return int(prompt_bytes * 6.25) + (1 << 30)


def run_engine_and_redis(results: dict, plan: list, repeat: int, use_redis: bool) -> None:
    """Scenarios 1-3 for every shape and length of `plan` ([(KVLayout, [tokens])]).

    lmcached first, for every shape, then Redis: Redis frees gigabytes at each FLUSHALL,
    and the kernel hands freed pages back to the host in the background, which would
    slow the lmcached copies measured meanwhile.
    """
    _run_lmcached(results, plan, repeat)
    redis_info = results["peers"]["redis"]
    if not use_redis:
        redis_info.update(status="skipped", reason="--skip redis")
        return
    with contextlib.ExitStack() as stack:
        redis_client = _start_redis(stack, redis_info)
        if redis_client is not None:
            _run_redis(results, plan, repeat, redis_client, redis_info)


def _start_redis(stack: contextlib.ExitStack, redis_info: dict):
    """Start redis-server on `stack` (stopped when it closes); None if it cannot run."""
    from benchmarks.peers import redis_peer

    try:
        client = stack.enter_context(redis_peer.running_redis())
    except redis_peer.RedisUnavailable as exc:
        redis_info.update(status="skipped", reason=str(exc))
        log(f"Redis skipped: {exc}")
        return None
    redis_info.update(status="measured", versions=redis_peer.versions(client), data={}, notes=[
        "127.0.0.1 TCP, --save '' --appendonly no, one key per chunk, pipelined in batches of "
        "at most 512 MiB; store = contiguous copy of each chunk + SET; retrieve = GET + copy "
        "into a touched blob; lookup = one EXISTS of every key",
        "a cold store follows FLUSHALL, so Redis allocates (and the kernel first-touches) its "
        "memory again, as lmcached's cold store follows CLEAR into an arena prefaulted once"])
    probe = redis_peer.value_size_probe(client, time_it)
    redis_info["value_size_probe"] = probe
    redis_info["notes"].append(
        "value-size probe, 128 MiB pipelined without copies, SET / GET GB/s: " + ", ".join(
            f"{size >> 20} MiB values {p['set_gbps']:.2f} / {p['get_gbps']:.2f}"
            for size, p in probe.items()))
    log(f"Redis {redis_info['versions']['redis_server']}: {redis_info['notes'][-1]}")
    return client


def _run_lmcached(results: dict, plan: list, repeat: int) -> None:
    """Scenarios 1 and 2: bench_engine's ops per shape and length, one daemon per shape."""
    for layout, lengths in plan:
        shape = layout.model_name
        results["shapes"][shape] = {**dataclasses.asdict(layout), "token_bytes": layout.token_bytes,
                                    "kv_bytes_per_chunk": layout.chunk_size * layout.token_bytes}
        results["lmcached"][shape] = {}
        capacity_mib = max(lengths) * layout.token_bytes * 5 // 4 // 2**20 + 256
        log(f"{shape}: {layout.token_bytes // 1024} KiB/token, arena {capacity_mib} MiB, "
            f"lengths {lengths}")
        with running_daemon(f"{capacity_mib}MiB", record_block_size(layout)) as socket, \
                CacheEngine.connect(layout, socket=socket, strict=True) as engine, \
                Connection(socket) as admin:
            hello(admin, "bench-admin")
            for num_tokens in lengths:
                prompt_bytes = num_tokens * layout.token_bytes
                available = psutil.virtual_memory().available
                if available < needed_bytes(prompt_bytes):
                    reason = (f"{num_tokens} tokens need ~{needed_bytes(prompt_bytes) / 2**30:.1f} "
                              f"GiB, {available / 2**30:.1f} GiB available")
                    results["skipped"][f"{shape} @{num_tokens}"] = reason
                    log(f"skipped {shape} @{num_tokens}: {reason}")
                    continue
                src = filled_blob(num_tokens, 1.25, layout)
                dst = filled_blob(num_tokens, 0.0, layout)
                data = bench_length(engine, admin, socket, num_tokens, repeat, src, dst)
                admin.request(Clear())
                results["lmcached"][shape][str(num_tokens)] = {
                    "nbytes": prompt_bytes, "repeat": repeat,
                    "ops": {op: summary(samples,
                                        prompt_bytes if op in report_targets.MOVES_BYTES else None)
                            for op, samples in data["samples"].items()}}
                ops = results["lmcached"][shape][str(num_tokens)]["ops"]
                log(f"  lmcached {shape} @{num_tokens}: memcpy {ops['memcpy']['gbps']:.1f} GB/s, "
                    f"store {ops['store cold']['gbps']:.1f}, retrieve "
                    f"{ops['retrieve out=']['gbps']:.1f}, cross-process "
                    f"{ops['cross-process']['gbps']:.1f}, views "
                    f"{ops['views']['median_s'] * 1e3:.3f} ms")
                del src, dst, data
                gc.collect()


def _run_redis(results: dict, plan: list, repeat: int, client, redis_info: dict) -> None:
    """Scenario 3: Redis store / lookup / retrieve for every length lmcached measured."""
    from benchmarks.peers import redis_peer

    for layout, lengths in plan:
        shape = layout.model_name
        for num_tokens in lengths:
            if str(num_tokens) not in results["lmcached"].get(shape, {}):
                continue
            prompt_bytes = num_tokens * layout.token_bytes
            src = filled_blob(num_tokens, 1.25, layout)
            dst = filled_blob(num_tokens, 0.0, layout)
            try:
                data = redis_peer.bench_length(client, layout, num_tokens, repeat, src, dst,
                                               time_it)
                redis_info["data"].setdefault(shape, {})[str(num_tokens)] = {
                    "nbytes": prompt_bytes, "repeat": repeat,
                    "ops": {op: summary(s, None if op == "lookup" else prompt_bytes)
                            for op, s in data["samples"].items()}}
                ops = redis_info["data"][shape][str(num_tokens)]["ops"]
                log(f"  Redis {shape} @{num_tokens}: store {ops['store']['gbps']:.2f} GB/s, "
                    f"retrieve {ops['retrieve']['gbps']:.2f} GB/s")
            except Exception as exc:  # a peer's failure is reported, not fatal
                redis_info.setdefault("errors", []).append(
                    f"{shape} @{num_tokens}: {type(exc).__name__}: {exc}")
                log(f"  Redis {shape} @{num_tokens} failed: {exc}")
            finally:
                del src, dst
                gc.collect()


def run_lmcache(results: dict, plan: list, repeat: int, venv: str) -> None:
    """Scenario 4: LMCache's in-process engine and multi-process server (own venv)."""
    from benchmarks.peers import lmcache_peer

    inproc = results["peers"]["lmcache_inproc"]
    server = results["peers"]["lmcache_server"]
    try:
        python = lmcache_peer.ensure_venv(venv)
        versions = lmcache_peer.versions(python)
    except lmcache_peer.LMCacheUnavailable as exc:
        for peer in (inproc, server):
            peer.update(status="failed", reason=str(exc))
        log(f"LMCache unavailable: {exc}")
        return
    for peer in (inproc, server):
        peer.update(versions={**versions, "venv": venv}, data={}, notes=[])
    inproc["notes"].append(
        "LMCache 0.5.6 ships GPU connectors only (CUDA/XPU/HPU/MUSA); its engine ran with a "
        "CPU connector written for this benchmark (peers/lmcache_inproc.py) that copies with "
        "np.copyto, as lmcached does, into LMCache's KV_2LTD memory objects; local CPU backend. "
        "An in-process cache is one copy into the process' own memory, shared with no other "
        "process: both run at the copy routine's speed, so no cache can be 3x faster than it; "
        "the multi-process server is the like-for-like peer")
    server["notes"].append(
        "`lmcache server` (ZMQ, L1 DRAM, LRU, --eviction-ratio 0.5, --l1-read-ttl-seconds 1), "
        "a fresh one per length, driven by LMCache's own client `lmcache bench server --mode cpu "
        "--transfer-mode lmcache_driven` (the worker's paged KV, 16-token pages as vLLM's, lives "
        "in POSIX shm that the server reads and writes); latencies from its log; first "
        "sequence of each length is a warm-up")
    fitting = []
    for layout, lengths in plan:
        keep = [n for n in lengths if psutil.virtual_memory().available
                > n * layout.token_bytes * 4.5 + (2 << 30)]
        for n in sorted(set(lengths) - set(keep)):
            results["skipped"][f"LMCache {layout.model_name} @{n}"] = "not enough free memory"
        if keep:
            fitting.append((layout, keep))
    log("LMCache in-process engine ...")
    try:
        shapes = lmcache_peer.run_inproc(python, fitting, repeat)
        for shape, by_tokens in shapes.items():
            for tokens, entry in by_tokens.items():
                if tokens == "local_cpu_gib":
                    continue
                nbytes = entry["nbytes"]
                inproc["data"].setdefault(shape, {})[tokens] = {
                    "nbytes": nbytes, "repeat": repeat,
                    "ops": {op: summary(s, None if op in ("lookup", "store existing") else nbytes)
                            for op, s in entry["samples"].items() if op != "memcpy"},
                    "memcpy_in_process": summary(entry["samples"]["memcpy"], nbytes)}
                ops = inproc["data"][shape][tokens]["ops"]
                log(f"  LMCache in-process {shape} @{tokens}: store {ops['store cold']['gbps']:.2f} "
                    f"GB/s, retrieve {ops['retrieve']['gbps']:.2f} GB/s")
        inproc["status"] = "measured"
    except lmcache_peer.LMCacheUnavailable as exc:
        inproc.update(status="failed", reason=str(exc))
        log(f"LMCache in-process failed: {exc}")
    server["status"] = "measured"
    for layout, lengths in fitting:
        log(f"LMCache server, {layout.model_name} ...")
        try:
            data = lmcache_peer.run_server(python, layout, lengths, repeat)
        except lmcache_peer.LMCacheUnavailable as exc:
            server.setdefault("errors", []).append(f"{layout.model_name}: {exc}")
            server["reason"] = "; ".join(server["errors"])
            log(f"LMCache server {layout.model_name} failed: {exc}")
            continue
        for tokens, entry in data.items():
            ops = {op: summary(s, None if op == "lookup" else entry["nbytes"])
                   for op, s in entry["samples"].items() if s}
            server["data"].setdefault(layout.model_name, {})[tokens] = {
                "nbytes": entry["nbytes"], "repeat": len(entry["samples"]["store cold"]),
                "ops": ops, **{k: entry[k] for k in ("dropped_stores", "failed", "l1_gib",
                                                      "server_rss_bytes_idle", "server_rss_bytes")}}
            counts = ", ".join(f"{len(s)} {op}" for op, s in entry["samples"].items())
            server["notes"].append(
                f"{layout.model_name} @{tokens}: L1 {entry['l1_gib']:g} GiB, server RSS "
                f"{entry['server_rss_bytes'] / 2**30:.1f} GiB; timed {counts}"
                + (f"; {entry['dropped_stores']} STOREs dropped by the server (L1 full: replied "
                   f"'stored' in ~3 ms, kept nothing; not timed)" if entry["dropped_stores"] else "")
                + (f"; failures: {entry['failed']}" if entry["failed"] else ""))
    if not server["data"]:
        server["status"] = "failed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--quick", action="store_true",
                        help="1k and 4k tokens, shorter scaling rounds (under 3 minutes)")
    parser.add_argument("--peers", nargs="*", default=[], choices=["lmcache"],
                        help="optional peers to measure too (Redis always runs)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per op [5]")
    parser.add_argument("--tokens", type=int, nargs="+", help="prompt lengths (overrides the mode)")
    parser.add_argument("--skip", nargs="*", default=[], choices=SCENARIOS,
                        help="scenarios to leave out (for development runs)")
    parser.add_argument("--out-dir", default=RESULTS)
    parser.add_argument("--lmcache-venv", default=os.environ.get("LMCACHE_VENV", "/tmp/lmcache-venv"))
    parser.add_argument("--stem", help="output file name stem [<date> or <date>-quick]")
    parser.add_argument("--glibc-nt-threshold", metavar="BYTES",
                        help="run with GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=BYTES "
                             "(e.g. 0x20000): memcpy calls above it use non-temporal stores; "
                             "the process re-executes itself with it, and every process it starts "
                             "inherits it")
    args = parser.parse_args()
    if args.glibc_nt_threshold and NT_TUNABLE not in os.environ.get("GLIBC_TUNABLES", ""):
        tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
        tunables.append(f"{NT_TUNABLE}={args.glibc_nt_threshold}")
        os.environ["GLIBC_TUNABLES"] = ":".join(tunables)
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.run"] + sys.argv[1:],
                  module_env())
    if args.repeat < 5:
        print("note: issue 6 asks for >= 5 repetitions", file=sys.stderr)
    torch.set_num_threads(2)
    started = time.monotonic()
    cpu_start = _cpu_seconds()
    now = datetime.datetime.now()
    mode = "quick" if args.quick else "full"
    lengths = args.tokens or ([1024, 4096] if args.quick else [1024, 4096, 16384])
    plan = [(LLAMA_8B, lengths), (LLAMA_1B, lengths)]
    machine = machine_info()
    threshold = machine["x86_non_temporal_threshold_bytes"]
    results = {
        "meta": {
            "date": now.strftime("%Y-%m-%d"), "time": now.strftime("%H:%M:%S"), "mode": mode,
            "command": "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "machine": machine, "repeat": args.repeat,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
            "notes": [NON_TEMPORAL_NOTE.format(
                threshold=f"{threshold / 2**20:.0f} MiB" if threshold else "unknown")],
        },
        "shapes": {}, "lmcached": {}, "skipped": {}, "errors": [],
        "peers": {"redis": {"status": "not run"},
                  "lmcache_inproc": {"status": "not run (use --peers lmcache)"},
                  "lmcache_server": {"status": "not run (use --peers lmcache)"}},
    }
    if os.environ.get("GLIBC_TUNABLES"):
        results["meta"]["notes"].append(
            f"This run set GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']} (--glibc-nt-threshold): "
            "every memcpy above that size, numpy's per-run copies of a chunk included, uses "
            "non-temporal stores, in this process and every process it started.")
    log(f"lmcached benchmarks ({mode}): {machine['cpu']}, {machine['num_cpus']} CPUs, "
        f"{machine['available_bytes_at_start'] / 2**30:.1f} GiB available, load "
        f"{machine['loadavg_at_start'][0]:.2f}")
    failed = False
    if "engine" not in args.skip:
        try:
            run_engine_and_redis(results, plan, args.repeat, "redis" not in args.skip)
        except Exception:
            failed = True
            results["errors"].append(f"lmcached engine scenario: {traceback.format_exc()}")
            log(results["errors"][-1])
    if "lmcache" in args.peers:
        run_lmcache(results, plan, args.repeat, args.lmcache_venv)
    if "scaling" not in args.skip:
        from benchmarks import scaling

        log("scaling: 1, 2, 4, 8 client processes ...")
        try:
            results["scaling"] = scaling.run_scaling(LLAMA_1B, num_tokens=4096,
                                                     duration_s=3.0 if args.quick else 8.0)
        except Exception:
            failed = True
            results["scaling"] = {"error": traceback.format_exc()}
            log(results["scaling"]["error"])
    if "memory" not in args.skip:
        from benchmarks import memory

        log("memory: 10,000 store/evict cycles ...")
        try:
            results["memory"] = memory.run_memory(num_cycles=10_000)
        except Exception:
            failed = True
            results["memory"] = {"error": traceback.format_exc()}
            log(results["memory"]["error"])
    machine["loadavg_at_end"] = os.getloadavg()
    results["meta"]["duration_s"] = time.monotonic() - started
    busy_s, ours_s = (end - start for end, start in zip(_cpu_seconds(), cpu_start))
    results["meta"]["cpu_seconds"] = {"all": busy_s, "this_run": ours_s,
                                      "others": max(0.0, busy_s - ours_s)}
    _note_disturbance(results)
    report_targets.compute_ratios(results)
    results["targets"] = report_targets.evaluate_targets(results)
    stem = args.stem or (results["meta"]["date"] + ("-quick" if args.quick else ""))
    paths = report.write_outputs(results, args.out_dir, stem)
    print()
    print(report.render(results, markdown=False))
    print()
    log("wrote " + ", ".join(os.path.relpath(p) for p in paths.values()))
    return 1 if failed else 0


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this run: this process and
    the children it has waited for: daemons, redis-server, LMCache, client processes)."""
    total = psutil.cpu_times()
    busy = total.user + total.nice + total.system + getattr(total, "irq", 0) + \
        getattr(total, "softirq", 0)
    ours = psutil.Process().cpu_times()
    return busy, ours.user + ours.system + ours.children_user + ours.children_system


def _note_disturbance(results: dict) -> None:
    """Add a note when the memcpy limit was well below this machine's usual figures, and
    say how much CPU other processes used during the run."""
    machine = results["meta"]["machine"]
    cpu = results["meta"]["cpu_seconds"]
    share = cpu["others"] / (results["meta"]["duration_s"] * machine["num_cpus"])
    results["meta"]["notes"].append(
        f"Other processes on this machine used {cpu['others']:.0f} CPU-seconds during the run "
        f"({share:.0%} of its {machine['num_cpus']} CPUs); this run used {cpu['this_run']:.0f}.")
    low = []
    for shape, by_tokens in results["lmcached"].items():
        for tokens, entry in by_tokens.items():
            gbps = entry["ops"]["memcpy"]["gbps"]
            expected = 15.0 if entry["nbytes"] > (machine["x86_non_temporal_threshold_bytes"] or 0) else 9.5
            if gbps < 0.8 * expected:
                low.append(f"{shape} @{tokens}: {gbps:.1f} GB/s (usually ~{expected:g})")
    load = (f"load average {machine['loadavg_at_start'][0]:.2f} at start, "
            f"{machine['loadavg_at_end'][0]:.2f} at end, this run's own processes included")
    busy = share > 0.05
    if low:
        cause = ("other processes were busy on this machine" if busy else
                 "other processes here were idle: the host is shared, and other guests' "
                 "memory traffic does not show here")
        results["meta"]["notes"].append(
            "memcpy ran below its usual speed at " + "; ".join(low) + f" ({cause}; {load}). "
            "Ratios measured together still hold.")
    else:
        results["meta"]["notes"].append(f"memcpy ran at its usual speed ({load}).")


if __name__ == "__main__":
    sys.exit(main())
