"""The arena's memory is reserved when it is created (shm/arena.py): a full /dev/shm fails
the start-up with one `Error:` line, never a worker with SIGBUS.

The race of two daemons runs for real in a private mount namespace whose /dev/shm is a
64 MiB tmpfs (tests/shm/full_shm_scenario.py), skipped where this process may not make one.
"""

import errno
import fcntl
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from lmcached.shm import pages
from lmcached.shm.arena import Arena
from lmcached.shm.janitor import list_segments

SCENARIO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "full_shm_scenario.py")
UNSHARE = shutil.which("unshare")
SCENARIO_DEADLINE_S = 240
MiB = 1 << 20


def private_dev_shm_refusal() -> str | None:
    """Why this process cannot mount a private tmpfs over /dev/shm, or None if it can."""
    if UNSHARE is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(
        [UNSHARE, "--mount", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs -o size=1M tmpfs /dev/shm"],
        capture_output=True, text=True, timeout=60)
    if probe.returncode:
        return ("cannot mount a tmpfs over /dev/shm in a private mount namespace (needs root "
                f"or CAP_SYS_ADMIN): {probe.stderr.strip()}")
    return None


def test_two_daemons_racing_for_a_small_dev_shm_one_serves_one_refuses(unique_name, short_tmp):
    """Two 40 MiB daemons on a 64 MiB /dev/shm, both past the free-space check: both used
    to serve, on arenas partly unbacked (a worker storing into them died of SIGBUS). Now
    one reserves its arena and serves, and a worker's stores and reads there are whole;
    the other refuses with one Error line naming /dev/shm's free space and the fix, and
    leaves nothing in /dev/shm."""
    refusal = private_dev_shm_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    proc = subprocess.Popen(
        [UNSHARE, "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=64M tmpfs /dev/shm && exec "$0" "$@"',
         sys.executable, SCENARIO, unique_name, short_tmp],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=SCENARIO_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the scenario and the daemons it started
        proc.communicate()
        raise
    assert proc.returncode == 0, err
    result = json.loads(out.splitlines()[-1])
    assert len(result["serving"]) == 1, result
    (served,) = result["serving"]
    assert list(result["refused"]) == [{"a": "b", "b": "a"}[served]], result
    (errors,) = result["refused"].values()
    assert len(errors) == 1, errors
    assert re.fullmatch(r"Error: cannot create a 40MiB arena: No space left on device; "
                        r"/dev/shm has [0-9.]+MiB free \(other arenas or files take the "
                        r"rest\): free space there, or lower --capacity", errors[0]), errors
    worker = result["workers"][served]
    assert worker["returncode"] == 0 and "stored and read back" in worker["output"], worker
    assert result["exit_codes"] == {served: 0, {"a": "b", "b": "a"}[served]: 1}
    assert result["left_in_dev_shm"] == []


def refuse_madvise(monkeypatch, refused: int) -> None:
    """madvise(2) fails with `refused` (pages.populate's call of it)."""
    monkeypatch.setattr(pages, "_madvise", lambda *args: refused)


@pytest.fixture
def sparse_segment(unique_name):
    """A 1 MiB file in /dev/shm (a tmpfs, as an arena) with no page allocated yet."""
    path = f"/dev/shm/lmcached.{unique_name}.0"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 20)
    try:
        yield fd
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize("refused", [errno.EFAULT, errno.ENOMEM])
def test_a_failed_populate_is_an_error_not_a_fallback(sparse_segment, monkeypatch, refused):
    """EFAULT is the kernel saying a page cannot be backed (a full tmpfs): touching it
    would be SIGBUS. It used to be taken for an old kernel, and the pages touched."""
    refuse_madvise(monkeypatch, refused)
    with mmap.mmap(sparse_segment, 1 << 20) as mapping:
        with pytest.raises(OSError) as caught:
            pages.populate(mapping, 0, 1 << 20)
    assert caught.value.errno == refused
    assert os.fstat(sparse_segment).st_blocks == 0  # no page was touched


def test_populate_on_a_kernel_without_madv_populate_write_touches_every_page(sparse_segment,
                                                                            monkeypatch):
    """EINVAL (Linux < 5.14 does not know the advice): one byte per page is touched."""
    refuse_madvise(monkeypatch, errno.EINVAL)
    with mmap.mmap(sparse_segment, 1 << 20) as mapping:
        pages.populate(mapping, 0, 1 << 20)
    assert os.fstat(sparse_segment).st_blocks * 512 == 1 << 20  # every page allocated


def test_populate_lets_the_other_threads_run():
    """While populate waits for the kernel, another thread of the process runs (the
    daemon's disk index rebuild during the prefault): with a switch interval of 100 s, a
    thread that waits for the GIL gets it only if populate releases it."""
    num_bytes = 128 << 20  # tens of ms of populating: time for the thread to be scheduled
    gate = threading.Lock()
    gate.acquire()
    ran = []
    thread = threading.Thread(target=lambda: (gate.acquire(), ran.append(True)))
    interval = sys.getswitchinterval()
    with mmap.mmap(-1, num_bytes) as mapping:
        thread.start()
        time.sleep(0.1)  # the thread blocks on the gate, without the GIL
        sys.setswitchinterval(100.0)
        try:
            gate.release()  # the thread goes on once it gets the GIL
            pages.populate(mapping, 0, num_bytes)
            ran_during_populate = bool(ran)
        finally:
            sys.setswitchinterval(interval)
            thread.join(10)
    assert ran_during_populate, "populate held the GIL: no other thread ran meanwhile"


class _GiveUp(Exception):
    pass


def test_create_waits_its_turn_to_reserve_and_a_stop_while_waiting_leaves_nothing(
        unique_name, tmp_path, monkeypatch):
    """While another process reserves (holds the lock), `create` waits, calling progress
    with 0 bytes done so that a stop signal can end the wait; the segment goes with it."""
    monkeypatch.setattr(pages, "_SHM_DIR", str(tmp_path))  # a lock of this test only
    holder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    calls = []

    def progress(done_bytes: int, total_bytes: int) -> None:
        calls.append(done_bytes)
        if len(calls) == 3:
            raise _GiveUp

    try:
        with pytest.raises(_GiveUp):
            Arena.create(unique_name, 4 * MiB, MiB, progress=progress)
        assert calls == [0, 0, 0] and list_segments(unique_name) == []
    finally:
        os.close(holder)
    calls.clear()
    with Arena.create(unique_name, 4 * MiB, MiB, progress=progress) as arena:
        assert calls == [4 * MiB]  # the lock is free: no wait
        assert os.stat(f"/dev/shm{arena.segment_name}").st_blocks * 512 == 4 * MiB


def test_a_lock_held_for_ever_delays_a_start_only_for_a_bounded_time(unique_name, tmp_path,
                                                                      monkeypatch, caplog):
    """Any local process may flock /dev/shm: past _LOCK_WAIT_MAX_S the arena is reserved
    without the lock (with a warning), so a held lock never stalls a start-up for ever."""
    monkeypatch.setattr(pages, "_SHM_DIR", str(tmp_path))  # a lock of this test only
    monkeypatch.setattr(pages, "_LOCK_WAIT_MAX_S", 0.3)
    holder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with Arena.create(unique_name, 4 * MiB, MiB) as arena:
            assert os.stat(f"/dev/shm{arena.segment_name}").st_blocks * 512 == 4 * MiB
    finally:
        os.close(holder)
    assert any("reserving this arena without it" in r.getMessage() for r in caplog.records)
