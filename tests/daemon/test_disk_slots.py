"""The disk tier's slot file, index and directory (lmcached/daemon/disk/): no daemon.

A slot holds an L2 value, its envelope in a page of its own before the page-aligned
record, written record first and envelope last, so that a write cut short at any point
is never indexed by the rebuild after a restart; a slot whose bytes changed is refused
by the checksum when read. The directory is refused
when it is not the daemon's alone, and a second daemon is refused by the lock.
"""

import os

import pytest

from test_l2_values import FP, make_record
from lmcached.daemon.disk import slots as slots_module
from lmcached.daemon.disk.directory import DirectoryLock, DiskDirectoryError, prepare_disk_directory
from lmcached.daemon.disk.index import DiskIndex
from lmcached.daemon.disk.slots import FILE_NAME, PAGE_BYTES, SlotFile, aligned_buffer, round_up
from lmcached.daemon.l2.values import L2VerifyError, encode_envelope, verify_parts
from lmcached.wire.record_format import ROOT_HASH

SLOT_BYTES = 3 * PAGE_BYTES


def write_record(slot_file: SlotFile, slot: int, record: bytes, chunk_hash: bytes) -> None:
    buffer = aligned_buffer(len(record))
    buffer[:len(record)] = record
    slot_file.write(slot, aligned_buffer(PAGE_BYTES), [memoryview(buffer)[:round_up(len(record))]],
                    encode_envelope(FP, chunk_hash, [record]))


def read_record(slot_file: SlotFile, slot: int, record_bytes: int, parent: bytes,
                chunk_hash: bytes) -> bytes:
    """The record of `slot`, read and verified as a fetch does (raises L2VerifyError)."""
    buffer = aligned_buffer(record_bytes)
    envelope = slot_file.read(slot, aligned_buffer(PAGE_BYTES),
                              [memoryview(buffer)[:round_up(record_bytes)]], record_bytes)
    record = memoryview(buffer)[:record_bytes]
    verify_parts(envelope, [record], FP, chunk_hash, parent)
    return bytes(record)


def chain(num_chunks: int, kv_bytes: int = 5000, first_token: int = 0) -> list[tuple[bytes, bytes, bytes]]:
    """(parent, chunk hash, record) of a prompt's chunks of 16 tokens from `first_token`."""
    out, parent = [], ROOT_HASH
    for i in range(num_chunks):
        start = first_token + 16 * i
        chunk_hash, record = make_record(parent, range(start, start + 16), kv_bytes, seed=start)
        out.append((parent, chunk_hash, record))
        parent = chunk_hash
    return out


@pytest.fixture
def disk_dir(tmp_path):
    path = tmp_path / "disk"
    return prepare_disk_directory(str(path))


def test_records_read_back_bit_exact_and_a_reopened_file_finds_them(disk_dir):
    slot_file, kept = SlotFile.open(disk_dir, SLOT_BYTES, 8)
    assert not kept and os.stat(os.path.join(disk_dir, FILE_NAME)).st_size == PAGE_BYTES + 8 * SLOT_BYTES
    records = chain(3)
    for slot, (_, chunk_hash, record) in zip((5, 0, 7), records):
        write_record(slot_file, slot, record, chunk_hash)
    for slot, (parent, chunk_hash, record) in zip((5, 0, 7), records):
        assert read_record(slot_file, slot, len(record), parent, chunk_hash) == record
    slot_file.close()

    reopened, kept = SlotFile.open(disk_dir, SLOT_BYTES, 8)  # a restart
    assert kept
    found = reopened.scan()
    assert [(h.slot, h.ns_fp, h.chunk_hash, h.record_bytes) for h in found] == [
        (0, FP, records[1][1], len(records[1][2])), (5, FP, records[0][1], len(records[0][2])),
        (7, FP, records[2][1], len(records[2][2]))]
    reopened.close()
    other, kept = SlotFile.open(disk_dir, 4 * PAGE_BYTES, 8)  # the block size changed
    assert not kept and other.scan() == []
    other.close()


@pytest.mark.parametrize("cut", ["inside_the_first_write", "after_the_first_write"])
def test_a_write_cut_short_is_never_indexed(disk_dir, monkeypatch, cut):
    """A daemon killed while writing a slot (over an older record) leaves no record the
    rebuild indexes: the envelope, the commit mark, is written last."""
    slot_file, _ = SlotFile.open(disk_dir, SLOT_BYTES, 2)
    (_, old_hash, old_record), (_, new_hash, new_record) = chain(2)
    write_record(slot_file, 1, old_record, old_hash)
    real_pwrite = SlotFile._pwrite
    calls = []

    def killed(self, views, offset):
        calls.append(len(views))
        if cut == "inside_the_first_write" and len(calls) == 1:
            real_pwrite(self, views[:1], offset)  # the first page reached the disk
            raise SystemExit("killed")
        if cut == "after_the_first_write" and len(calls) == 2:
            raise SystemExit("killed")
        real_pwrite(self, views, offset)

    monkeypatch.setattr(SlotFile, "_pwrite", killed)
    with pytest.raises(SystemExit):
        write_record(slot_file, 1, new_record, new_hash)
    monkeypatch.undo()
    slot_file.close()
    restarted, kept = SlotFile.open(disk_dir, SLOT_BYTES, 2)
    assert kept and restarted.scan() == [], "a torn slot was indexed"
    restarted.close()


def test_a_tampered_or_truncated_slot_is_refused_when_read(disk_dir):
    slot_file, _ = SlotFile.open(disk_dir, SLOT_BYTES, 2)
    (parent, chunk_hash, record), _ = chain(2)
    write_record(slot_file, 0, record, chunk_hash)
    write_record(slot_file, 1, record, chunk_hash)
    path = os.path.join(disk_dir, FILE_NAME)
    with open(path, "r+b") as f:  # one KV byte of slot 0 (after its envelope page)
        f.seek(PAGE_BYTES + PAGE_BYTES + len(record) - 1)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(L2VerifyError) as refused:
        read_record(slot_file, 0, len(record), parent, chunk_hash)
    assert refused.value.reason == "checksum"
    os.truncate(path, PAGE_BYTES + SLOT_BYTES + 100)  # slot 1 cut short under the daemon
    with pytest.raises(OSError, match="short read"):
        read_record(slot_file, 1, len(record), parent, chunk_hash)
    slot_file.close()


def test_a_slot_file_of_the_first_format_is_formatted_anew_and_logged(disk_dir, caplog):
    """Format 1 kept the record at byte 64 of its slot, after the envelope: a daemon of
    format 2 never reads it as a record, it starts empty and says why."""
    slot_file, _ = SlotFile.open(disk_dir, SLOT_BYTES, 4)
    (_, chunk_hash, record), = chain(1)
    write_record(slot_file, 0, record, chunk_hash)
    slot_file.close()
    with open(os.path.join(disk_dir, FILE_NAME), "r+b") as f:  # the superblock's version
        f.seek(8)
        f.write((1).to_bytes(4, "little"))
    assert slots_module.read_superblock(disk_dir) is None  # DiskTier.load finds no file
    reopened, kept = SlotFile.open(disk_dir, SLOT_BYTES, 4)
    assert not kept and reopened.scan() == []
    assert "written in slot format 1, this lmcached reads format 2 only" in caplog.text
    reopened.close()
    assert slots_module.read_superblock(disk_dir) == (SLOT_BYTES, 4)


def test_the_index_evicts_least_recently_used_and_never_a_slot_being_read():
    index = DiskIndex(3)
    keys = [(FP, bytes([i]) * 16) for i in range(5)]
    for key in keys[:3]:
        index.insert(key, index.reserve(), 100)
    assert [e.slot for e in index.entries.values()] == [0, 1, 2]
    index.touch(keys[0])  # now 1, 2, 0
    index.start_read(1)
    slot = index.reserve()  # full: the LRU chunk not being read is evicted
    assert slot == 2 and keys[2] not in index.entries and index.num_evictions == 1
    assert list(index.entries) == [keys[1], keys[0]], "the chunk being read keeps its place"
    index.insert(keys[3], slot, 100)
    index.end_read(1)
    assert index.reserve() == 1 and keys[1] not in index.entries
    assert index.num_stored_bytes == 200  # keys[0] and keys[3]
    entry = index.forget(keys[0])  # forgotten: its slot is given out once erased
    assert index.num_stored_bytes == 100 and 0 not in index.free_slots
    index.release(entry.slot)
    assert 0 in index.free_slots


def test_unsafe_directories_are_refused_with_the_fix(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(DiskDirectoryError, match="is a symlink"):
        prepare_disk_directory(str(link))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(DiskDirectoryError, match=r"writable by every user .*chmod 0700"):
        prepare_disk_directory(str(shared))
    made = prepare_disk_directory(str(tmp_path / "new" / "disk"))
    assert os.stat(made).st_mode & 0o777 == 0o700


def test_a_second_owner_of_a_directory_is_refused_naming_the_first(disk_dir):
    first = DirectoryLock(disk_dir)
    with pytest.raises(DiskDirectoryError, match=rf"used by another lmcached daemon \(pid "
                       rf"{os.getpid()}\).*its own --disk-path"):
        DirectoryLock(disk_dir)
    first.release()
    DirectoryLock(disk_dir).release()


def test_buffered_io_where_o_direct_is_refused(disk_dir, monkeypatch):
    monkeypatch.setattr(slots_module.SlotFile, "_reopen_direct", staticmethod(lambda path: None))
    slot_file, _ = SlotFile.open(disk_dir, SLOT_BYTES, 2)
    (parent, chunk_hash, record), _ = chain(2)
    write_record(slot_file, 1, record, chunk_hash)
    assert not slot_file.direct and read_record(slot_file, 1, len(record), parent, chunk_hash) == record
    slot_file.close()


class _Stop(Exception):
    pass


def test_a_progress_call_that_raises_stops_every_scan_thread(disk_dir):
    """A stop signal during a warm restart's index rebuild (the start-up's progress
    callback raises): the scan stops at once, not after the whole file."""
    num_slots = 4 * slots_module.SCAN_RANGE_SLOTS
    slot_file, _ = SlotFile.open(disk_dir, 2 * PAGE_BYTES, num_slots)
    write_record(slot_file, num_slots - 1, b"x" * 100, b"\1" * 16)
    calls = []

    def progress(done_slots: int, total: int) -> None:
        calls.append(done_slots)
        raise _Stop

    with pytest.raises(_Stop):
        slot_file.scan(progress, num_threads=4)
    # Each thread stops at its next slot: at most one progress call each.
    assert len(calls) <= 4 and max(calls) <= 4 * slots_module.SCAN_PROGRESS_SLOTS, calls
    assert len(slot_file.scan()) == 1  # uninterrupted, the same file is scanned whole
    slot_file.close()
