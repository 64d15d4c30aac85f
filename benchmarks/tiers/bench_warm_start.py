"""A warm restart's two loading phases, one after the other and at once: why the daemon
rebuilds the disk tier's index on a thread while it prefaults the arena. Not a test.

    scan       SlotFile.scan of a slot file of --slots written slots (one small record
               each), page cache dropped first (posix_fadvise DONTNEED after fsync)
    prefault   Arena.reserve of a fresh --arena-mib arena (posix_fallocate and
               MADV_POPULATE_WRITE in 64 MiB steps, as the daemon's start-up)
    overlap    both at once, as the daemon does (lmcached/daemon/server.py `_load`): the
               scan on a thread, the prefault on the main thread; until both end

Sequential is scan + prefault of the same repetition; the three are measured in turn,
--repeat times. The slot file lives in a temporary directory under --dir (default
/var/tmp: a disk, not tmpfs), removed after; the arena in /dev/shm, unlinked after.

    python -m benchmarks.tiers.bench_warm_start [--slots 50000] [--arena-mib 2048] [--repeat 3]
"""

import argparse
import os
import shutil
import tempfile
import threading
import time


from benchmarks.common import median
from lmcached.daemon.disk.directory import prepare_disk_directory
from lmcached.daemon.disk.scan import scan_slots
from lmcached.daemon.disk.slots import PAGE_BYTES, SlotFile, aligned_buffer
from lmcached.daemon.spill.envelope import encode_envelope
from lmcached.shm.arena import Arena

RECORD_BYTES = 1000


def written_slot_file(directory: str, num_slots: int) -> SlotFile:
    """A slot file of `num_slots` slots of two pages, each holding a small record."""
    slot_file, _ = SlotFile.open(prepare_disk_directory(directory), 2 * PAGE_BYTES, num_slots)
    page, record_page = aligned_buffer(PAGE_BYTES), aligned_buffer(PAGE_BYTES)
    record = os.urandom(RECORD_BYTES)
    record_page[:RECORD_BYTES] = record  # written whole (O_DIRECT), the tail included
    for slot in range(num_slots):
        envelope = encode_envelope(b"\1" * 16, slot.to_bytes(16, "little"), [record])
        slot_file.write(slot, page, [record_page], envelope)
    return slot_file


def drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def scan_s(slot_file: SlotFile) -> float:
    drop_page_cache(slot_file.path)
    started = time.perf_counter()
    found = scan_slots(slot_file)
    elapsed = time.perf_counter() - started
    if len(found) != slot_file.num_slots:
        raise RuntimeError(f"the scan found {len(found)} of {slot_file.num_slots} slots")
    return elapsed


def prefault_s(arena_bytes: int) -> float:
    arena = Arena.create(f"bws{os.getpid()}", arena_bytes, prefault=False)
    try:
        started = time.perf_counter()
        arena.reserve(lambda done, total: None)
        return time.perf_counter() - started
    finally:
        arena.close()


def overlap_s(slot_file: SlotFile, arena_bytes: int) -> float:
    drop_page_cache(slot_file.path)
    arena = Arena.create(f"bws{os.getpid()}", arena_bytes, prefault=False)
    try:
        started = time.perf_counter()
        scan = threading.Thread(target=slot_file.scan)
        scan.start()
        arena.reserve(lambda done, total: None)
        scan.join()
        return time.perf_counter() - started
    finally:
        arena.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=50_000)
    parser.add_argument("--arena-mib", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/var/tmp")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="lmcached-bench-warm-start-", dir=args.dir)
    arena_bytes = args.arena_mib << 20
    try:
        directory = os.path.join(root, "disk")
        os.mkdir(directory, 0o700)
        slot_file = written_slot_file(directory, args.slots)
        sequential, overlapped = [], []
        for rep in range(args.repeat):
            scan, prefault, both = scan_s(slot_file), prefault_s(arena_bytes), \
                overlap_s(slot_file, arena_bytes)
            sequential.append(scan + prefault)
            overlapped.append(both)
            print(f"run {rep + 1}: scan {scan:.2f} s, prefault {prefault:.2f} s, one after the "
                  f"other {scan + prefault:.2f} s, at once {both:.2f} s "
                  f"({(scan + prefault) / both:.2f}x)", flush=True)
        slot_file.close()
        print(f"median of {args.repeat}: {args.slots} slots and a {args.arena_mib} MiB arena: "
              f"one after the other {median(sequential):.2f} s, at once "
              f"{median(overlapped):.2f} s ({median(sequential) / median(overlapped):.2f}x); "
              f"load average {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
