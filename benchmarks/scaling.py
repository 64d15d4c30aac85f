"""Scenario 5: 1, 2, 4, 8 client processes against one daemon in a small arena.

Why this file exists: a node cache serves many processes at once. Each client process
(multiprocessing 'spawn', its own CacheEngine and HELLO) runs a closed loop for a fixed
time: 80% retrieve (copy, into a touched buffer) of one of a few shared prefixes that
the parent stored, 20% store of a prompt nobody stored before. The arena holds only a
few more prompts than the shared prefixes plus what 8 clients pin and write at once, so
stores evict all the time (constant eviction). A retrieve that finds only part of its
prefix (evicted meanwhile) is followed by a store of the missing chunks, as a serving
engine stores what it had to recompute ("repair", counted apart). Reported per number of
clients: aggregate GB/s (bytes retrieved + bytes stored, all clients, over the wall
time), request latency p50 / p99 per op (retrieve latencies of full hits), the daemon's
CPU (psutil, 100% = one core) and RSS, hit ratio and errors (exceptions, record
verification failures, daemon error replies: must be zero).

The workers are spawned once and take part in each round as it asks: the 5-6 s start of
a process that imports torch is paid once, not per round.
"""

import dataclasses
import multiprocessing
import queue
import time

import numpy as np
import psutil

from benchmarks.common import GB, daemon_info, percentile, record_block_size, running_daemon

SHARED_PREFIX_OFFSET = 50_000_000
NEW_PROMPT_OFFSET = 1_000_000_000
READY_TIMEOUT_S = 300.0


def worker_main(index: int, socket: str, layout_fields: dict, num_tokens: int,
                num_prefixes: int, commands, results) -> None:
    """One client process: connect, then run each round it is sent (None ends it)."""
    import torch

    from lmcached.client import CacheEngine, KVLayout
    from lmcached.client.kv_io import new_kv_buffer

    try:
        layout = KVLayout(**layout_fields)
        engine = CacheEngine.connect(layout, socket=socket, strict=True,
                                     name=f"bench-scaling-{index}")
        src = new_kv_buffer(layout.chunk_shape(num_tokens), layout.torch_dtype)
        src.fill_(0.75)
        dst = new_kv_buffer(layout.chunk_shape(num_tokens), layout.torch_dtype)
        dst.fill_(0.0)
        prefixes = [torch.arange(num_tokens) + SHARED_PREFIX_OFFSET * (p + 1)
                    for p in range(num_prefixes)]
        results.put(("ready", index, None))
    except BaseException as exc:  # report, never hang the parent
        results.put(("error", index, repr(exc)))
        return
    next_prompt = 0
    while True:
        command = commands.get()
        if command is None:
            break
        round_id, start_at, duration_s, seed, read_fraction, period_s = command
        rng = np.random.default_rng(seed)
        next_start = start_at + (rng.uniform(0, period_s) if period_s else 0.0)
        ops, errors = [], []
        verify_before, nospace_before = engine.num_verify_failures, engine.num_nospace_chunks
        while time.monotonic() < start_at:
            time.sleep(0.001)
        end_at = start_at + duration_s
        while time.monotonic() < end_at:
            if period_s:  # paced: one request per period, never catching up
                delay = next_start - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                next_start = max(time.monotonic(), next_start) + period_s
                if time.monotonic() >= end_at:
                    break
            kind = "retrieve" if rng.random() < read_fraction else "store"
            t0 = time.monotonic()
            try:
                if kind == "retrieve":
                    tokens = prefixes[int(rng.integers(num_prefixes))]
                    _, ret_mask = engine.retrieve(tokens, return_tuple=False, out=dst)
                    done_tokens = int(ret_mask.sum())
                else:
                    next_prompt += 1
                    first = NEW_PROMPT_OFFSET * (index + 1) + next_prompt * num_tokens
                    written = engine.store(torch.arange(first, first + num_tokens), src)
                    done_tokens = min(written * layout.chunk_size, num_tokens)
            except Exception as exc:  # counted: the report requires zero
                errors.append(repr(exc))
                done_tokens = -1
            ops.append((kind, t0, time.monotonic() - t0, done_tokens))
            if kind == "retrieve" and 0 <= done_tokens < num_tokens:
                t0 = time.monotonic()
                try:
                    written = engine.store(tokens, src)
                except Exception as exc:
                    errors.append(repr(exc))
                    written = 0
                ops.append(("repair", t0, time.monotonic() - t0,
                            min(written * layout.chunk_size, num_tokens)))
        results.put(("round", index, {
            "round": round_id,
            "ops": ops,
            "errors": errors,
            "verify_failures": engine.num_verify_failures - verify_before,
            "nospace_chunks": engine.num_nospace_chunks - nospace_before,
        }))
    engine.close()


def _collect(results, kind: str, count: int, timeout_s: float) -> list:
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count:
        try:
            tag, index, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"{count - len(out)} scaling workers did not report "
                               f"'{kind}' in {timeout_s:.0f} s") from None
        if tag == "error":
            raise RuntimeError(f"scaling worker {index} failed: {payload}")
        out.append(payload)
    return out


def run_scaling(layout, num_tokens: int = 4096, client_counts=(1, 2, 4, 8),
                duration_s: float = 8.0, num_prefixes: int = 4, arena_prompts: int = 14,
                read_fraction: float = 0.8, paced_load: float | None = 0.5) -> dict:
    """Run the rounds; returns one entry per client count (see the module docstring).

    Args:
        layout: KV layout of every client (a moderate shape: 8 processes hold a source
            and a destination blob of `num_tokens` each).
        num_tokens: tokens per request (retrieve and store).
        client_counts: clients per round, in order.
        duration_s: seconds each round's clients run.
        num_prefixes: shared prefixes the parent stores before the rounds.
        arena_prompts: arena capacity in prompts of num_tokens. 14 holds the shared
            prefixes (4), what 8 clients write at once (8) and 2 more: small enough that
            stores evict all the time, large enough that pins and writes never exhaust it.
        read_fraction: share of retrieves.
        paced_load: if set, one more round with max(client_counts) clients, each
            sending one request per period so that together they offer this fraction
            of what one closed-loop client did (open loop: latency under concurrency
            without a standing queue). None skips it.
    """
    import torch

    from lmcached.client import CacheEngine
    from lmcached.client.kv_io import new_kv_buffer

    record_bytes = layout.record_bytes(layout.chunk_size)
    num_chunks = -(-num_tokens // layout.chunk_size)
    capacity = arena_prompts * num_chunks * record_bytes + (1 << 20)
    prompt_bytes = num_tokens * layout.token_bytes
    rounds, paced = [], []
    ctx = multiprocessing.get_context("spawn")
    with running_daemon(f"{capacity}", record_block_size(layout),
                        name=f"bench-scaling-{psutil.Process().pid}") as socket:
        info = daemon_info(socket)
        daemon = psutil.Process(int(info["server"]["pid"]))
        with CacheEngine.connect(layout, socket=socket, strict=True) as engine:
            kv = new_kv_buffer(layout.chunk_shape(num_tokens), layout.torch_dtype)
            kv.fill_(0.75)
            for p in range(num_prefixes):
                engine.store(torch.arange(num_tokens) + SHARED_PREFIX_OFFSET * (p + 1), kv)
            del kv
        num_workers = max(client_counts)
        commands = [ctx.Queue() for _ in range(num_workers)]
        results = ctx.Queue()
        procs = [
            ctx.Process(target=worker_main, daemon=True,
                        args=(i, socket, dataclasses.asdict(layout), num_tokens, num_prefixes,
                              commands[i], results))
            for i in range(num_workers)
        ]
        try:
            started = time.monotonic()
            for proc in procs:
                proc.start()
            _collect(results, "ready", num_workers, READY_TIMEOUT_S)
            print(f"  {num_workers} client processes ready in {time.monotonic() - started:.1f} s",
                  flush=True)
            plan = [(n, 0.0) for n in client_counts]
            if paced_load:
                plan.append((num_workers, None))  # period set from the 1-client round
            for round_id, (num_clients, period_s) in enumerate(plan):
                if period_s is None:
                    single = rounds[0]
                    mean_request_s = single["wall_s"] / max(1, single["num_requests"])
                    period_s = num_clients * mean_request_s / paced_load
                before = daemon_info(socket)
                cpu_before = daemon.cpu_times()
                start_at = time.monotonic() + 0.5
                for i in range(num_clients):
                    commands[i].put((round_id, start_at, duration_s, 1000 * round_id + i,
                                     read_fraction, period_s))
                reports = _collect(results, "round", num_clients, duration_s + 120)
                cpu_after = daemon.cpu_times()
                after = daemon_info(socket)
                r = _summarize_round(num_clients, start_at, reports, layout, num_tokens,
                                     prompt_bytes, before, after, cpu_before, cpu_after)
                r["period_s"] = period_s
                r["paced_load"] = paced_load if period_s else None
                (paced if period_s else rounds).append(r)
                label = (f"{num_clients} clients paced at {paced_load:.0%} of 1-client load"
                         if period_s else f"{num_clients} clients")
                print(f"  {label}: {r['aggregate_gbps']:.2f} GB/s, retrieve p50 "
                      f"{r['retrieve']['p50_ms']:.1f} ms p99 {r['retrieve']['p99_ms']:.1f} ms, "
                      f"daemon CPU {r['daemon_cpu_pct']:.0f}%, hit ratio {r['hit_ratio']:.3f}, "
                      f"errors {r['errors']}", flush=True)
        finally:
            for q in commands:
                q.put(None)
            for proc in procs:
                proc.join(timeout=30)
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        final = daemon_info(socket)
    return {
        "layout": layout.model_name,
        "num_tokens": num_tokens,
        "prompt_bytes": prompt_bytes,
        "arena_capacity_bytes": capacity,
        "arena_prompts": arena_prompts,
        "num_shared_prefixes": num_prefixes,
        "read_fraction": read_fraction,
        "duration_s": duration_s,
        "rounds": rounds,
        "paced": paced[0] if paced else None,
        "daemon_rss_bytes_end": final["server"]["rss_bytes"],
        "daemon_rss_private_bytes_end": final["server"]["rss_private_bytes"],
    }


def _op_stats(latencies_s: list[float]) -> dict:
    if not latencies_s:
        return {"count": 0, "p50_ms": float("nan"), "p99_ms": float("nan"),
                "median_ms": float("nan")}
    p50 = percentile(latencies_s, 50) * 1e3
    return {"count": len(latencies_s), "p50_ms": p50, "median_ms": p50,
            "p90_ms": percentile(latencies_s, 90) * 1e3,
            "p99_ms": percentile(latencies_s, 99) * 1e3,
            "max_ms": max(latencies_s) * 1e3}


def _summarize_round(num_clients, start_at, reports, layout, num_tokens, prompt_bytes,
                     before, after, cpu_before, cpu_after) -> dict:
    reads, full_hits, writes, repairs, errors = [], [], [], [], []
    read_tokens = hit_tokens = written_tokens = 0
    end = start_at
    for report in reports:
        errors += report["errors"]
        for kind, t0, latency, done in report["ops"]:
            end = max(end, t0 + latency)
            done = max(done, 0)
            if kind == "retrieve":
                reads.append(latency)
                if done == num_tokens:
                    full_hits.append(latency)
                read_tokens += num_tokens
                hit_tokens += done
            else:
                (writes if kind == "store" else repairs).append(latency)
                written_tokens += done
    wall_s = end - start_at
    moved_bytes = (hit_tokens + written_tokens) * layout.token_bytes
    cpu_s = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    daemon_errors = after["stats"]["errors"] - before["stats"]["errors"]
    verify_failures = sum(r["verify_failures"] for r in reports)
    return {
        "clients": num_clients,
        "wall_s": wall_s,
        "num_requests": len(reads) + len(writes),
        "aggregate_gbps": moved_bytes / wall_s / GB,
        "requests_per_s": (len(reads) + len(writes) + len(repairs)) / wall_s,
        "retrieve": _op_stats(full_hits),
        "retrieve_any": _op_stats(reads),
        "store": _op_stats(writes),
        "repair_store": _op_stats(repairs),
        "all": _op_stats(reads + writes + repairs),
        "hit_ratio": hit_tokens / read_tokens if read_tokens else 0.0,
        "daemon_cpu_pct": 100 * cpu_s / wall_s,
        "daemon_rss_bytes": after["server"]["rss_bytes"],
        "daemon_rss_private_bytes": after["server"]["rss_private_bytes"],
        "evictions": after["stats"]["evictions"] - before["stats"]["evictions"],
        "nospace_chunks": sum(r["nospace_chunks"] for r in reports),
        "errors": len(errors) + verify_failures + daemon_errors,
        "error_samples": errors[:5],
        "verify_failures": verify_failures,
        "daemon_error_replies": daemon_errors,
        "single_op_bytes": prompt_bytes,
    }
