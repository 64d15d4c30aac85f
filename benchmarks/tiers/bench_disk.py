"""The disk tier: fetch and spill GB/s against dd's O_DIRECT reads and writes of the same
bytes on the same filesystem, what spilling costs a store, and the index rebuild of a
warm restart. Ratios are to baselines measured in the same run.

Daemons are started by `lmcached.launcher` on a temporary directory under `--dir`
(default /var/tmp: a disk, not tmpfs); everything is removed after. docs/operator.md
("The disk tier") explains the figures.

    spill     a daemon with --disk-policy write-through stores a prompt (Llama-3.2-1B KV,
              256-token chunks of 8 MiB); the time from the store's start until every
              chunk is on disk. Baseline: dd oflag=direct of as many slot-sized blocks
              into a preallocated file in the same directory.
    fetch     the daemon is stopped and another started on the same directory (a warm
              restart: empty arena); the time of one LOOKUP of the prompt is the fetch
              (reads, checksums, token checks, copies into arena blocks). Baseline: dd
              iflag=direct of the same slots.
    CPU       the disk tier's worker threads' CPU seconds (psutil) per GB spilled by
              write-through, and per GB fetched after a warm restart, with records moved
              in place between their blocks and the file (--block-size whole pages) and
              through a thread's buffer (a block size of 64-byte multiples, which
              O_DIRECT cannot move in place: one copy per chunk, as every chunk was
              copied before the slot format page-aligned the record)
    store     cold stores into an arena of twice the prompt, with an on-evict disk tier
              (every store evicts and spills the previous prompt) and without one, in turn
    rebuild   the index rebuild of a slot file of --slots slots, all committed, after its
              pages were dropped from the page cache (posix_fadvise DONTNEED)

    python -m benchmarks.tiers.bench_disk [--tokens 4096] [--repeat 3] [--slots 100000]
                                    [--stores 12] [--cpu-prompts 8] [--dir /var/tmp]
                                    [--out FILE.json]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import psutil
import torch


from benchmarks.common import GB, LLAMA_1B, daemon_info, machine_info, median, record_block_size
from lmcached.client import CacheEngine
from lmcached.daemon.disk.directory import prepare_disk_directory
from lmcached.daemon.disk.scan import scan_slots
from lmcached.daemon.disk.slots import FILE_NAME, PAGE_BYTES, SlotFile, aligned_buffer
from lmcached.daemon.spill.envelope import encode_envelope
from lmcached.launcher import temporary_daemon
from lmcached.wire.connection import Connection
from lmcached.wire.protocol import Info

MiB = 1 << 20
CLIENT_TIMEOUT_S = 120.0  # the benchmark waits for whole fetches (serving uses 200 ms)


def disk_info(socket: str) -> dict:
    with Connection(socket, timeout_s=30) as conn:
        return conn.request(Info("disk")).sections["disk"]


def wait_on_disk(socket: str, num_chunks: int, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = disk_info(socket)
        if info["disk_writes"] >= num_chunks and not info["disk_queue_values"]:
            return info
        drops = sum(v for k, v in info.items() if k.startswith("disk_write_drops_"))
        if drops or info["disk_write_failures"]:
            raise RuntimeError(f"the disk tier dropped writes: {info}")
        time.sleep(0.002)
    raise RuntimeError(f"the disk tier did not write {num_chunks} chunks: {info}")


def connect(socket: str) -> CacheEngine:
    return CacheEngine.connect(LLAMA_1B, socket=socket, strict=True, timeout_s=CLIENT_TIMEOUT_S,
                               data_timeout_s=CLIENT_TIMEOUT_S)


def dd_seconds(*args: str) -> float:
    """Seconds dd says it took (its last stderr line)."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = re.search(r"copied, ([0-9.eE+-]+) s", done.stderr)
    return float(match.group(1))


def daemon_args(disk_dir: str, capacity_bytes: int, *more: str,
                block_size: str | None = None) -> list[str]:
    return ["--capacity", str(capacity_bytes), "--block-size",
            block_size or record_block_size(LLAMA_1B), "--log-level", "WARNING",
            "--max-session-share", "100", "--disk-path", disk_dir, *more]


def daemon_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system, 10 ms ticks) of the daemon's loop thread, and of its
    other threads (the disk tier's writers and readers, any other worker)."""
    loop = workers = 0.0
    for thread in psutil.Process(pid).threads():
        if thread.id == pid:
            loop += thread.user_time + thread.system_time
        else:
            workers += thread.user_time + thread.system_time
    return loop, workers


def bench_spill_and_fetch(root: str, num_tokens: int, repeat: int) -> dict:
    """Spill GB/s (write-through) and fetch GB/s after a warm restart, against dd."""
    nbytes = num_tokens * LLAMA_1B.token_bytes
    num_chunks = num_tokens // LLAMA_1B.chunk_size
    # Write-through pins at most a quarter of the arena while its chunks wait for the
    # disk (lmcached/daemon/disk/tier.py, PINNED_SHARE): 6x the prompt holds it whole.
    capacity = 6 * nbytes + 64 * MiB
    disk_dir = os.path.join(root, "tier")
    disk_args = ("--disk-capacity", str((repeat + 2) * (nbytes + num_chunks * 2 * PAGE_BYTES)),
                 "--disk-fetch-wait", "60")
    kv = torch.randn(LLAMA_1B.chunk_shape(num_tokens)).to(torch.bfloat16)
    prompts = [torch.arange(r * 10**6, r * 10**6 + num_tokens) for r in range(repeat + 1)]
    spill_s = []
    with temporary_daemon(*daemon_args(disk_dir, capacity, *disk_args, "--disk-policy",
                                       "write-through"), name=f"dska-{os.getpid()}") as a:
        with connect(a) as engine:
            for r, tokens in enumerate(prompts):
                started = time.perf_counter()
                engine.store(tokens, kv)
                wait_on_disk(a, (r + 1) * num_chunks)
                if r:  # the first round warms up
                    spill_s.append(time.perf_counter() - started)
        slot_bytes = disk_info(a)["disk_slot_bytes"]
    fetch_s, fetched = [], []
    with temporary_daemon(*daemon_args(disk_dir, capacity, *disk_args),
                          name=f"dskb-{os.getpid()}") as b:
        info = disk_info(b)
        with connect(b) as engine:
            for tokens in prompts[1:]:
                before = disk_info(b)["disk_fetch_bytes"]
                started = time.perf_counter()
                hit = engine.lookup(tokens)
                fetch_s.append(time.perf_counter() - started)
                fetched.append(disk_info(b)["disk_fetch_bytes"] - before)
                if hit != num_tokens:
                    raise RuntimeError(f"found {hit} of {num_tokens} tokens on disk")
    path = os.path.join(disk_dir, FILE_NAME)
    dd_read_s = [dd_seconds(f"if={path}", "of=/dev/null", f"bs={slot_bytes}",
                            f"skip={PAGE_BYTES + (r + 1) * num_chunks * slot_bytes}",
                            f"count={num_chunks}", "iflag=direct,skip_bytes")
                 for r in range(repeat)]
    dd_file = os.path.join(root, "dd-write")
    with open(dd_file, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, slot_bytes * num_chunks)
    dd_write_s = [dd_seconds("if=/dev/zero", f"of={dd_file}", f"bs={slot_bytes}",
                             f"count={num_chunks}", "oflag=direct", "conv=notrunc")
                  for _ in range(repeat)]
    os.unlink(dd_file)
    fetched_bytes = median(fetched)
    return {"num_tokens": num_tokens, "bytes": nbytes, "fetched_bytes": fetched_bytes,
            "slot_bytes": slot_bytes, "spill_s": spill_s, "fetch_s": fetch_s,
            "dd_read_s": dd_read_s, "dd_write_s": dd_write_s,
            "spill_gbps": nbytes / median(spill_s) / GB,
            "fetch_gbps": fetched_bytes / median(fetch_s) / GB,
            "dd_read_gbps": num_chunks * slot_bytes / median(dd_read_s) / GB,
            "dd_write_gbps": num_chunks * slot_bytes / median(dd_write_s) / GB,
            "fetch_vs_dd": (fetched_bytes / median(fetch_s)) / (num_chunks * slot_bytes / median(dd_read_s)),
            "spill_vs_dd": (nbytes / median(spill_s)) / (num_chunks * slot_bytes / median(dd_write_s)),
            "warm_restart": {"restored_chunks": info["disk_restored_chunks"],
                             "scan_s": info["disk_scan_s"]}}


def bench_worker_cpu(root: str, num_tokens: int, num_prompts: int) -> dict:
    """The disk tier's CPU per GB: writer threads per GB spilled (write-through), reader
    threads per GB fetched after a warm restart, with records moved in place between
    their arena blocks and the file (a block size of whole pages, as a daemon derives
    it) and through a thread's buffer, one copy per chunk (a block size of 64-byte
    multiples, which O_DIRECT cannot move in place: the slot format before records were
    page-aligned copied every chunk so), in the same run."""
    nbytes = num_tokens * LLAMA_1B.token_bytes
    num_chunks = num_tokens // LLAMA_1B.chunk_size
    record_bytes = LLAMA_1B.record_bytes(LLAMA_1B.chunk_size)
    unaligned = -(-record_bytes // 64) * 64
    if unaligned % PAGE_BYTES == 0:
        raise RuntimeError(f"the record of {record_bytes} bytes fills whole pages: no block "
                           f"size of 64-byte multiples leaves O_DIRECT a copy to make")
    kv = torch.randn(LLAMA_1B.chunk_shape(num_tokens)).to(torch.bfloat16)
    prompts = [torch.arange(r * 10**6, r * 10**6 + num_tokens) for r in range(num_prompts + 1)]
    gb = num_prompts * nbytes / GB
    out = {"num_tokens": num_tokens, "num_prompts": num_prompts}
    for mode, block_size in (("in_place", record_block_size(LLAMA_1B)),
                             ("copy", str(unaligned))):
        disk_dir = os.path.join(root, f"cpu-{mode}")
        args = daemon_args(disk_dir, (num_prompts + 2) * nbytes + 64 * MiB, "--disk-capacity",
                           str((num_prompts + 2) * (nbytes + num_chunks * 2 * PAGE_BYTES)),
                           "--disk-fetch-wait", "60", block_size=block_size)
        with temporary_daemon(*args, "--disk-policy", "write-through",
                              name=f"dskc-{os.getpid()}") as sock:
            pid = daemon_info(sock, "server")["server"]["pid"]
            with connect(sock) as engine:
                engine.store(prompts[0], kv)  # warms the threads up
                wait_on_disk(sock, num_chunks)
                before = daemon_cpu_s(pid)[1]
                for r, tokens in enumerate(prompts[1:], 1):
                    engine.store(tokens, kv)
                    wait_on_disk(sock, (r + 1) * num_chunks)
                out[f"spill_{mode}_cpu_s"] = daemon_cpu_s(pid)[1] - before
        with temporary_daemon(*args, name=f"dskd-{os.getpid()}") as sock:  # a warm restart
            pid = daemon_info(sock, "server")["server"]["pid"]
            with connect(sock) as engine:
                if engine.lookup(prompts[0]) != num_tokens:  # warms the threads up
                    raise RuntimeError("the warm restart lost the first prompt")
                before = daemon_cpu_s(pid)[1]
                hits = [engine.lookup(tokens) for tokens in prompts[1:]]
                out[f"fetch_{mode}_cpu_s"] = daemon_cpu_s(pid)[1] - before
            if hits != [num_tokens] * num_prompts:
                raise RuntimeError(f"found {hits} of {num_tokens} tokens on disk")
        shutil.rmtree(disk_dir, ignore_errors=True)
        for what in ("spill", "fetch"):
            out[f"{what}_{mode}_cpu_ms_per_gb"] = out[f"{what}_{mode}_cpu_s"] * 1e3 / gb
    for what in ("spill", "fetch"):
        out[f"{what}_copy_vs_in_place"] = (out[f"{what}_copy_cpu_s"]
                                           / max(out[f"{what}_in_place_cpu_s"], 1e-9))
    return out


def bench_store(root: str, num_tokens: int, repeat: int) -> dict:
    """Cold stores that evict the previous prompt: with an on-evict disk tier and without,
    `repeat` of each after two that fill the arenas, in turn (the order alternates); and
    where the daemons' CPU went meanwhile (loop thread, worker threads)."""
    nbytes = num_tokens * LLAMA_1B.token_bytes
    capacity = 2 * nbytes + 32 * MiB
    kv = torch.randn(LLAMA_1B.chunk_shape(num_tokens)).to(torch.bfloat16)
    on_s, off_s = [], []
    on_args = daemon_args(os.path.join(root, "store-tier"), capacity, "--disk-capacity",
                          str(4 * nbytes))
    off_args = on_args[:on_args.index("--disk-path")]
    with temporary_daemon(*on_args, name=f"dskon-{os.getpid()}") as on, \
            temporary_daemon(*off_args, name=f"dskoff-{os.getpid()}") as off:
        pids = [daemon_info(sock, "server")["server"]["pid"] for sock in (on, off)]
        with connect(on) as engine_on, connect(off) as engine_off:
            for r in range(repeat + 2):  # two rounds fill the arenas
                if r == 2:
                    cpu_before = [daemon_cpu_s(pid) for pid in pids]
                tokens = torch.arange(r * 10**6, r * 10**6 + num_tokens)
                order = [(engine_off, off_s), (engine_on, on_s)]
                for engine, samples in order if r % 2 else order[::-1]:
                    started = time.perf_counter()
                    engine.store(tokens, kv)
                    if r >= 2:
                        samples.append(time.perf_counter() - started)
            deadline = time.monotonic() + 60
            while disk_info(on)["disk_queue_values"] and time.monotonic() < deadline:
                time.sleep(0.002)  # the writes ahead in flight end (their CPU counts)
            (on_loop, on_workers), (off_loop, off_workers) = [
                [after - before for after, before in zip(daemon_cpu_s(pid), cpu)]
                for pid, cpu in zip(pids, cpu_before)]
        info = disk_info(on)
    return {"num_tokens": num_tokens, "bytes": nbytes, "store_spill_s": on_s,
            "store_no_disk_s": off_s, "store_spill_gbps": nbytes / median(on_s) / GB,
            "store_no_disk_gbps": nbytes / median(off_s) / GB,
            "ratio_on_off": median(off_s) / median(on_s), "disk_writes": info["disk_writes"],
            "write_drops": sum(v for k, v in info.items() if k.startswith("disk_write_drops_")),
            "loop_cpu_ms_per_store_on": on_loop * 1e3 / repeat,
            "loop_cpu_ms_per_store_off": off_loop * 1e3 / repeat,
            "worker_cpu_ms_per_store_on": on_workers * 1e3 / repeat,
            "worker_cpu_ms_per_store_off": off_workers * 1e3 / repeat}


def bench_rebuild(root: str, num_slots: int) -> dict:
    """Index rebuild of a full slot file (one small record per slot), cold page cache."""
    directory = os.path.join(root, "rebuild")
    os.mkdir(directory, 0o700)
    slot_bytes = 2 * PAGE_BYTES
    disk_directory = prepare_disk_directory(directory)
    slot_file, _ = SlotFile.open(disk_directory, slot_bytes, num_slots)
    page, buffer = aligned_buffer(PAGE_BYTES), aligned_buffer(PAGE_BYTES)
    record = os.urandom(1000)
    buffer[:len(record)] = record
    started = time.perf_counter()
    for slot in range(num_slots):
        envelope = encode_envelope(b"\1" * 16, slot.to_bytes(16, "little"), [record])
        slot_file.write(slot, page, [buffer], envelope)
    write_s = time.perf_counter() - started
    fd = os.open(slot_file.path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    started = time.perf_counter()
    found = scan_slots(slot_file)
    scan_s = time.perf_counter() - started
    slot_file.close()
    disk_directory.close()
    shutil.rmtree(directory)
    if len(found) != num_slots:
        raise RuntimeError(f"the scan found {len(found)} of {num_slots} slots")
    return {"num_slots": num_slots, "slot_bytes": slot_bytes, "write_s": write_s,
            "scan_s": scan_s, "scan_s_per_100k_slots": scan_s * 100_000 / num_slots}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--slots", type=int, default=100_000)
    parser.add_argument("--stores", type=int, default=12,
                        help="cold stores measured with and without a disk tier")
    parser.add_argument("--cpu-prompts", type=int, default=8,
                        help="prompts spilled and fetched for the CPU figures, in place and copied")
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--out")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="lmcached-bench-disk-", dir=args.dir)
    try:
        fs = subprocess.run(["df", "-T", root], capture_output=True, text=True).stdout
        print(f"disk tier on {root}:\n{fs}", flush=True)
        io = bench_spill_and_fetch(root, args.tokens, args.repeat)
        print(f"spill {io['spill_gbps']:.2f} GB/s vs dd oflag=direct {io['dd_write_gbps']:.2f} "
              f"GB/s ({io['spill_vs_dd']:.2f}x); fetch {io['fetch_gbps']:.2f} GB/s vs dd "
              f"iflag=direct {io['dd_read_gbps']:.2f} GB/s ({io['fetch_vs_dd']:.2f}x); warm "
              f"restart found {io['warm_restart']['restored_chunks']} chunks in "
              f"{io['warm_restart']['scan_s']:.3f} s", flush=True)
        cpu = bench_worker_cpu(root, args.tokens, args.cpu_prompts)
        print(f"disk tier CPU per GB, in place (between arena blocks and the file) vs "
              f"through a buffer: spill {cpu['spill_in_place_cpu_ms_per_gb']:.0f} vs "
              f"{cpu['spill_copy_cpu_ms_per_gb']:.0f} ms ({cpu['spill_copy_vs_in_place']:.2f}x), "
              f"fetch {cpu['fetch_in_place_cpu_ms_per_gb']:.0f} vs "
              f"{cpu['fetch_copy_cpu_ms_per_gb']:.0f} ms ({cpu['fetch_copy_vs_in_place']:.2f}x)",
              flush=True)
        store = bench_store(root, args.tokens, args.stores)
        print(f"cold store evicting to disk {store['store_spill_gbps']:.2f} GB/s vs without a "
              f"disk tier {store['store_no_disk_gbps']:.2f} GB/s (ratio "
              f"{store['ratio_on_off']:.2f}; {store['disk_writes']} chunks spilled, "
              f"{store['write_drops']} dropped); daemon CPU per store with / without: loop "
              f"{store['loop_cpu_ms_per_store_on']:.1f} / {store['loop_cpu_ms_per_store_off']:.1f}"
              f" ms, worker threads {store['worker_cpu_ms_per_store_on']:.1f} / "
              f"{store['worker_cpu_ms_per_store_off']:.1f} ms", flush=True)
        rebuild = bench_rebuild(root, args.slots)
        print(f"index rebuild: {rebuild['num_slots']} slots in {rebuild['scan_s']:.2f} s "
              f"({rebuild['scan_s_per_100k_slots']:.2f} s per 100k slots, page cache dropped)",
              flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"machine": machine_info(), "filesystem": fs, "spill_fetch": io,
              "worker_cpu": cpu, "store": store, "rebuild": rebuild}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
