"""The janitor: a daemon name's lock decides who owns its segments; orphans are found and
unlinked, live ones never, whatever their header bytes say."""

import os
import signal
import subprocess
import sys
import textwrap

import posix_ipc
import pytest

from lmcached.shm import janitor
from lmcached.shm.arena import SEGMENT_HEADER, Arena
from lmcached.shm.janitor import (
    DaemonRunningError,
    NameLock,
    UnsafeLockDirectoryError,
    list_segments,
    lock_directory,
    sweep_orphans,
    unlink_orphans,
)

MiB = 1 << 20

# Holds the name's lock and owns an arena, as a daemon does; prints the segment's name.
HOLDER = textwrap.dedent("""
    import sys, time
    from lmcached.shm.arena import Arena
    from lmcached.shm.janitor import NameLock
    lock = NameLock.acquire(sys.argv[1])
    arena = Arena.create(sys.argv[1], 4 << 20, 1 << 20, prefault=False)
    print(arena.segment_name, flush=True)
    time.sleep(120)
""")


@pytest.fixture
def holder(unique_name):
    """A process holding `unique_name`'s lock and arena: (Popen, segment entry)."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER, unique_name],
                             stdout=subprocess.PIPE, text=True)
    try:
        entry = child.stdout.readline().strip().lstrip("/")
        assert entry in list_segments(unique_name), child.poll()
        yield child, entry
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()


def test_a_held_name_is_refused_with_its_pid_and_freed_when_its_holder_dies(holder, unique_name):
    child, entry = holder
    assert NameLock.try_acquire(unique_name) is None
    with pytest.raises(DaemonRunningError, match=rf"named {unique_name} is already running "
                                                 rf"\(pid {child.pid}, it holds"):
        NameLock.acquire(unique_name)
    child.send_signal(signal.SIGKILL)  # the kernel drops the lock with the process
    child.wait(timeout=10)
    with NameLock.acquire(unique_name) as lock:
        assert lock.path == os.path.join(lock_directory(), f"{unique_name}.lock")
        with open(lock.path) as f:
            assert f.read() == f"{os.getpid()}\n"
        assert NameLock.try_acquire(unique_name) is None  # another open file, same process
        assert unlink_orphans(lock) == [entry]
    assert not os.path.exists(lock.path)  # release unlinks it
    lock.release()  # idempotent


def test_sweep_spares_a_live_daemons_segment_whatever_its_header_says(holder, unique_name):
    """A client can write the header (a dead owner pid, no magic): nothing changes."""
    child, entry = holder
    shm = posix_ipc.SharedMemory("/" + entry)
    try:
        os.pwrite(shm.fd, SEGMENT_HEADER.pack(b"FORGED!!", 1, 999_999, 0.0, 0, 0), 0)
    finally:
        shm.close_fd()
    assert sweep_orphans(unique_name) == []
    assert list_segments(unique_name) == [entry]
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=10)
    assert entry in list_segments(unique_name)  # SIGKILL cannot unlink
    assert sweep_orphans(unique_name) == [entry]
    assert list_segments(unique_name) == []
    assert not os.path.exists(os.path.join(lock_directory(), f"{unique_name}.lock"))


def test_the_lock_holder_unlinks_every_older_segment_of_its_name(unique_name):
    """Headerless or not: while the name is held, nobody else may have made one."""
    headerless = f"lmcached.{unique_name}.1"
    posix_ipc.SharedMemory("/" + headerless, posix_ipc.O_CREX, size=4096).close_fd()
    dead = Arena.create(unique_name, 4 * MiB, MiB, prefault=False)
    dead_entry = dead.segment_name.lstrip("/")
    dead.is_owner = False  # as if its daemon died: close() only unmaps
    dead.close()
    with NameLock.acquire(unique_name) as lock:
        assert unlink_orphans(lock) == sorted([headerless, dead_entry])
        with Arena.create(unique_name, 4 * MiB, MiB, prefault=False) as mine:
            assert list_segments(unique_name) == [mine.segment_name.lstrip("/")]
    assert list_segments(unique_name) == []


@pytest.fixture
def private_shm_dir(tmp_path, monkeypatch):
    """The janitor's /dev/shm is a temporary directory (the real lock directory is shared
    with every daemon of this user)."""
    monkeypatch.setattr(janitor, "SHM_DIR", str(tmp_path))
    return tmp_path


def test_a_lock_directory_that_is_a_symlink_is_refused(private_shm_dir, unique_name):
    target = private_shm_dir / "elsewhere"
    target.mkdir()
    os.symlink(target, lock_directory())
    with pytest.raises(UnsafeLockDirectoryError, match="is not a directory"):
        NameLock.acquire(unique_name)
    assert os.listdir(target) == []


def test_a_lock_directory_of_ours_is_made_private(private_shm_dir, unique_name):
    os.mkdir(lock_directory(), 0o755)
    os.chmod(lock_directory(), 0o777)
    with NameLock.acquire(unique_name):
        assert os.stat(lock_directory()).st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_lock_directory_of_another_user_is_refused(private_shm_dir, unique_name):
    os.mkdir(lock_directory(), 0o700)
    os.chown(lock_directory(), 12345, 12345)
    with pytest.raises(UnsafeLockDirectoryError, match="belongs to uid 12345"):
        NameLock.acquire(unique_name)
    assert os.listdir(lock_directory()) == []
