"""The index rebuild's scan of the disk tier's slot file: every slot's envelope read, the
committed ones returned (`scan_slots`, run at a warm restart by `tier.rebuild_index`).

Why this file exists: the scan is the slot file's only multi-threaded reader of the whole
file (ranges of slots on SCAN_THREADS threads, progress reported, a dying disk's errors
bounded); the slot layout it reads (the envelope page, the parent hash after it) is
`slots.py`'s.
"""

import collections
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from lmcached.daemon.disk.slots import PARENT_OFFSET, SlotFile, error_kind
from lmcached.daemon.spill.envelope import parse_envelope
from lmcached.wire.protocol import HASH_BYTES

SCAN_THREADS = 4
SCAN_RANGE_SLOTS = 65536  # slots one scan task reads at most
SCAN_PROGRESS_SLOTS = 4096  # progress is reported after every this many slots of a task
SCAN_MAX_ERRORS = 64  # envelope reads that fail in one task before it skips the rest of it
_NO_PARENT = bytes(HASH_BYTES)


class SlotHeader:
    """A slot's envelope as the index rebuild read it.

    Attributes:
        slot: the slot number.
        ns_fp: the namespace fingerprint, 16 bytes.
        chunk_hash: the chunk hash, 16 bytes.
        record_bytes: the record's length in bytes.
        parent: the parent hash written beside the envelope (b"": none).
    """

    __slots__ = ("slot", "ns_fp", "chunk_hash", "record_bytes", "parent")

    def __init__(self, slot: int, ns_fp: bytes, chunk_hash: bytes, record_bytes: int,
                 parent: bytes = b"") -> None:
        self.slot = slot
        self.ns_fp = ns_fp
        self.chunk_hash = chunk_hash
        self.record_bytes = record_bytes
        self.parent = parent


def scan_slots(slot_file: SlotFile, progress: Callable[[int, int], None] | None = None,
               num_threads: int = SCAN_THREADS) -> list[SlotHeader]:
    """Read every slot's envelope: the records a restarted daemon may serve.

    A slot counts when its envelope has the magic, version and flags of
    `envelope.parse_envelope`, and a record length that fits the slot; its checksum and
    token ids are verified when it is read (`SlotFile.read`, `envelope.verify_parts`).
    Runs on `num_threads` threads over ranges of slots, with buffered reads of one page.

    Args:
        slot_file: the open slot file (opened again read-only for the scan).
        progress: called as progress(done_slots, num_slots) every SCAN_PROGRESS_SLOTS
            slots of a thread (any thread). It may raise to stop the scan (a stop
            signal during the start-up): every thread stops at its next slot, and
            `scan_slots` raises that exception.

    Returns:
        The committed slots, in slot order. A slot whose envelope
        cannot be read (EIO: a bad sector) is skipped as empty, and a task that met SCAN_MAX_ERRORS
        of them skips the rest of its range (a dying disk must not stop the start);
        `slot_file.scan_errors` holds those errors (kind as `error_kind`: count).

    Raises:
        OSError: the file cannot be opened again for the scan (relative to the
            directory), or it is another file now (ESTALE).
        DiskDirectoryError: the name now leads to something else than a regular
            file of ours.
    """
    fd = slot_file.open_read_only()
    num_slots = slot_file.num_slots
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        step = max(1, min(SCAN_RANGE_SLOTS, -(-num_slots // num_threads)))
        ranges = [(start, min(num_slots, start + step)) for start in range(0, num_slots, step)]
        done = [0]
        stopped: list[BaseException] = []  # what a progress call raised
        failed: list[str] = []  # the kind of every envelope read that failed

        def scan_range(bounds: tuple[int, int]) -> list[SlotHeader]:
            found, errors = [], 0
            for slot in range(*bounds):
                if stopped:
                    break
                try:
                    data = os.pread(fd, PARENT_OFFSET + HASH_BYTES,
                                    slot_file.slot_offset(slot))
                except OSError as exc:
                    failed.append(error_kind(exc))
                    errors += 1
                    if errors >= SCAN_MAX_ERRORS:
                        break
                    continue
                header = _header(data, slot, slot_file.max_record_bytes)
                if header is not None:
                    found.append(header)
                if (slot - bounds[0] + 1) % SCAN_PROGRESS_SLOTS == 0 or slot + 1 == bounds[1]:
                    done[0] += (slot - bounds[0]) % SCAN_PROGRESS_SLOTS + 1
                    if progress is not None:
                        try:
                            progress(done[0], num_slots)
                        except BaseException as exc:  # noqa: BLE001 - raised by scan
                            stopped.append(exc)
            return found

        with ThreadPoolExecutor(num_threads, thread_name_prefix="lmcached-disk-scan") as pool:
            results = list(pool.map(scan_range, ranges))
        if stopped:
            raise stopped[0]
        slot_file.scan_errors = dict(collections.Counter(failed))
        return [h for found in results for h in found]
    finally:
        os.close(fd)


def _header(data: bytes, slot: int, max_record_bytes: int) -> SlotHeader | None:
    """The slot's header from its envelope page's first bytes `data`, or None: not committed."""
    fields = parse_envelope(data)
    if fields is None or not 1 <= fields.record_bytes <= max_record_bytes:
        return None
    parent = bytes(data[PARENT_OFFSET:PARENT_OFFSET + HASH_BYTES])
    return SlotHeader(slot, fields.ns_fp, fields.chunk_hash, fields.record_bytes,
                      b"" if parent == _NO_PARENT or len(parent) != HASH_BYTES else parent)
