"""The arena's pages are populated for sure or not at all (shm/arena.py, `_populate`):
a page the kernel cannot back is an error, never a page left to SIGBUS a worker."""

import errno
import mmap
import os

import pytest

from lmcached.shm import arena as arena_module


class _RefusingMmap(mmap.mmap):
    """A real shared mapping whose madvise fails with one errno."""

    refuse_errno = errno.EINVAL

    def madvise(self, *args) -> None:
        raise OSError(self.refuse_errno, os.strerror(self.refuse_errno))


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
    monkeypatch.setattr(_RefusingMmap, "refuse_errno", refused)
    with _RefusingMmap(sparse_segment, 1 << 20) as mapping:
        with pytest.raises(OSError) as caught:
            arena_module._populate(mapping, 0, 1 << 20)
    assert caught.value.errno == refused
    assert os.fstat(sparse_segment).st_blocks == 0  # no page was touched


def test_populate_on_a_kernel_without_madv_populate_write_touches_every_page(sparse_segment):
    """EINVAL (Linux < 5.14 does not know the advice): one byte per page is touched."""
    with _RefusingMmap(sparse_segment, 1 << 20) as mapping:
        arena_module._populate(mapping, 0, 1 << 20)
    assert os.fstat(sparse_segment).st_blocks * 512 == 1 << 20  # every page allocated
