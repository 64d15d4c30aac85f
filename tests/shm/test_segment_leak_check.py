"""The /dev/shm leak check of every test (tests/conftest.py): it flags the segments this
test run leaves behind, and never another process's, which it would also unlink. vLLM
names its segments at random (`vllm_dist_<uuid>...`), so a vLLM segment counts as this
run's unless a process outside the run holds it."""

import contextlib
import os
import subprocess
import sys
import time
import uuid

from conftest import VLLM_SEGMENT_PREFIX, leaked_segments, our_segments

# Forks, and the child (reparented when its parent exits at once: not a descendant of
# the test) creates and maps the segment, says its pid, and holds it until stopped.
FOREIGN_HOLDER = """
import mmap, os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
path, pid_path = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
mapping = mmap.mmap(fd, 4096)
with open(pid_path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(pid_path + ".tmp", pid_path)
time.sleep(60)
"""


def _wait_for(path: str) -> str:
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


@contextlib.contextmanager
def foreign_and_own_vllm_segments(tmp_path):
    """Two vLLM-named segments: (foreign, mine). `foreign` is held by a process outside
    this test run (FOREIGN_HOLDER), `mine` is created here and left unheld. Both are
    gone, and the holder killed, afterwards."""
    foreign = f"{VLLM_SEGMENT_PREFIX}{uuid.uuid4().hex}-test-[0-1]-cpushm"
    mine = f"{VLLM_SEGMENT_PREFIX}{uuid.uuid4().hex}-test-[0-1]-cpushm"
    pid_path = str(tmp_path / "holder.pid")
    subprocess.run([sys.executable, "-c", FOREIGN_HOLDER, f"/dev/shm/{foreign}", pid_path],
                   check=True, timeout=30)
    holder = int(_wait_for(pid_path))
    try:
        os.close(os.open(f"/dev/shm/{mine}", os.O_CREAT | os.O_RDWR, 0o600))  # unheld
        yield foreign, mine
    finally:
        os.kill(holder, 9)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{holder}") and time.monotonic() < deadline:
            time.sleep(0.01)
        for name in (mine, foreign):
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass


def test_another_processes_vllm_segment_is_not_flagged_but_one_of_ours_is(tmp_path):
    before = our_segments()
    with foreign_and_own_vllm_segments(tmp_path) as (foreign, mine):
        leaked = leaked_segments(before)
        assert foreign not in leaked, "a segment another process holds is not this run's"
        assert mine in leaked, "an unheld segment made during the test is this run's leak"
