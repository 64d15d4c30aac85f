"""The disk index's LRU order across a restart: a small recency file next to the slot file.

Why this file exists: the slots' envelopes say which chunk each slot holds, not when it
was last used, so an index rebuilt from them alone (`DiskIndex.rebuild`) is in slot
order, and a restarted daemon would evict its hottest chunks as soon as its coldest.
At a graceful stop the tier writes the index's order here (`write_recency`); at the
next start, once the scan rebuilt the index, the order is applied (`apply_recency`)
and the file removed, so that a later `kill -9` never applies an order older than the
chunks it spilled meanwhile. After PostgreSQL's pg_prewarm, whose autoprewarm worker
writes `autoprewarm.blocks` (the buffers that were hot) at shutdown.

Format (little-endian)::

    header: magic "LMCRCY01", slot_bytes u64, num_slots u64, num_entries u64,
            xxh3_64 of the entries u64
    entries, least recently used first: slot u32, namespace fingerprint 16 bytes,
            chunk hash 16 bytes

Validation: a file of another magic, slot size or slot count, a wrong length or
checksum is ignored as a whole (logged); an entry whose chunk the scan did not find in
that slot is ignored; chunks the file does not list stay at the front (least recently
used), in slot order. Written to a temporary name, fsynced and renamed, through the
tier's directory handle (`DiskDirectory.open_file`), as every file there is.
"""

import os
import struct

import xxhash

from lmcached.daemon.disk.directory import DiskDirectory, DiskDirectoryError
from lmcached.daemon.disk.index import DiskIndex
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

FILE_NAME = "recency.lmcached"
TEMP_NAME = FILE_NAME + ".tmp"
MAGIC = b"LMCRCY01"
HEADER = struct.Struct("<8sQQQQ")
ENTRY = struct.Struct("<I16s16s")
MAX_FILE_BYTES = 1 << 30  # a longer file is not ours to read


def encode_recency(index: DiskIndex, slot_bytes: int) -> bytes:
    """The recency file's bytes for `index`'s order (least recently used first)."""
    body = b"".join(ENTRY.pack(entry.slot, key[0], key[1])
                    for key, entry in index.entries.items())
    return HEADER.pack(MAGIC, slot_bytes, index.num_slots, len(index.entries),
                       xxhash.xxh3_64_intdigest(body)) + body


def decode_recency(data: bytes, slot_bytes: int,
                   num_slots: int) -> list[tuple[int, bytes, bytes]] | None:
    """The entries of a recency file, least recently used first, or None when the file
    is not one for this slot file (magic, slot size, slot count, length, checksum)."""
    if len(data) < HEADER.size:
        return None
    magic, file_slot_bytes, file_num_slots, count, checksum = HEADER.unpack_from(data)
    body = data[HEADER.size:]
    if (magic != MAGIC or file_slot_bytes != slot_bytes or file_num_slots != num_slots
            or len(body) != count * ENTRY.size or xxhash.xxh3_64_intdigest(body) != checksum):
        return None
    return [ENTRY.unpack_from(body, i * ENTRY.size) for i in range(count)]


def write_recency(directory: DiskDirectory, index: DiskIndex, slot_bytes: int) -> int:
    """Write `index`'s LRU order to the recency file (graceful stop). Returns how many
    entries were written.

    Raises:
        DiskDirectoryError: the file's entry is not a regular file of ours.
        OSError: it cannot be written or renamed.
    """
    data = encode_recency(index, slot_bytes)
    fd = directory.open_file(TEMP_NAME, os.O_WRONLY | os.O_TRUNC, create=True)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(TEMP_NAME, FILE_NAME, src_dir_fd=directory.fd, dst_dir_fd=directory.fd)
    return len(index.entries)


def apply_recency(index: DiskIndex, entries: list[tuple[int, bytes, bytes]]) -> int:
    """Put `index`'s chunks in the order of `entries` (least recently used first), after
    the chunks they do not list; an entry whose chunk is not indexed in that slot is
    ignored. Returns how many entries were applied."""
    applied = 0
    for slot, ns_fp, chunk_hash in entries:
        key = (ns_fp, chunk_hash)
        entry = index.entries.get(key)
        if entry is None or entry.slot != slot:
            continue
        index.touch(key)
        applied += 1
    return applied


def restore_recency(directory: DiskDirectory, index: DiskIndex, slot_bytes: int) -> int:
    """At start, after the scan: apply the recency file a graceful stop wrote, then
    remove it. Returns how many chunks took their place from it (0 without a file, or
    with one that is not valid for this slot file: logged). Never raises: an order lost
    is a slower start, never a failed one."""
    try:
        fd = directory.open_file(FILE_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    except (OSError, DiskDirectoryError) as exc:
        logger.warning("disk tier %s: the recency file cannot be opened (%s): the disk "
                       "chunks are evicted in slot order", directory.path, exc)
        return 0
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size <= MAX_FILE_BYTES else b""
    except OSError as exc:
        logger.warning("disk tier %s: the recency file cannot be read (%s): the disk "
                       "chunks are evicted in slot order", directory.path, exc)
        data = b""
    finally:
        os.close(fd)
    try:
        os.unlink(FILE_NAME, dir_fd=directory.fd)
    except OSError:
        pass
    entries = decode_recency(data, slot_bytes, index.num_slots)
    if entries is None:
        logger.warning("disk tier %s: the recency file %s is not one for this slot file "
                       "(another slot size, truncated or damaged): ignored, the disk chunks "
                       "are evicted in slot order", directory.path,
                       directory.file_path(FILE_NAME))
        return 0
    return apply_recency(index, entries)
