"""The disk tier's slot file, index and directory (lmcached/daemon/disk/): no daemon.

A slot holds an L2 value, its envelope in a page of its own before the page-aligned
record, written record first and envelope last, so that a write cut short at any point
is never indexed by the rebuild after a restart; a slot whose bytes changed is refused
by the checksum when read. The directory is refused
when it is not the daemon's alone, and a second daemon is refused by the lock.
"""

import os
import re
import stat
import threading

import pytest

from test_l2_values import FP, make_record
from lmcached.daemon.disk import scan as scan_module
from lmcached.daemon.disk import slots as slots_module
from lmcached.daemon.disk.directory import LOCK_NAME, DirectoryLock, DiskDirectoryError, \
    prepare_disk_directory
from lmcached.daemon.disk.index import DiskIndex
from lmcached.daemon.disk.scan import scan_slots
from lmcached.daemon.disk.slots import FILE_NAME, PAGE_BYTES, SlotFile, aligned_buffer, round_up
from lmcached.daemon.spill.envelope import VerifyError, encode_envelope, verify_parts
from lmcached.wire.record_format import ROOT_HASH

SLOT_BYTES = 3 * PAGE_BYTES


def write_record(slot_file: SlotFile, slot: int, record: bytes, chunk_hash: bytes) -> None:
    buffer = aligned_buffer(len(record))
    buffer[:len(record)] = record
    slot_file.write(slot, aligned_buffer(PAGE_BYTES), [memoryview(buffer)[:round_up(len(record))]],
                    encode_envelope(FP, chunk_hash, [record]))


def read_record(slot_file: SlotFile, slot: int, record_bytes: int, parent: bytes,
                chunk_hash: bytes) -> bytes:
    """The record of `slot`, read and verified as a fetch does (raises VerifyError)."""
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
    """The checked directory tmp_path/disk, held open (a `DiskDirectory`)."""
    directory = prepare_disk_directory(str(tmp_path / "disk"))
    yield directory
    directory.close()


def test_records_read_back_bit_exact_and_a_reopened_file_finds_them(disk_dir):
    slot_file, kept = SlotFile.open(disk_dir, SLOT_BYTES, 8)
    assert not kept and os.stat(disk_dir.file_path(FILE_NAME)).st_size == PAGE_BYTES + 8 * SLOT_BYTES
    records = chain(3)
    for slot, (_, chunk_hash, record) in zip((5, 0, 7), records):
        write_record(slot_file, slot, record, chunk_hash)
    for slot, (parent, chunk_hash, record) in zip((5, 0, 7), records):
        assert read_record(slot_file, slot, len(record), parent, chunk_hash) == record
    slot_file.close()

    reopened, kept = SlotFile.open(disk_dir, SLOT_BYTES, 8)  # a restart
    assert kept
    found = scan_slots(reopened)
    assert [(h.slot, h.ns_fp, h.chunk_hash, h.record_bytes) for h in found] == [
        (0, FP, records[1][1], len(records[1][2])), (5, FP, records[0][1], len(records[0][2])),
        (7, FP, records[2][1], len(records[2][2]))]
    reopened.close()
    other, kept = SlotFile.open(disk_dir, 4 * PAGE_BYTES, 8)  # the block size changed
    assert not kept and scan_slots(other) == []
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
    assert kept and scan_slots(restarted) == [], "a torn slot was indexed"
    restarted.close()


def test_a_tampered_or_truncated_slot_is_refused_when_read(disk_dir):
    slot_file, _ = SlotFile.open(disk_dir, SLOT_BYTES, 2)
    (parent, chunk_hash, record), _ = chain(2)
    write_record(slot_file, 0, record, chunk_hash)
    write_record(slot_file, 1, record, chunk_hash)
    path = disk_dir.file_path(FILE_NAME)
    with open(path, "r+b") as f:  # one KV byte of slot 0 (after its envelope page)
        f.seek(PAGE_BYTES + PAGE_BYTES + len(record) - 1)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(VerifyError) as refused:
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
    with open(disk_dir.file_path(FILE_NAME), "r+b") as f:  # the superblock's version
        f.seek(8)
        f.write((1).to_bytes(4, "little"))
    assert slots_module.read_superblock(disk_dir) is None  # DiskTier.load finds no file
    reopened, kept = SlotFile.open(disk_dir, SLOT_BYTES, 4)
    assert not kept and scan_slots(reopened) == []
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
    assert os.stat(made.path).st_mode & 0o777 == 0o700
    made.close()


OTHER_UID = 54321  # a uid nobody on the machine is expected to use
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown to another uid")


@pytest.mark.parametrize("exists", [True, False])
def test_a_directory_below_one_that_others_can_write_is_refused_naming_it_and_the_fix(
        tmp_path, exists):
    """Whoever can write a parent can rename the disk directory away after any check and
    put his own in its place; nothing is created below such a parent either."""
    parent = tmp_path / "public"
    parent.mkdir()
    parent.chmod(0o777)  # not sticky, unlike /tmp
    if exists:
        (parent / "disk").mkdir(mode=0o700)
    with pytest.raises(DiskDirectoryError) as refused:
        prepare_disk_directory(str(parent / "disk" / "tier"))
    message = str(refused.value)
    assert f"{parent} is writable by every user (mode 0777, not sticky)" in message, message
    assert f"chmod go-w {parent}" in message and "another --disk-path" in message, message
    assert os.listdir(parent) == (["disk"] if exists else [])
    if exists:
        assert os.listdir(parent / "disk") == []


@needs_root
def test_a_directory_below_one_of_another_uid_is_refused_naming_its_owner(tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    (parent / "disk").mkdir(mode=0o700)  # the daemon's own directory, in another's
    os.chown(parent, OTHER_UID, -1)
    with pytest.raises(DiskDirectoryError, match=rf"{parent} is owned by uid {OTHER_UID}, who "
                       rf"could replace the directories below it; .*\(--disk-path\)"):
        prepare_disk_directory(str(parent / "disk"))


def planted_slot_file(directory: str) -> bytes:
    """A valid slot file of another user's making in `directory` (one chunk in slot 0);
    returns its bytes."""
    os.mkdir(directory, 0o700)
    theirs = prepare_disk_directory(directory)
    slot_file, _ = SlotFile.open(theirs, SLOT_BYTES, 2)
    (_, chunk_hash, record), = chain(1, first_token=666)
    write_record(slot_file, 0, record, chunk_hash)
    slot_file.close()
    theirs.close()
    with open(os.path.join(directory, FILE_NAME), "rb") as f:
        return f.read()


def test_a_directory_swapped_for_a_symlink_after_the_check_is_never_followed(tmp_path):
    """The race of a user who owns the parent (renameat2 RENAME_EXCHANGE in a loop), made
    deterministic: the checked directory is swapped for a symlink to a planted one right
    after the check. Everything the tier opens next comes from the checked directory."""
    attacker = str(tmp_path / "attacker")
    planted = planted_slot_file(attacker)
    path = tmp_path / "disk"
    checked = prepare_disk_directory(str(path))
    path.rename(tmp_path / "moved")  # the checked directory, still held open
    path.symlink_to(attacker)
    try:
        lock = DirectoryLock(checked)
        assert slots_module.read_superblock(checked) is None, "read the planted superblock"
        slot_file, kept = SlotFile.open(checked, SLOT_BYTES, 2)
        assert not kept and scan_slots(slot_file) == [], "indexed a planted record"
        slot_file.close()
        lock.release()
        assert sorted(os.listdir(tmp_path / "moved")) == sorted([FILE_NAME, LOCK_NAME])
        assert os.listdir(attacker) == [FILE_NAME]  # no lock taken, nothing written there
        with open(os.path.join(attacker, FILE_NAME), "rb") as f:
            assert f.read() == planted
    finally:
        checked.close()


def test_a_directory_swapped_for_a_symlink_during_the_check_is_refused(tmp_path, monkeypatch):
    """The swap between the check of the ancestors and the open of the directory: the
    directory is opened without following a symlink and judged through its descriptor."""
    from lmcached.daemon.disk import directory as directory_module

    attacker = str(tmp_path / "attacker")
    planted_slot_file(attacker)  # a fine directory of the daemon's uid, 0700
    path = tmp_path / "disk"
    path.mkdir(mode=0o700)
    real_check = directory_module.check_ancestors

    def check_then_swap(*args, **kwargs):
        real_check(*args, **kwargs)
        if path.is_dir() and not path.is_symlink():
            path.rename(tmp_path / "moved")
            path.symlink_to(attacker)
    monkeypatch.setattr(directory_module, "check_ancestors", check_then_swap)
    with pytest.raises(DiskDirectoryError, match=f"--disk-path {path} is a symlink"):
        prepare_disk_directory(str(path))


def call_within(timeout_s: float, fn, *args):
    """fn(*args) on a thread; fails if it is still blocked after `timeout_s` (a FIFO
    opened for reading blocks until a writer comes), else returns what it returned or
    raises what it raised."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - raised by the caller
            outcome["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise AssertionError(f"{fn.__qualname__} blocked for {timeout_s} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def plant(path: str, kind: str, tmp_path) -> None:
    """Put something that is not a regular file of ours at `path`."""
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink":
        target = tmp_path / "elsewhere"
        target.write_bytes(b"\0" * PAGE_BYTES)
        os.symlink(target, path)
    elif kind == "directory":
        os.mkdir(path, 0o700)
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # as /dev/null
    else:  # another uid's regular file
        with open(path, "wb") as f:
            f.write(b"\0" * PAGE_BYTES)
        os.chown(path, OTHER_UID, -1)


NOT_OURS = [pytest.param("fifo", "is a FIFO, not a regular file"),
            pytest.param("symlink", "is a symlink, not a regular file"),
            pytest.param("directory", "is a directory, not a regular file"),
            pytest.param("device", "is a character device, not a regular file", marks=needs_root),
            pytest.param("other_uid", f"is owned by uid {OTHER_UID}", marks=needs_root)]


@pytest.mark.parametrize("kind,problem", NOT_OURS)
def test_a_slot_file_that_is_not_a_regular_file_of_ours_is_refused_at_once(disk_dir, tmp_path,
                                                                           kind, problem):
    """Never opened by a blocking open, never followed: a FIFO would hang the start
    before the daemon listens, a symlink would lead to another user's file."""
    path = disk_dir.file_path(FILE_NAME)
    plant(path, kind, tmp_path)
    try:
        for attempt in (lambda: slots_module.read_superblock(disk_dir),
                        lambda: SlotFile.open(disk_dir, SLOT_BYTES, 2)):
            with pytest.raises(DiskDirectoryError) as refused:
                call_within(10, attempt)
            message = str(refused.value)
            assert f"{path} {problem}" in message and f"rm {path}" in message, message
    finally:
        if kind == "fifo":  # a reader still blocked (the check failed) gets its writer
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    if kind == "symlink":
        assert (tmp_path / "elsewhere").read_bytes() == b"\0" * PAGE_BYTES


@pytest.mark.parametrize("kind,problem", NOT_OURS[:3])
def test_a_lock_file_that_is_not_a_regular_file_is_refused(disk_dir, tmp_path, kind, problem):
    path = disk_dir.file_path(LOCK_NAME)
    plant(path, kind, tmp_path)
    with pytest.raises(DiskDirectoryError, match=re.escape(f"{path} {problem}")):
        call_within(10, DirectoryLock, disk_dir)


def test_the_slot_file_and_the_lock_are_the_daemons_only_mode_0600(disk_dir):
    """Created 0600 whatever the umask; an existing file of a wider mode (0644: readable
    by every user, with every cached prompt's token ids) is brought to 0600."""
    old_umask = os.umask(0)
    try:
        lock = DirectoryLock(disk_dir)
        slot_file, _ = SlotFile.open(disk_dir, SLOT_BYTES, 2)
    finally:
        os.umask(old_umask)
    slot_file.close()
    lock.release()
    paths = [disk_dir.file_path(FILE_NAME), disk_dir.file_path(LOCK_NAME)]
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in paths] == [0o600, 0o600]
    for p in paths:
        os.chmod(p, 0o644)
    lock = DirectoryLock(disk_dir)
    slot_file, kept = SlotFile.open(disk_dir, SLOT_BYTES, 2)
    assert kept
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in paths] == [0o600, 0o600]
    slot_file.close()
    lock.release()


def test_a_second_owner_of_a_directory_is_refused_naming_the_first(disk_dir):
    first = DirectoryLock(disk_dir)
    with pytest.raises(DiskDirectoryError, match=rf"used by another lmcached daemon \(pid "
                       rf"{os.getpid()}\).*its own --disk-path"):
        DirectoryLock(disk_dir)
    first.release()
    DirectoryLock(disk_dir).release()


def test_buffered_io_where_o_direct_is_refused(disk_dir, monkeypatch):
    monkeypatch.setattr(slots_module.SlotFile, "_reopen_direct", staticmethod(lambda *args: None))
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
    num_slots = 4 * scan_module.SCAN_RANGE_SLOTS
    slot_file, _ = SlotFile.open(disk_dir, 2 * PAGE_BYTES, num_slots)
    write_record(slot_file, num_slots - 1, b"x" * 100, b"\1" * 16)
    calls = []

    def progress(done_slots: int, total: int) -> None:
        calls.append(done_slots)
        raise _Stop

    with pytest.raises(_Stop):
        scan_slots(slot_file, progress, num_threads=4)
    # Each thread stops at its next slot: at most one progress call each.
    assert len(calls) <= 4 and max(calls) <= 4 * scan_module.SCAN_PROGRESS_SLOTS, calls
    assert len(scan_slots(slot_file)) == 1  # uninterrupted, the same file is scanned whole
    slot_file.close()
