"""Arena: create/attach/prefault/unlink, zero-copy views, cross-process (the orphan
sweep is tested in test_janitor.py)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lmcached.shm.arena import ARENA_MAGIC, HEADER_BYTES, SEGMENT_HEADER, Arena
from lmcached.shm.janitor import list_segments

MiB = 1 << 20


def run_child(code: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (a real separate process, like a worker)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_create_prefaults_with_progress_and_close_unlinks(unique_name):
    calls = []
    arena = Arena.create(unique_name, 8 * MiB, MiB, progress=lambda d, t: calls.append((d, t)))
    entry = arena.segment_name.lstrip("/")
    assert entry in list_segments(unique_name)
    assert os.stat(f"/dev/shm/{entry}").st_mode & 0o777 == 0o600
    assert calls[-1] == (8 * MiB, 8 * MiB)
    assert arena.num_blocks == (8 * MiB - HEADER_BYTES) // MiB == 7
    arena.close()
    arena.close()  # idempotent
    assert list_segments(unique_name) == []


def test_reserve_prefaults_an_arena_created_sparse_and_may_be_given_up(unique_name):
    """`create(prefault=False)` then `reserve()`: the daemon answers requests between
    the steps; a step that raises leaves the arena to its owner to unlink."""
    with Arena.create(unique_name, 200 * MiB, MiB, prefault=False) as arena:
        path = f"/dev/shm/{arena.segment_name.lstrip('/')}"
        assert os.stat(path).st_blocks * 512 <= HEADER_BYTES  # sparse: the header only
        calls = []
        arena.reserve(lambda done, total: calls.append((done, total)))
        assert calls[-1] == (200 * MiB, 200 * MiB) and len(calls) >= 3  # in steps
        assert os.stat(path).st_blocks * 512 >= 200 * MiB  # every page reserved
    arena = Arena.create(unique_name, 200 * MiB, MiB, prefault=False)

    def give_up(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        arena.reserve(give_up)
    assert list_segments(unique_name) == [arena.segment_name.lstrip("/")]
    arena.close()
    assert list_segments(unique_name) == []


def test_views_alias_the_arena_bytes_zero_copy(unique_name):
    with Arena.create(unique_name, 4 * MiB, 64 * 1024) as arena:
        base = arena.block_view(0).data_ptr()
        view = arena.view(5, torch.bfloat16, (2, 3, 4), offset_bytes=128)
        assert view.data_ptr() - base == 5 * 64 * 1024 + 128
        assert view.dtype == torch.bfloat16 and view.is_contiguous()
        view.fill_(1.5)
        raw = arena.block_view(5)[128 : 128 + view.numel() * 2]
        assert raw.view(torch.bfloat16).eq(1.5).all()
        assert arena.block_view(6).data_ptr() - base == 6 * 64 * 1024
        del view, raw


@pytest.mark.parametrize(
    "args, message",
    [
        ((63, torch.uint8, (1,)), "block_id 63 out of range: the arena has 63 blocks"),
        ((-1, torch.uint8, (1,)), "out of range"),
        ((0, torch.float32, (64 * 1024,)), "needs 262144 bytes at offset 0, but a block holds 65536"),
        ((0, torch.complex64, (1,)), "unsupported dtype"),
        ((0, torch.float32, (2,), 2), "multiple of 4"),
    ],
)
def test_bad_views_raise_value_error_with_numbers(unique_name, args, message):
    with Arena.create(unique_name, 4 * MiB, 64 * 1024) as arena:
        with pytest.raises(ValueError, match=message):
            arena.view(*args)


def test_create_refuses_bad_names_and_sizes(unique_name):
    with pytest.raises(ValueError, match="arena name"):
        Arena.create("bad/name", 4 * MiB)
    with pytest.raises(ValueError, match="capacity_bytes"):
        Arena.create(unique_name, 100)
    with pytest.raises(ValueError, match="multiple of 64"):
        Arena.create(unique_name, 4 * MiB, 100)


def test_block_bytes_is_set_once(unique_name):
    with Arena.create(unique_name, 4 * MiB) as arena:
        assert arena.num_blocks == 0
        arena.set_block_bytes(MiB)
        arena.set_block_bytes(MiB)
        with pytest.raises(ValueError, match="already"):
            arena.set_block_bytes(2 * MiB)


def test_attach_checks_the_generation(unique_name):
    with Arena.create(unique_name, 4 * MiB, MiB) as arena:
        with pytest.raises(FileNotFoundError):
            Arena.attach(unique_name, arena.generation + 1, MiB, 4 * MiB)
        with pytest.raises(ValueError, match=f"holds {4 * MiB} bytes, but the daemon announced"):
            Arena.attach(unique_name, arena.generation, MiB, 8 * MiB)
        client = Arena.attach(unique_name, arena.generation, MiB, 4 * MiB)
        assert client.capacity_bytes == 4 * MiB and not client.is_owner
        client.close()
        assert arena.segment_name.lstrip("/") in list_segments(unique_name)


def test_attach_trusts_the_daemons_word_not_the_header_and_maps_it_read_only(unique_name):
    """Every client can write the header: a forged one changes nothing for the next
    client, and a client's own mapping of it is read-only (a write there faults)."""
    with Arena.create(unique_name, 4 * MiB, MiB) as arena:
        arena.numpy_view(arena.block_offset(1), 4096)[:] = 7
        arena.numpy_view(0, SEGMENT_HEADER.size)[:] = 0xFF  # magic, generation, sizes...
        client = Arena.attach(unique_name, arena.generation, MiB, 4 * MiB)
        assert (client.capacity_bytes, client.num_blocks) == (4 * MiB, 3)
        assert (client.numpy_view(client.block_offset(1), 4096) == 7).all()
        client.close()
        result = run_child(f"""
            from lmcached.shm.arena import Arena
            client = Arena.attach({unique_name!r}, {arena.generation}, {MiB}, {4 * MiB})
            client.numpy_view(client.block_offset(0), 8)[:] = 1  # a block: writable
            print("block written", flush=True)
            client.numpy_view(0, 8)[:] = 0  # the header: SIGSEGV
            print("header written", flush=True)
            """)
        assert result.stdout.split("\n")[0] == "block written"
        assert result.returncode == -11 and "header written" not in result.stdout
        assert (arena.numpy_view(0, SEGMENT_HEADER.size) == 0xFF).all()
        assert (arena.numpy_view(arena.block_offset(0), 8) == 1).all()


def test_child_writes_block_parent_reads_and_segment_outlives_child(unique_name):
    arena = Arena.create(unique_name, 16 * MiB, MiB)
    try:
        result = run_child(
            f"""
            import torch
            from lmcached.shm.arena import Arena
            arena = Arena.attach({unique_name!r}, {arena.generation}, {MiB}, {16 * MiB})
            view = arena.view(7, torch.int32, ({MiB} // 4,))
            view.copy_(torch.arange({MiB} // 4, dtype=torch.int32) * 3)
            print("wrote")
            """
        )
        assert result.returncode == 0, result.stderr
        assert "wrote" in result.stdout
        # The child exited normally: the segment must still exist (no resource_tracker).
        assert arena.segment_name.lstrip("/") in list_segments(unique_name)
        got = arena.view(7, torch.int32, (MiB // 4,))
        assert torch.equal(got, torch.arange(MiB // 4, dtype=torch.int32) * 3)
        del got
    finally:
        arena.close()
    assert list_segments(unique_name) == []


def test_create_gives_the_segment_to_a_group(unique_name):
    other_groups = [g for g in os.getgroups() if g != os.getegid()]
    if os.geteuid() == 0:
        gid = 54321  # root may give it to any gid
    elif other_groups:
        gid = other_groups[0]
    else:
        pytest.skip("needs root or a supplementary group")
    with Arena.create(unique_name, 4 * MiB, MiB, mode=0o660, gid=gid) as arena:
        st = os.stat(f"/dev/shm/{arena.segment_name.lstrip('/')}")
        assert (st.st_mode & 0o777, st.st_gid) == (0o660, gid)


# ------------------------------------------------------- anonymous (memfd) arenas
def test_memfd_arena_header_and_close_release_its_descriptor(unique_name):
    arena = Arena.create_memfd(unique_name, 1234, 4 * MiB)
    fd = arena.export_fd()
    assert os.fstat(fd).st_size == 4 * MiB
    assert os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:lmcached.{unique_name}.1234")
    assert not os.get_inheritable(fd)  # MFD_CLOEXEC: no child gets it by accident
    arena.set_block_bytes(MiB)  # the owner writes it into the header
    header = SEGMENT_HEADER.unpack(os.pread(fd, SEGMENT_HEADER.size, 0))
    assert header[:3] == (ARENA_MAGIC, 1234, os.getpid()) and header[4:] == (4 * MiB, MiB)
    assert not [n for n in os.listdir("/dev/shm") if unique_name in n]  # it has no name
    arena.close()
    arena.close()  # idempotent
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(ValueError, match="closed"):
        arena.export_fd()


def test_from_fd_shares_bytes_with_a_child_both_ways(unique_name):
    arena = Arena.create_memfd(unique_name, 77, 8 * MiB, MiB)
    try:
        fd = arena.export_fd()
        arena.numpy_view(arena.block_offset(2), 4096)[:] = 0x5A
        code = f"""
            import os, sys
            from lmcached.shm.arena import Arena
            fd = int(sys.argv[1])
            arena = Arena.from_fd(fd, 77, {MiB}, {8 * MiB})
            os.close(fd)  # the mapping outlives the descriptor
            assert not arena.is_owner and arena.num_blocks == 7 and arena.name == {unique_name!r}
            print(int(arena.numpy_view(arena.block_offset(2), 4096).sum()))
            arena.numpy_view(arena.block_offset(6), 4096)[:] = 0xA5
            arena.close()
            """
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(fd)],
                                pass_fds=[fd], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [str(0x5A * 4096)]
        assert (arena.numpy_view(arena.block_offset(6), 4096) == 0xA5).all()
        os.fstat(fd)  # the child's close was its own copy: ours is open
    finally:
        arena.close()


def test_from_fd_refuses_other_memory_and_leaves_the_descriptor_to_the_caller(unique_name):
    arena = Arena.create_memfd(unique_name, 5, 2 * MiB, MiB, prefault=False)
    zeros = os.memfd_create("not-an-arena")
    try:
        with pytest.raises(ValueError, match="generation 5, not of generation 6"):
            Arena.from_fd(arena.export_fd(), 6, MiB, 2 * MiB)
        with pytest.raises(ValueError, match=f"holds {2 * MiB} bytes, but the daemon announced"):
            Arena.from_fd(arena.export_fd(), 5, MiB, 4 * MiB)
        os.pwrite(arena.export_fd(), bytes(SEGMENT_HEADER.size), 0)  # a client's forgery
        client = Arena.from_fd(arena.export_fd(), 5, MiB, 2 * MiB)
        assert (client.name, client.num_blocks) == (unique_name, 1)
        client.close()  # unmaps only
        os.ftruncate(zeros, 2 * MiB)  # memory of another name: the daemon's word is enough
        copy = Arena.from_fd(zeros, 5, MiB, 2 * MiB)
        assert (copy.name, copy.num_blocks) == ("anonymous", 1)
        copy.close()
        os.fstat(arena.export_fd())
        with Arena.create(unique_name + "-named", 2 * MiB, prefault=False) as named:
            with pytest.raises(ValueError, match="only an anonymous arena"):
                named.export_fd()
    finally:
        os.close(zeros)
        arena.close()
