"""A full disk under the disk tier, for real: each daemon runs in a private mount namespace
whose disk directory is a small tmpfs (mounted by the daemon's child before exec, so that
nothing outside the namespace sees it), and the test fills that tmpfs through
/proc/PID/root.

- A `--disk-capacity` larger than the free space stops the start-up with one `Error:` line
  naming both sizes and the fix, and leaves no arena in /dev/shm.
- A filesystem that fills up while the daemon runs (the slot file is created at the first
  HELLO, when the arena's block size is known, and could not be preallocated): spills fail
  with ENOSPC, counted, and the daemon serves on, bit-exact, nothing pinned.
- The default --disk-capacity 10% of a full filesystem: the daemon starts with the tier
  off (disk_enabled:0, disk_off_reason, one ERROR line at start naming the free space).
docs/operator.md, "The disk tier", describes the behaviour.
"""

import ctypes
import os
import re
import subprocess

import pytest
import torch

from conftest import start_daemon
from engine_worker import prompt_kv, small_layout
from test_limits import wait_for
from lmcached.client import CacheEngine
from lmcached.shm.janitor import list_segments

pytestmark = pytest.mark.slow

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
TMPFS_BYTES = 4 << 20


def private_tmpfs(mount_point: str, size_bytes: int):
    """A `preexec_fn`: the child leaves the test's mount namespace and mounts a tmpfs of
    `size_bytes` on `mount_point`, seen by it alone (`unshare --mount`, in the child)."""
    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if (libc.unshare(CLONE_NEWNS)
                or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
                or libc.mount(b"tmpfs", mount_point.encode(), b"tmpfs", 0,
                              f"size={size_bytes},mode=0700".encode())):
            errno = ctypes.get_errno()
            raise OSError(errno, f"private tmpfs on {mount_point}: {os.strerror(errno)}")
    return preexec


def private_tmpfs_refusal(mount_point: str) -> str | None:
    """Why this process cannot mount a private tmpfs, or None if it can."""
    probe = subprocess.run(["true"], preexec_fn=private_tmpfs(mount_point, 1 << 20),
                           capture_output=True)
    return None if probe.returncode == 0 else "cannot mount a private tmpfs"


@pytest.fixture
def mount_point(short_tmp):
    path = os.path.join(short_tmp, "mnt")
    os.mkdir(path, 0o700)
    try:
        refusal = private_tmpfs_refusal(path)
    except (OSError, subprocess.SubprocessError) as exc:
        refusal = f"cannot mount a private tmpfs (needs root or CAP_SYS_ADMIN): {exc}"
    if refusal is not None:
        pytest.skip(refusal)
    return path


def test_a_disk_capacity_larger_than_the_free_space_is_refused_with_one_error_line(
        unique_name, short_tmp, mount_point):
    log_path = os.path.join(short_tmp, "refused.log")
    try:
        started = start_daemon(unique_name, os.path.join(short_tmp, "refused.sock"), log_path,
                               "--capacity", "1MiB", "--block-size", "64KiB",
                               "--disk-path", os.path.join(mount_point, "disk"),
                               "--disk-capacity", "64MiB",
                               preexec_fn=private_tmpfs(mount_point, TMPFS_BYTES))
    except RuntimeError:
        pass
    else:
        started.stop()
        pytest.fail("a daemon started with a --disk-capacity larger than its disk")
    with open(log_path) as f:
        errors = [line for line in f.read().splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, errors
    assert re.fullmatch(r"Error: --disk-capacity 64.00M is more than the 4.00M free in "
                        r"\S+/disk: lower --disk-capacity \(bytes, or a percentage of the "
                        r"free space, e.g. 50%\) or free space there", errors[0]), errors
    assert list_segments(unique_name) == []


def test_a_full_filesystem_under_a_percentage_starts_the_daemon_with_the_tier_off(
        daemon_factory, mount_point):
    """The default --disk-capacity 10% of a full filesystem holds no slot: the daemon
    serves from the arena, says so at start (not at the first client) naming the free
    space and what would fit, and INFO says disk_enabled:0 with the reason."""
    daemon = daemon_factory("--capacity", "1MiB", "--disk-path",
                            os.path.join(mount_point, "disk"),
                            preexec_fn=private_tmpfs(mount_point, 4096))  # one page: full
    log = daemon.log()
    errors = [line for line in log.splitlines() if "disk tier" in line and "is off" in line]
    assert len(errors) == 1, log
    assert re.search(r"ERROR .*disk tier \S+/disk is off: --disk-capacity 10% of the \S+ free "
                     r"in \S+/disk is \d+ bytes, less than one slot of 8192 bytes and the "
                     r"file's 4096-byte header \(12288 bytes\); free at least 120.00K there",
                     errors[0]), errors[0]
    assert "--disk-capacity 0 bytes" not in log
    info = daemon.info()
    assert info["disk_enabled"] == 0 and info["disk_slots"] == 0
    assert info["disk_off_reason"].startswith("--disk-capacity 10% of the ")
    layout = small_layout()
    tokens = list(range(100))
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        engine.store(torch.tensor(tokens), prompt_kv(layout, tokens))
        kv, mask = engine.retrieve(torch.tensor(tokens), return_tuple=False)
        assert int(mask.sum()) == 100 and torch.equal(kv, prompt_kv(layout, tokens))
    assert daemon.info()["disk_enabled"] == 0
    assert daemon.stop() == 0
    assert list_segments(daemon.name) == []


def test_a_disk_that_fills_up_under_the_daemon_drops_spills_and_the_daemon_serves_on(
        daemon_factory, mount_point):
    # No --block-size: the slot file is made at the first HELLO, after the disk filled up.
    daemon = daemon_factory("--capacity", "256KiB", "--disk-path",
                            os.path.join(mount_point, "disk"), "--disk-capacity", "2MiB",
                            "--disk-policy", "write-through",
                            preexec_fn=private_tmpfs(mount_point, TMPFS_BYTES))
    seen = f"/proc/{daemon.proc.pid}/root{mount_point}"  # the daemon's tmpfs, from here
    with open(os.path.join(seen, "filler"), "wb") as f:  # leave 64 KiB free
        f.write(bytes(os.statvfs(seen).f_bavail * os.statvfs(seen).f_frsize - (64 << 10)))
    layout = small_layout()
    prompts = [list(range(start, start + 100)) for start in range(0, 20_000, 1000)]
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        for tokens in prompts:
            engine.store(torch.tensor(tokens), prompt_kv(layout, tokens))
        info = wait_for(lambda: (lambda i: i if i["disk_errors_nospace"] >= 1
                                 and not i["disk_queue_values"] else None)(daemon.info()),
                        what="a write that finds the disk full", timeout_s=30)
        # A failed write's slot is erased after it (it may hold the chunk it evicted), and
        # on a full disk that erase may fail too: each failure is counted by kind.
        assert info["disk_write_failures"] >= 1 and info["disk_errors_nospace"] >= 1
        assert info["disk_used_slots"] == info["disk_writes"] < len(prompts) * 7
        # The daemon serves on: the last prompt is still in the arena, bit-exact.
        kv, mask = engine.retrieve(torch.tensor(prompts[-1]), return_tuple=False)
        assert int(mask.sum()) == 100
        assert torch.equal(kv, prompt_kv(layout, prompts[-1]))
    assert "cannot preallocate" in daemon.log()
    info = daemon.info()
    assert info["pinned_blocks"] == 0 and info["writing_blocks"] == 0
    assert daemon.stop() == 0
    assert list_segments(daemon.name) == []
