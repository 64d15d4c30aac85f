"""The arena: one POSIX shared-memory segment cut into fixed-size blocks.

Why this file exists: the KV bytes live here, in memory that every process on the node
maps once and reads in place. The daemon is the only process that creates, prefaults
and unlinks an arena (`Arena.create`); clients `Arena.attach` to it. Like CPython's
`multiprocessing.shared_memory`, but the owner is the only one who unlinks: attaching
goes through posix_ipc, which never registers the segment with Python's
resource_tracker (on Python 3.11 a `SharedMemory(name)` attach is registered, and the
attaching process unlinks the daemon's segment when it exits, CPython gh-82300).

Segment layout::

    offset 0            HEADER_BYTES (4 KiB)                               capacity_bytes
    | header (magic,   | block 0 | block 1 | ... | block num_blocks-1 | unused tail |
    |  generation, pid)|<------- block_bytes each ------------------->|

Segment names are `/lmcached.<name>.<generation>`: the generation (nanoseconds since the
epoch at creation) changes on every daemon start, so a client of a restarted daemon can
never map a stale segment. The header (magic, generation, owner pid and create time,
capacity, block size) is written by the owner for whoever inspects a segment by hand;
nothing trusts it, since every client can write it: clients take the generation, block
size and capacity from the daemon's HELLO and map the header read-only, and the janitor
(`janitor.py`) decides which segments are orphans from a lock the daemon holds.

Writes into untouched shared memory are several times slower than writes into touched
memory, so `create` reserves and prefaults every page (`pages.py` says how and why).

An anonymous arena (`create_memfd`, the memory of a "fake" device tier) has the same
layout in a memfd instead of a named segment: clients get its descriptor over the
daemon's socket (SCM_RIGHTS) and map it with `from_fd`; nothing of it is in /dev/shm.
"""

import mmap
import os
import struct
import time
from typing import TYPE_CHECKING

import numpy as np
import posix_ipc

from lmcached.shm import memfd, pages
from lmcached.shm.pages import ProgressCallback
from lmcached.shm.segment import (
    ARENA_MAGIC,
    HEADER_BYTES,
    SEGMENT_HEADER,
    segment_name,
    start_time_s,
)
from lmcached.wire.logger import init_logger

if TYPE_CHECKING:  # torch is imported on first view: the daemon never needs it
    import torch

logger = init_logger(__name__)

# Dtypes a block view may have (KV caches are fp16/bf16/fp32/fp8; ints for headers).
SUPPORTED_DTYPE_NAMES = (
    "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64", "float8_e4m3fn", "float8_e5m2",
)


class Arena:
    """A mapped arena segment, as its owner (daemon) or as an attached client.

    Use `Arena.create` (daemon) or `Arena.attach` (clients); do not call the
    constructor directly.

    Attributes:
        name: the daemon name part of the segment name.
        generation: the daemon's generation (segment names differ per generation).
        capacity_bytes: size of the segment in bytes.
        block_bytes: size of a block in bytes (0 until `set_block_bytes`).
        num_blocks: number of whole blocks after the header.
        is_owner: True in the process that created the segment.
    """

    def __init__(
        self,
        name: str,
        generation: int,
        mapping: mmap.mmap,
        capacity_bytes: int,
        block_bytes: int,
        is_owner: bool,
    ) -> None:
        self.name = name
        self.generation = generation
        self.capacity_bytes = capacity_bytes
        self.is_owner = is_owner
        self._mmap: mmap.mmap | None = mapping
        self._memfd: int | None = None  # an anonymous (memfd) arena's descriptor, owner only
        # One flat uint8 alias of the whole segment, made on first use; every view is a
        # slice of it. [capacity_bytes], uint8, cpu
        self._u8_tensor: "torch.Tensor | None" = None
        self.block_bytes = 0
        self.num_blocks = 0
        if block_bytes:
            self.set_block_bytes(block_bytes)

    # ---------------------------------------------------------------- creation
    @classmethod
    def create(
        cls,
        name: str,
        capacity_bytes: int,
        block_bytes: int = 0,
        mode: int = 0o600,
        prefault: bool = True,
        progress: ProgressCallback | None = None,
        gid: int | None = None,
    ) -> "Arena":
        """Create, map and prefault a new arena segment (daemon only).

        Args:
            name: daemon name, 1-64 characters of [A-Za-z0-9_-].
            capacity_bytes: segment size in bytes, > HEADER_BYTES.
            block_bytes: block size in bytes (multiple of 64), or 0 to set it later with
                `set_block_bytes` (the daemon does so when the first layout attaches).
            mode: permission bits of the segment (0600: only the daemon's user).
            prefault: reserve every page (posix_fallocate, one daemon at a time) and
                populate it (MADV_POPULATE_WRITE, else read a byte per page) now, so that
                no store pays first-touch page faults later, nor finds /dev/shm full. Off
                only in tests that want a sparse arena.
            progress: called as progress(done_bytes, capacity_bytes) while prefaulting,
                and as progress(0, capacity_bytes) while another process reserves (it
                may raise to give up).
            gid: group owning the segment (the daemon's `--allow-group`, whose members
                then map it with mode 0660), or None for the creator's group.

        Returns:
            The owning arena; `close()` unmaps and unlinks it.

        Raises:
            ValueError: bad name, capacity or block size.
            posix_ipc.ExistentialError: a segment of that name exists (O_EXCL).
            OSError: the segment cannot be sized, mapped or reserved (ENOSPC: /dev/shm
                has no room for it; ENOMEM: a memory limit), or given to group `gid`
                (PermissionError: the creator is not a member). Nothing is left in
                /dev/shm.
        """
        if capacity_bytes <= HEADER_BYTES:
            raise ValueError(
                f"capacity_bytes must exceed the {HEADER_BYTES}-byte header, "
                f"got {capacity_bytes}"
            )
        generation = time.time_ns()
        shm_name = segment_name(name, generation)
        shm = posix_ipc.SharedMemory(
            shm_name, posix_ipc.O_CREAT | posix_ipc.O_EXCL, mode=mode, size=capacity_bytes
        )
        try:
            if gid is not None:
                os.fchown(shm.fd, -1, gid)
            os.fchmod(shm.fd, mode)  # shm_open applied the umask (0022 under systemd)
            mapping = mmap.mmap(shm.fd, capacity_bytes)
        except BaseException:
            shm.close_fd()
            shm.unlink()
            raise
        try:
            pid = os.getpid()
            SEGMENT_HEADER.pack_into(
                mapping,
                0,
                ARENA_MAGIC,
                generation,
                pid,
                start_time_s(pid),
                capacity_bytes,
                block_bytes,
            )
            arena = cls(name, generation, mapping, capacity_bytes, block_bytes, True)
            if prefault:
                arena._reserve(shm.fd, progress)
        except BaseException:
            # Undo the half-built segment (and free its reserved pages), then re-raise.
            posix_ipc.unlink_shared_memory(shm_name)
            mapping.close()
            raise
        finally:
            shm.close_fd()
        logger.info(
            "created arena %s: %d bytes, block_bytes=%d", shm_name, capacity_bytes, block_bytes
        )
        return arena

    @classmethod
    def create_memfd(cls, name: str, generation: int, capacity_bytes: int,
                     block_bytes: int = 0, prefault: bool = True,
                     progress: ProgressCallback | None = None) -> "Arena":
        """An anonymous arena (memfd_create) with the header of `create`, mapped by
        others only through its descriptor (`export_fd`): see shm/memfd.py `create_memfd`
        for its arguments and errors; `prefault` and `progress` as `create`."""
        fd, mapping = memfd.create_memfd(name, generation, capacity_bytes, block_bytes)
        try:
            arena = cls(name, generation, mapping, capacity_bytes, block_bytes, True)
            arena._memfd = fd
            if prefault:
                arena.prefault(progress, reserve_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        logger.info("created anonymous arena %s: %d bytes, block_bytes=%d",
                    arena.segment_name, capacity_bytes, block_bytes)
        return arena

    @classmethod
    def from_fd(cls, fd: int, generation: int, block_bytes: int, size_bytes: int,
                populate: bool = True) -> "Arena":
        """Map an anonymous arena received as a file descriptor, its header read-only:
        see shm/memfd.py `map_fd` for its arguments and errors; `block_bytes` is the
        block size the daemon announced. The result is a client arena (`is_owner`
        False): `close()` only unmaps it."""
        name, mapping = memfd.map_fd(fd, generation, size_bytes, populate)
        return cls(name, generation, mapping, size_bytes, block_bytes, False)

    def export_fd(self) -> int:
        """The descriptor of an anonymous arena (owner only): sent to clients by
        OPEN_TIER. It stays the arena's: do not close it.

        Raises:
            ValueError: a named (POSIX shared memory) arena, or a closed one.
        """
        if self._mmap is None:
            raise ValueError(f"arena {self.segment_name} is closed: its descriptor is gone")
        if self._memfd is None:
            raise ValueError(f"arena {self.segment_name} has no descriptor to export: "
                             "only an anonymous arena (create_memfd) has one")
        return self._memfd

    @classmethod
    def attach(
        cls, name: str, generation: int, block_bytes: int, capacity_bytes: int,
        populate: bool = True,
    ) -> "Arena":
        """Map an existing arena read-write (clients), its header read-only.

        Everything comes from the daemon's HELLO, nothing from the segment's bytes: every
        client can write those, so a header that decided who may attach would let one
        client lock the others out. The generation is part of the segment's name, so a
        segment of another generation is never opened.

        The segment is not registered with Python's resource_tracker, so this process
        exiting never unlinks it.

        Args:
            name: daemon name (HELLO's `arena_name`).
            generation: the generation the daemon announced (HELLO).
            block_bytes: block size the daemon announced (HELLO).
            capacity_bytes: segment size the daemon announced (HELLO); this many bytes
                are mapped.
            populate: map every page now (~40 ms per GiB here), so that the first read
                does not pay soft page faults.

        Raises:
            FileNotFoundError: no such segment (the daemon is gone or restarted).
            ValueError: the segment is smaller than `capacity_bytes`.
        """
        shm_name = segment_name(name, generation)
        try:
            shm = posix_ipc.SharedMemory(shm_name)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(f"arena segment {shm_name} does not exist") from exc
        try:
            if shm.size < capacity_bytes or capacity_bytes <= HEADER_BYTES:
                raise ValueError(
                    f"segment {shm_name} holds {shm.size} bytes, but the daemon announced "
                    f"an arena of {capacity_bytes} bytes"
                )
            mapping = mmap.mmap(shm.fd, capacity_bytes)
        finally:
            shm.close_fd()
        try:
            if populate:
                pages.populate(mapping, 0, capacity_bytes)
            pages.protect_pages(mapping, HEADER_BYTES)
        except BaseException:
            mapping.close()
            raise
        return cls(name, generation, mapping, capacity_bytes, block_bytes, False)

    def set_block_bytes(self, block_bytes: int) -> None:
        """Cut the arena into blocks of `block_bytes` (once; the daemon's first layout).

        Raises:
            ValueError: not a positive multiple of 64, larger than the arena, or a
                different block size was already set.
        """
        if block_bytes <= 0 or block_bytes % 64:
            raise ValueError(f"block_bytes must be a positive multiple of 64, got {block_bytes}")
        if self.block_bytes and block_bytes != self.block_bytes:
            raise ValueError(
                f"block_bytes is already {self.block_bytes}, cannot change it to {block_bytes}"
            )
        num_blocks = (self.capacity_bytes - HEADER_BYTES) // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"block_bytes {block_bytes} does not fit in the arena "
                f"({self.capacity_bytes - HEADER_BYTES} usable bytes)"
            )
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        if self.is_owner:
            struct.pack_into("<Q", self._mmap, SEGMENT_HEADER.size - 8, block_bytes)

    def reserve(self, progress: ProgressCallback | None = None) -> None:
        """Reserve and prefault every page of an arena created with `prefault=False`
        (what `create` does with `prefault=True`), so that its owner can answer requests
        meanwhile: `progress` is called after each step, and may raise to give up.

        Raises:
            OSError: as `create` (ENOSPC, ENOMEM, EFAULT); the arena stays as it is:
                its owner closes (unlinks) it.
            Whatever `progress` raises.
        """
        assert self.is_owner and self._memfd is None, "reserve() is the owner's, of a named segment"
        shm = posix_ipc.SharedMemory(self.segment_name)  # ours: /dev/shm is sticky
        try:
            self._reserve(shm.fd, progress)
        finally:
            shm.close_fd()

    def stat(self) -> os.stat_result:
        """The file status of the segment now (`st_mode`, `st_uid`, `st_gid`: who may map
        it; the owner, or root, may have changed them since `create`), or of an anonymous
        arena's descriptor (its owner's).

        Raises:
            FileNotFoundError: the named segment is gone (unlinked).
            ValueError: the arena is closed.
        """
        if self._mmap is None:
            raise ValueError(f"arena {self.segment_name} is closed")
        if self._memfd is not None:
            return os.fstat(self._memfd)
        try:
            shm = posix_ipc.SharedMemory(self.segment_name, read_only=True)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"arena segment {self.segment_name} is gone") from None
        try:
            return os.fstat(shm.fd)
        finally:
            shm.close_fd()

    def _reserve(self, fd: int, progress: ProgressCallback | None) -> None:
        """Prefault with every page reserved in the segment's file `fd`, one daemon at a
        time (`pages.reservation_lock`: progress(0, capacity) while another reserves)."""
        total = self.capacity_bytes
        waiting = None if progress is None else lambda: progress(0, total)
        with pages.reservation_lock(waiting):
            self.prefault(progress, reserve_fd=fd)

    def prefault(self, progress: ProgressCallback | None = None,
                 reserve_fd: int | None = None) -> None:
        """Populate every page of the segment for writing, in steps, reporting progress.

        Args:
            progress: called as progress(done_bytes, capacity_bytes) after each step.
            reserve_fd: the segment's file: each step's pages are first allocated in it
                (posix_fallocate), so that a tmpfs without room fails here with ENOSPC,
                not a later store with SIGBUS. None: populate only.

        Raises:
            OSError: the pages cannot be reserved (ENOSPC) or populated (`pages.populate`).
        """
        pages.prefault(self._mmap, self.capacity_bytes, progress, reserve_fd)

    # ------------------------------------------------------------------- views
    @property
    def _u8(self) -> "torch.Tensor":
        if self._u8_tensor is None:
            if self._mmap is None:
                raise ValueError(f"arena {self.segment_name} is closed")
            import torch

            self._u8_tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        return self._u8_tensor

    def block_offset(self, block_id: int) -> int:
        """Byte offset of block `block_id` in the segment.

        Raises:
            ValueError: block_id is not in [0, num_blocks).
        """
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(
                f"block_id {block_id} out of range: the arena has {self.num_blocks} blocks"
            )
        return HEADER_BYTES + block_id * self.block_bytes

    def block_view(self, block_id: int) -> "torch.Tensor":
        """The bytes of one block: uint8 `[block_bytes]`, cpu, aliasing the arena."""
        offset = self.block_offset(block_id)
        return self._u8[offset : offset + self.block_bytes]

    def view(
        self,
        block_id: int,
        dtype: "torch.dtype",
        shape: tuple[int, ...],
        offset_bytes: int = 0,
    ) -> "torch.Tensor":
        """A zero-copy tensor over part of one block.

        Args:
            block_id: which block.
            dtype: a torch dtype named in SUPPORTED_DTYPE_NAMES.
            shape: tensor shape; its bytes must fit in the block after `offset_bytes`.
            offset_bytes: start within the block, a multiple of the dtype's size.

        Returns:
            Contiguous tensor of `shape` and `dtype` on cpu aliasing the arena bytes.

        Raises:
            ValueError: bad block id, unsupported dtype, misaligned offset, or a shape
                that does not fit (the message gives the numbers).
        """
        if str(dtype).removeprefix("torch.") not in SUPPORTED_DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype}; supported: {SUPPORTED_DTYPE_NAMES}")
        itemsize = dtype.itemsize
        numel = 1
        for dim in shape:
            if dim < 0:
                raise ValueError(f"negative dimension in shape {tuple(shape)}")
            numel *= dim
        nbytes = numel * itemsize
        if offset_bytes < 0 or offset_bytes % itemsize:
            raise ValueError(
                f"offset_bytes {offset_bytes} must be a non-negative multiple of {itemsize}"
            )
        if offset_bytes + nbytes > self.block_bytes:
            raise ValueError(
                f"shape {tuple(shape)} of {dtype} needs {nbytes} bytes at offset "
                f"{offset_bytes}, but a block holds {self.block_bytes} bytes"
            )
        start = self.block_offset(block_id) + offset_bytes
        return self._u8[start : start + nbytes].view(dtype).view(shape)

    def numpy_view(self, offset: int, nbytes: int) -> np.ndarray:
        """uint8 numpy array `[nbytes]` aliasing segment bytes [offset, offset+nbytes)."""
        if self._mmap is None:
            raise ValueError(f"arena {self.segment_name} is closed")
        return np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes, offset=offset)

    @property
    def base_ptr(self) -> int:
        """Address of the first byte of the mapping in this process."""
        return self._u8.data_ptr()

    @property
    def segment_name(self) -> str:
        """The POSIX name of this arena's segment."""
        return segment_name(self.name, self.generation)

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        """Unmap the arena; the owner of a named segment also unlinks it, the owner of
        an anonymous one closes its descriptor (the kernel frees the memory once no
        process maps it). Safe to call twice.

        Views handed out earlier keep the mapping alive until they are garbage; their
        contents are undefined after the owner's close.
        """
        if self._mmap is None:
            return
        if self._memfd is not None:  # anonymous: freed with the last descriptor and mapping
            os.close(self._memfd)
            self._memfd = None
        elif self.is_owner:
            try:
                posix_ipc.unlink_shared_memory(self.segment_name)
            except posix_ipc.ExistentialError:
                logger.warning("arena %s was already unlinked", self.segment_name)
        mapping, self._mmap = self._mmap, None
        self._u8_tensor = None
        try:
            mapping.close()
        except BufferError:
            pass  # views still alias it; the mapping goes when they do

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
