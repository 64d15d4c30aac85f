"""The disk tier's slot file: a preallocated file cut into fixed-size slots, one record each.

Why this file exists: it is the only code that reads and writes the disk tier's bytes
(`tier.py` decides when, on worker threads). Layout (all integers little-endian)::

    offset 0        4096                    8192                       4096 + slot_bytes
    | superblock    | slot 0: envelope page   | slot 0: record pages     | slot 1 ...
    | "LMCDISK1",   | envelope (64 B, the L2  | the record as in the     |
    |  version u32  |   value's: magic, len,  |   arena (header, token   |
    |  = 2, flags,  |   xxh3_64, ns fp,       |   ids, KV), then an      |
    |  slot_bytes,  |   hash), the parent     |   undefined tail, up to  |
    |  num_slots    |   hash (16 B), zeros    |   round_up(block_bytes)  |

The parent hash (the chunk hash before this one in its chain; zero: the chain's first,
or not known) is not part of the envelope (an L2 value has none): it is what the event
feed announces a chunk read back after a restart with (lmcached/daemon/events.py), so
that a router can chain it; nothing is served by it (a reader checks a chunk's token
ids against its own request). A slot written before it existed reads as zero.

A slot holds a spilled value (lmcached/daemon/spill/envelope.py) whose envelope and record lie
in pages of their own: the record is page-aligned in the file, as an arena block is in
memory, so that the writers and readers move it straight between the arena's blocks
and the file with O_DIRECT (`write_record`, `read`: no bounce buffer, after vLLM's
offloading disk backend and LMCache's local disk), and `envelope.verify_parts` checks
the envelope page and the record in its blocks. Version 1 (the envelope at the slot's
start, the record right after it at byte 64) is formatted anew at start, its chunks
dropped (logged), as for another slot size.

Torn writes: a slot is written in two steps: its envelope page zeroed and its record
pages, one `pwritev` (`write_record`), then the envelope page (the commit mark) last
(`commit`). A crash between them, or during the first, leaves a slot whose envelope
has no magic: the index rebuild skips it. A crash during the last leaves the old
envelope or the new one, both over a record that the checksum (verified on every read)
judges. After Redis's RDB rename and the "commit record last" rule of write-ahead logs.

I/O is O_DIRECT (page-aligned memory, offsets and lengths; no page-cache pollution),
with a buffered fallback where the filesystem refuses it (tmpfs), logged once.

The file is only ever opened relative to the checked directory's descriptor
(`directory.DiskDirectory.open_file`: no symlink followed, never a FIFO or a device, a
file of the daemon's uid with mode 0600); a second open (O_DIRECT, the scan) must find
the same file (`_open_again`).
"""

import errno
import mmap
import os
import struct

from lmcached.daemon.disk.directory import DiskDirectory
from lmcached.daemon.spill.envelope import ENVELOPE_BYTES
from lmcached.wire.protocol import HASH_BYTES
from lmcached.wire.record_format import RECORD_HEADER_BYTES, read_header
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

PAGE_BYTES = 4096
FILE_NAME = "slots.lmcached"
SUPERBLOCK = struct.Struct("<8sIIQQ")  # magic, version, flags, slot_bytes, num_slots
SUPERBLOCK_MAGIC = b"LMCDISK1"
SUPERBLOCK_VERSION = 2  # 2: the record page-aligned after an envelope page
PARENT_OFFSET = ENVELOPE_BYTES  # the parent hash's offset in a slot's envelope page
_ZERO_PAGE = bytes(PAGE_BYTES)
_ERROR_KINDS = {errno.ENOSPC: "nospace", errno.EFBIG: "nospace", errno.EDQUOT: "nospace",
                errno.EIO: "io", errno.EROFS: "readonly"}
ERROR_KINDS = ("nospace", "io", "readonly", "other")


def error_kind(exc: BaseException) -> str:
    """The INFO kind of an I/O error: nospace (ENOSPC, EFBIG, EDQUOT), io (EIO, a short
    read or write), readonly (EROFS) or other."""
    return _ERROR_KINDS.get(getattr(exc, "errno", None), "other")


def round_up(num_bytes: int, multiple: int = PAGE_BYTES) -> int:
    """`num_bytes` rounded up to a multiple of `multiple`."""
    return -(-num_bytes // multiple) * multiple


def slot_bytes_for(block_bytes: int) -> int:
    """Bytes of a slot that holds one arena block's record: its envelope page and the
    block's bytes rounded up to whole pages."""
    return PAGE_BYTES + round_up(block_bytes)


def aligned_buffer(num_bytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of `num_bytes` (rounded up to pages), for O_DIRECT."""
    return mmap.mmap(-1, round_up(num_bytes))


def read_superblock(directory: DiskDirectory) -> tuple[int, int] | None:
    """(slot_bytes, num_slots) of the slot file in `directory`, or None when there is
    none or it is not one of ours (too short, another magic or version).

    Raises:
        DiskDirectoryError: the file is not a regular file of ours (`open_file`).
        OSError: it cannot be opened or read.
    """
    try:
        fd = directory.open_file(FILE_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return _geometry(_superblock_fields(fd))
    finally:
        os.close(fd)


def _superblock_fields(fd: int) -> tuple | None:
    """The superblock's fields (SUPERBLOCK) of the open slot file, or None: too short."""
    data = os.pread(fd, SUPERBLOCK.size, 0)
    return SUPERBLOCK.unpack(data) if len(data) == SUPERBLOCK.size else None


def _geometry(fields: tuple | None) -> tuple[int, int] | None:
    """(slot_bytes, num_slots) of superblock `fields` of ours, else None."""
    if fields is None:
        return None
    magic, version, _flags, slot_bytes, num_slots = fields
    if magic != SUPERBLOCK_MAGIC or version != SUPERBLOCK_VERSION or slot_bytes % PAGE_BYTES:
        return None
    return slot_bytes, num_slots


def _open_again(directory: DiskDirectory, fd: int, flags: int) -> int:
    """The slot file opened once more relative to `directory` (another open file, for
    O_DIRECT or for the scan), refused unless it is the file of `fd`.

    Raises:
        DiskDirectoryError: see `DiskDirectory.open_file`.
        OSError: it cannot be opened, or is another file now (ESTALE: replaced since
            `fd` was opened).
    """
    again = directory.open_file(FILE_NAME, flags)
    first, second = os.fstat(fd), os.fstat(again)
    if (first.st_dev, first.st_ino) != (second.st_dev, second.st_ino):
        os.close(again)
        raise OSError(errno.ESTALE, f"{directory.file_path(FILE_NAME)} was replaced while "
                                    f"the daemon had it open")
    return again


class SlotFile:
    """The slot file of one disk directory, open for reading and writing slots.

    Use `SlotFile.open`. Every method but `close` may run on any thread at once: each
    is one or two positioned system calls on a shared descriptor.

    Attributes:
        path: the file's path (for messages: it is only ever opened relative to the
            directory's descriptor).
        slot_bytes: bytes per slot (a multiple of PAGE_BYTES: the envelope page, then
            `max_record_bytes` for the record).
        num_slots: how many slots.
        direct: whether I/O bypasses the page cache (O_DIRECT).
    """

    def __init__(self, directory: DiskDirectory, fd: int, slot_bytes: int, num_slots: int,
                 direct: bool) -> None:
        self.path = directory.file_path(FILE_NAME)
        self._directory = directory
        self._fd = fd
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.direct = direct
        self.scan_errors: dict[str, int] = {}  # the last `scan.scan_slots`' failed reads, by kind

    @classmethod
    def open(cls, directory: DiskDirectory, slot_bytes: int,
             num_slots: int) -> tuple["SlotFile", bool]:
        """Open the directory's slot file with this geometry, creating it (or formatting
        it anew, when its slot size differs) as needed; space is preallocated
        (posix_fallocate) where the filesystem allows. The file is opened relative to
        the directory's descriptor, once (`DiskDirectory.open_file`: a regular file of
        ours, mode 0600), and truncated through that descriptor when it is formatted.

        Args:
            directory: the checked and locked disk directory.
            slot_bytes: bytes per slot, a multiple of PAGE_BYTES (the envelope page, then
                `max_record_bytes` for the record: none in a slot of one page).
            num_slots: slots wanted (a larger or smaller file is resized; slots cut off
                are lost).

        Returns:
            (the file, kept): `kept` is True when the existing slots were kept (their
            index can be rebuilt with `scan.scan_slots`).

        Raises:
            DiskDirectoryError: the file is a symlink, a FIFO, a device..., or another
                uid's (the message names it and the fix).
            OSError: the file cannot be created, opened or sized.
            ValueError: slot_bytes is not a multiple of PAGE_BYTES, or num_slots < 1.
        """
        if slot_bytes % PAGE_BYTES or slot_bytes <= 0 or num_slots < 1:
            raise ValueError(f"slot file of {num_slots} slots of {slot_bytes} bytes: slots "
                             f"must be whole pages ({PAGE_BYTES} bytes), at least one")
        path = directory.file_path(FILE_NAME)
        fd = directory.open_file(FILE_NAME, os.O_RDWR, create=True)
        try:
            old = _superblock_fields(fd)
            found = _geometry(old)
            kept = found is not None and found[0] == slot_bytes
            if found is not None and not kept:
                logger.warning("disk tier %s was written with slots of %d bytes, the arena's "
                               "blocks now need %d: its chunks are dropped", path, found[0],
                               slot_bytes)
            if old is not None and old[0] == SUPERBLOCK_MAGIC and old[1] != SUPERBLOCK_VERSION:
                logger.warning("disk tier %s was written in slot format %d, this lmcached "
                               "reads format %d only: the file is formatted anew and its "
                               "chunks are dropped", path, old[1], SUPERBLOCK_VERSION)
            if not kept:
                os.ftruncate(fd, 0)
            size = PAGE_BYTES + slot_bytes * num_slots
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:  # no room, or a filesystem without it: sparse, counted later
                logger.warning("disk tier %s: cannot preallocate %d bytes (%s): slots are "
                               "allocated as they are written, and a full disk is counted "
                               "(INFO disk_errors_nospace)", path, size, exc.strerror or exc)
            superblock = aligned_buffer(PAGE_BYTES)
            SUPERBLOCK.pack_into(superblock, 0, SUPERBLOCK_MAGIC, SUPERBLOCK_VERSION, 0,
                                 slot_bytes, num_slots)
            os.pwrite(fd, superblock, 0)
            direct_fd = cls._reopen_direct(directory, fd)
        except BaseException:
            os.close(fd)
            raise
        if direct_fd is not None:
            os.close(fd)
            fd = direct_fd
        return cls(directory, fd, slot_bytes, num_slots, direct_fd is not None), kept

    @staticmethod
    def _reopen_direct(directory: DiskDirectory, fd: int) -> int | None:
        """The slot file of `fd` opened again O_DIRECT (relative to the directory), or
        None (logged once) where the filesystem refuses."""
        path = directory.file_path(FILE_NAME)
        try:
            direct_fd = _open_again(directory, fd, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            logger.info("disk tier %s: O_DIRECT refused (%s, e.g. tmpfs): buffered I/O",
                        path, exc.strerror or exc)
            return None
        probe = aligned_buffer(PAGE_BYTES)
        try:
            os.preadv(direct_fd, [probe], 0)
        except OSError as exc:
            os.close(direct_fd)
            logger.info("disk tier %s: O_DIRECT reads fail (%s): buffered I/O", path,
                        exc.strerror or exc)
            return None
        return direct_fd

    def slot_offset(self, slot: int) -> int:
        """Byte offset of `slot` in the file."""
        return PAGE_BYTES + slot * self.slot_bytes

    @property
    def max_record_bytes(self) -> int:
        """The longest record a slot holds: its pages after the envelope page."""
        return self.slot_bytes - PAGE_BYTES

    def write_record(self, slot: int, page: mmap.mmap, pieces: list) -> None:
        """Step 1 of a slot's write (the module's "Torn writes"): zero its envelope page
        (the commit mark of the record it held) and write the record pages after it, in
        one `pwritev`.

        Args:
            slot: the slot number.
            page: a page-aligned buffer of at least PAGE_BYTES (`aligned_buffer`); its
                first page is zeroed.
            pieces: the record's bytes in order (bytes-like, e.g. views of arena
                blocks), at most `max_record_bytes` in all. With O_DIRECT (`direct`)
                every piece must start page-aligned in memory and be whole pages long
                (a record's last page is written whole, the tail after the record
                included).

        Raises:
            OSError: the write failed (ENOSPC, EIO, EROFS, a short write as EIO;
                EINVAL for pieces that O_DIRECT refuses).
        """
        head = memoryview(page)[:PAGE_BYTES]
        head[:] = _ZERO_PAGE
        views = [memoryview(piece).cast("B") for piece in pieces]
        assert sum(v.nbytes for v in views) <= self.max_record_bytes, \
            f"record of {sum(v.nbytes for v in views)} bytes > slot; bug"
        self._pwrite([head, *views], self.slot_offset(slot))

    def commit(self, slot: int, page: mmap.mmap, envelope: bytes, parent: bytes = b"") -> None:
        """Step 2 of a slot's write: its envelope page, the commit mark, last.

        Args:
            slot: the slot number.
            page: a page-aligned buffer of at least PAGE_BYTES; its first page is
                overwritten.
            envelope: the slot's envelope (`envelope.encode_envelope` of the record).
            parent: the chunk's parent hash, HASH_BYTES, or b"" (not known, or none).

        Raises:
            OSError: the write failed.
        """
        head = memoryview(page)[:PAGE_BYTES]
        head[:] = _ZERO_PAGE
        head[:ENVELOPE_BYTES] = envelope
        if parent:
            head[PARENT_OFFSET:PARENT_OFFSET + HASH_BYTES] = parent
        self._pwrite([head], self.slot_offset(slot))

    def read_token_ids(self, slot: int, chunk_hash: bytes, buffer: mmap.mmap) -> bytes:
        """The token ids of the record in `slot` (int64 little-endian bytes) when its
        header names `chunk_hash`, else b"": the record's first pages only (one read of
        one page for a chunk of up to 504 tokens), no checksum (whoever uses them hashes
        them: the event feed's subscribers).

        Args:
            slot: the slot number.
            chunk_hash: the chunk it should hold.
            buffer: a page-aligned buffer of at least `max_record_bytes`.

        Raises:
            OSError: the read failed.
        """
        offset = self.slot_offset(slot) + PAGE_BYTES
        view = memoryview(buffer)
        got = os.preadv(self._fd, [view[:PAGE_BYTES]], offset)
        try:
            header = read_header(view[:RECORD_HEADER_BYTES]) if got >= PAGE_BYTES else None
        except ValueError:
            return b""
        if (header is None or header.chunk_hash != chunk_hash
                or header.tokens_end > self.max_record_bytes):
            return b""
        end = header.tokens_end
        if end > PAGE_BYTES:
            length = round_up(end)
            if os.preadv(self._fd, [view[:length]], offset) < end:
                return b""
        return bytes(view[RECORD_HEADER_BYTES:end])

    def write(self, slot: int, page: mmap.mmap, pieces: list, envelope: bytes) -> None:
        """`write_record` then `commit`: a slot's whole write, when nothing needs to be
        checked between the two (`writes.py` checks that the record's arena blocks were
        not reused while they were written).

        Raises:
            OSError: a write failed.
        """
        self.write_record(slot, page, pieces)
        self.commit(slot, page, envelope)

    def erase(self, slot: int, page: mmap.mmap) -> None:
        """Zero the envelope page of `slot`: the rebuild skips it from now on (an EVICT
        or CLEAR that a restart must not undo).

        Raises:
            OSError: the write failed.
        """
        head = memoryview(page)[:PAGE_BYTES]
        head[:] = _ZERO_PAGE
        self._pwrite([head], self.slot_offset(slot))

    def _pwrite(self, views: list[memoryview], offset: int) -> None:
        written = os.pwritev(self._fd, views, offset)
        length = sum(v.nbytes for v in views)
        if written != length:
            raise OSError(5, f"short write: {written} of {length} bytes at {offset}")

    def read(self, slot: int, page: mmap.mmap, pieces: list, record_bytes: int) -> memoryview:
        """Read `slot`: its envelope page into `page`, its record into `pieces`, in one
        `preadv`.

        Args:
            slot: the slot number.
            page: a page-aligned buffer of at least PAGE_BYTES.
            pieces: writable buffers for the record in order (e.g. the views of fresh
                arena blocks), at least `record_bytes` in all, at most
                `max_record_bytes`; with O_DIRECT page-aligned and whole pages each.
            record_bytes: the record's length (from the index).

        Returns:
            A view of the envelope in `page` (ENVELOPE_BYTES), to be checked with the
            record's first `record_bytes` by `envelope.verify_parts`.

        Raises:
            OSError: the read failed, or came back short (a truncated file) as EIO.
        """
        head = memoryview(page)[:PAGE_BYTES]
        views = [memoryview(piece).cast("B") for piece in pieces]
        got = os.preadv(self._fd, [head, *views], self.slot_offset(slot))
        if got < PAGE_BYTES + record_bytes:
            raise OSError(5, f"short read: {got} of {PAGE_BYTES + record_bytes} bytes "
                             f"(file truncated?)")
        return head[:ENVELOPE_BYTES]

    def open_read_only(self) -> int:
        """The file opened once more, read-only, relative to the directory (the index
        rebuild's descriptor, `scan.scan_slots`); the caller closes it.

        Raises:
            OSError: it cannot be opened, or is another file now (ESTALE).
            DiskDirectoryError: the name now leads to something else than a regular
                file of ours.
        """
        return _open_again(self._directory, self._fd, os.O_RDONLY)

    def is_deleted(self) -> bool:
        """Whether the file was unlinked under the daemon (its slots still work through
        the open descriptor, and are lost when it closes)."""
        return os.fstat(self._fd).st_nlink == 0

    def close(self) -> None:
        """Close the file (idempotent); its slots stay for the next start."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
