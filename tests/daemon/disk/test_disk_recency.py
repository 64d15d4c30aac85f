"""The disk index's LRU order survives a restart (lmcached/daemon/disk/recency.py): the
order written at a graceful stop is applied to the index the scan rebuilt in slot order,
so that the restarted daemon evicts in the order it had; unknown, moved or damaged
entries are ignored, and the file is used once."""

import os

from lmcached.daemon.disk.directory import prepare_disk_directory
from lmcached.daemon.disk.index import DiskIndex
from lmcached.daemon.disk.recency import FILE_NAME, restore_recency, write_recency
from lmcached.daemon.disk.scan import SlotHeader

SLOT_BYTES = 8192
NUM_SLOTS = 16
FP = b"f" * 16


def chunk(i: int) -> bytes:
    return i.to_bytes(16, "little")


def headers(count: int) -> list[SlotHeader]:
    """The scan's view: chunk i in slot i, in slot order."""
    return [SlotHeader(i, FP, chunk(i), 100 + i) for i in range(count)]


def evicted_order(index: DiskIndex, count: int) -> list[bytes]:
    """The chunks `count` new writes evict, in order (the index is full)."""
    by_slot = {entry.slot: key[1] for key, entry in index.entries.items()}
    return [by_slot[index.reserve()] for _ in range(count)]


def test_the_lru_order_survives_a_restart(tmp_path):
    directory = prepare_disk_directory(str(tmp_path / "disk"))
    try:
        before = DiskIndex(NUM_SLOTS)
        before.rebuild(headers(NUM_SLOTS))
        for i in (3, 0, 7, 12, 5, 9, 1):  # used in this order, 1 the most recent
            before.touch((FP, chunk(i)))
        order = [key[1] for key in before.entries]
        assert write_recency(directory, before, SLOT_BYTES) == NUM_SLOTS

        after = DiskIndex(NUM_SLOTS)  # the restart's scan: slot order
        after.rebuild(headers(NUM_SLOTS))
        assert [key[1] for key in after.entries] != order
        assert restore_recency(directory, after, SLOT_BYTES) == NUM_SLOTS
        assert [key[1] for key in after.entries] == order
        assert evicted_order(after, 5) == order[:5]  # evicts as the daemon would have
        assert not os.path.exists(os.path.join(directory.path, FILE_NAME))  # used once
    finally:
        directory.close()


def test_unknown_and_moved_entries_are_ignored(tmp_path):
    directory = prepare_disk_directory(str(tmp_path / "disk"))
    try:
        before = DiskIndex(NUM_SLOTS)
        before.rebuild(headers(8))
        for i in (6, 2, 4):
            before.touch((FP, chunk(i)))
        write_recency(directory, before, SLOT_BYTES)
        # After the stop: chunk 2 is gone, chunk 4 sits in another slot, chunk 9 is new.
        scanned = [h for h in headers(8) if h.slot not in (2, 4)]
        scanned += [SlotHeader(9, FP, chunk(9), 109), SlotHeader(12, FP, chunk(4), 104)]
        after = DiskIndex(NUM_SLOTS)
        after.rebuild(scanned)
        assert restore_recency(directory, after, SLOT_BYTES) == 6  # 0, 1, 3, 5, 7, 6
        # Unlisted chunks first (coldest), in slot order; then the file's order.
        assert [key[1] for key in after.entries] == [chunk(i) for i in (9, 4, 0, 1, 3, 5, 7, 6)]
    finally:
        directory.close()


def test_a_damaged_or_foreign_recency_file_is_ignored(tmp_path):
    directory = prepare_disk_directory(str(tmp_path / "disk"))
    try:
        before = DiskIndex(NUM_SLOTS)
        before.rebuild(headers(4))
        before.touch((FP, chunk(0)))
        path = os.path.join(directory.path, FILE_NAME)
        for damage in ("flip", "slot_bytes"):
            write_recency(directory, before, SLOT_BYTES)
            if damage == "flip":
                with open(path, "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([byte[0] ^ 1]))
            after = DiskIndex(NUM_SLOTS)
            after.rebuild(headers(4))
            slot_bytes = SLOT_BYTES * 2 if damage == "slot_bytes" else SLOT_BYTES
            assert restore_recency(directory, after, slot_bytes) == 0
            assert [key[1] for key in after.entries] == [chunk(i) for i in range(4)]
            assert not os.path.exists(path)
        assert restore_recency(directory, after, SLOT_BYTES) == 0  # no file: no change
    finally:
        directory.close()
