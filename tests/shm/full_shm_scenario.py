"""Two daemons racing for a small /dev/shm: `python tests/shm/full_shm_scenario.py NAME DIR`.

Run by tests/shm/test_arena_reservation.py inside a private mount namespace whose /dev/shm
is a 64 MiB tmpfs (`unshare --mount`), so that filling it touches nothing outside. Two
daemons of 40 MiB start together: this script holds the reservation lock (an flock on
/dev/shm, shm/pages.py) until both have passed the start-up's free-space check and wait
for it, then lets them race (a daemon that takes no lock races at once). A worker then
stores into every daemon that serves until its arena has been written over, and reads
the last prompt back. Every process is stopped by pid; the script prints one JSON line
of what happened, which the test checks.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

DEADLINE_S = 60.0
CAPACITY = "40MiB"
WAITING = "waiting for another process to reserve its memory in /dev/shm"

WORKER = """
import sys
import torch
from lmcached.client import CacheEngine, KVLayout

layout = KVLayout("full-shm", num_layers=2, num_kv_heads=4, head_size=64, chunk_size=64)
with CacheEngine.connect(layout, socket=sys.argv[1], strict=True) as eng:
    for prompt in range(80):  # 320 chunks, one 256 KiB block each: every block, twice
        tokens = torch.arange(prompt * 1000, prompt * 1000 + 256)
        gen = torch.Generator().manual_seed(prompt)
        kv = torch.randn(layout.chunk_shape(256), generator=gen).to(layout.torch_dtype)
        assert eng.store(tokens, kv) == 4, prompt
    got, mask = eng.retrieve(tokens, return_tuple=False)
    assert int(mask.sum()) == 256 and torch.equal(got, kv), "bytes read back differ"
print("stored and read back")
"""


def main(name: str, directory: str) -> dict:
    lock_fd = os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # the daemons wait for it after their checks
    daemons = {}
    try:
        for tag in ("a", "b"):
            log = open(os.path.join(directory, f"{tag}.log"), "w")
            err = open(os.path.join(directory, f"{tag}.err"), "w")
            proc = subprocess.Popen(
                [sys.executable, "-m", "lmcached.cli", "serve", "--name", f"{name}-{tag}",
                 "--socket", os.path.join(directory, f"{tag}.sock"), "--capacity", CAPACITY,
                 "--block-size", "256KiB"], stdout=log, stderr=err)
            log.close()
            err.close()
            daemons[tag] = proc
        deadline = time.monotonic() + DEADLINE_S
        while not all(past_checks(directory, tag, proc) for tag, proc in daemons.items()):
            if time.monotonic() > deadline:
                raise RuntimeError("the daemons did not reach their arena in time: "
                                   + " | ".join(read(directory, f"{t}.err") for t in daemons))
            time.sleep(0.05)
        os.close(lock_fd)  # they race now
        lock_fd = None
        serving, refused = [], {}
        while len(serving) + len(refused) < len(daemons):
            for tag, proc in daemons.items():
                if tag in serving or tag in refused:
                    continue
                if proc.poll() is not None:
                    refused[tag] = [line for line in read(directory, f"{tag}.err").splitlines()
                                    if line.startswith("Error:")]
                elif "listening on" in read(directory, f"{tag}.err"):
                    serving.append(tag)
            if time.monotonic() > deadline:
                raise RuntimeError("the daemons neither served nor exited in time")
            time.sleep(0.05)
        workers = {}
        for tag in serving:
            worker = subprocess.run(
                [sys.executable, "-c", WORKER, os.path.join(directory, f"{tag}.sock")],
                capture_output=True, text=True, timeout=DEADLINE_S)
            workers[tag] = {"returncode": worker.returncode,
                            "output": (worker.stdout + worker.stderr)[-2000:]}
        exit_codes = {tag: stop(proc) for tag, proc in daemons.items()}
        return {"serving": serving, "refused": refused, "workers": workers,
                "exit_codes": exit_codes,
                "left_in_dev_shm": sorted(e for e in os.listdir("/dev/shm")
                                          if e.startswith("lmcached."))}
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
        for proc in daemons.values():
            stop(proc)


def past_checks(directory: str, tag: str, proc: subprocess.Popen) -> bool:
    """Whether daemon `tag` waits for the reservation lock, or went on without it (a
    daemon that takes none serves or exits)."""
    log = read(directory, f"{tag}.err")
    return WAITING in log or "listening on" in log or proc.poll() is not None


def read(directory: str, filename: str) -> str:
    with open(os.path.join(directory, filename), errors="replace") as f:
        return f.read()


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM by pid, then SIGKILL; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
