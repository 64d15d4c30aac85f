"""The janitor: orphaned arena segments are found and unlinked, live ones never."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import posix_ipc
import psutil

from lmcached.shm.arena import ARENA_MAGIC, Arena
from lmcached.shm.janitor import (
    SHM_DIR,
    _owner_alive,
    list_segments,
    read_segment_owner,
    sweep_orphans,
)

MiB = 1 << 20


def test_sweep_removes_segments_of_dead_daemons_only(unique_name):
    live = Arena.create(unique_name, 4 * MiB, MiB)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from lmcached.shm.arena import Arena
                arena = Arena.create({unique_name!r}, {4 * MiB}, {MiB})
                print(arena.segment_name, flush=True)
                time.sleep(60)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        dead_name = child.stdout.readline().strip().lstrip("/")
        assert dead_name in list_segments(unique_name)
        assert sweep_orphans(unique_name) == []  # its owner is alive
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert dead_name in list_segments(unique_name)  # SIGKILL cannot unlink
        assert sweep_orphans(unique_name) == [dead_name]
        assert list_segments(unique_name) == [live.segment_name.lstrip("/")]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        live.close()


def test_owner_is_dead_when_its_pid_was_reused_or_is_a_zombie():
    me = psutil.Process()
    assert _owner_alive(me.pid, me.create_time())
    assert not _owner_alive(me.pid, me.create_time() - 5.0)  # same pid, another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(child.pid).create_time()
    deadline = time.monotonic() + 10
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert not _owner_alive(child.pid, created)
    finally:
        child.wait()
    assert not _owner_alive(child.pid, created)  # reaped: gone


def test_read_segment_owner_returns_the_header_of_an_arena_only(unique_name):
    with Arena.create(unique_name, 4 * MiB, MiB, prefault=False) as arena:
        path = os.path.join(SHM_DIR, arena.segment_name.lstrip("/"))
        me = psutil.Process()
        assert read_segment_owner(path) == (arena.generation, me.pid, me.create_time())
    foreign = posix_ipc.SharedMemory(f"/lmcached.{unique_name}.1", posix_ipc.O_CREX, size=4096)
    try:
        foreign.close_fd()
        path = os.path.join(SHM_DIR, f"lmcached.{unique_name}.1")
        assert read_segment_owner(path) is None  # zeros: no ARENA_MAGIC
        with open(path, "r+b") as f:
            f.write(ARENA_MAGIC)
        assert read_segment_owner(path) is not None
        assert read_segment_owner(os.path.join(SHM_DIR, "no-such-segment")) is None
    finally:
        foreign.unlink()


def test_sweep_removes_a_headerless_segment_only_once_it_is_old(unique_name):
    """A segment without a header may be one being created right now: spared while young."""
    entry = f"lmcached.{unique_name}.1"
    posix_ipc.SharedMemory("/" + entry, posix_ipc.O_CREX, size=4096).close_fd()
    try:
        assert sweep_orphans(unique_name, min_age_s=60) == []
        assert list_segments(unique_name) == [entry]
        assert sweep_orphans(unique_name, min_age_s=0) == [entry]
        assert list_segments(unique_name) == []
    finally:
        if list_segments(unique_name):
            posix_ipc.unlink_shared_memory("/" + entry)
