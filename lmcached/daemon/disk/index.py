"""The disk tier's index: which slot holds which chunk, least recently used first.

Why this file exists: the slot file (`slots.py`) knows bytes, the tier (`tier.py`)
knows requests; this is the bookkeeping between them, on the loop thread only, and
rebuilt from the slots' envelopes at start. Eviction is LRU, like the arena's free queue
(lmcached/daemon/free_queue.py): a hit moves a chunk to the back, a new slot is taken
from the empty ones first, then from the front. A slot being read is never reused, and
a slot being written is in no list until its write completes::

    free_slots: [s, s, ...]                 empty, taken first
    entries:    front (LRU) ... back (MRU)  (ns fp, chunk hash) -> DiskEntry
    reading:    slot -> reads in flight     skipped by eviction
"""

import collections

DiskKey = tuple[bytes, bytes]  # (namespace fingerprint, chunk hash), 16 bytes each
MAX_EVICTION_SKIPS = 64  # busy slots `reserve` passes over before it gives up


class DiskEntry:
    """One committed slot.

    Attributes:
        slot: its slot number.
        record_bytes: its record's length in bytes.
        parent: the chunk hash before it in its chain (b"": not known, or none), as its
            slot keeps it (slots.py): what the event feed announces it with.
    """

    __slots__ = ("slot", "record_bytes", "parent")

    def __init__(self, slot: int, record_bytes: int, parent: bytes = b"") -> None:
        self.slot = slot
        self.record_bytes = record_bytes
        self.parent = parent


class DiskIndex:
    """Chunk -> slot, in LRU order, with the empty slots and the slots being read.

    Args:
        num_slots: slots of the file.

    Attributes:
        entries: committed chunks, least recently used first.
        free_slots: empty slots (a stack).
        reading: slot -> reads in flight.
        num_evictions: chunks evicted to make room.
        num_stored_bytes: bytes of the records of `entries`.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.entries: collections.OrderedDict[DiskKey, DiskEntry] = collections.OrderedDict()
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.reading: dict[int, int] = {}
        self.num_evictions = 0
        self.num_stored_bytes = 0
        self.events = None  # the daemon's EventFeed: told of chunks entering and leaving

    def rebuild(self, headers) -> int:
        """Index the committed slots the scan found (`scan.scan_slots`), in slot order; a
        chunk found in two slots keeps the first. Returns how many were indexed."""
        used = set()
        for header in headers:
            key = (header.ns_fp, header.chunk_hash)
            if key in self.entries or header.slot >= self.num_slots:
                continue
            self.entries[key] = DiskEntry(header.slot, header.record_bytes, header.parent)
            self.num_stored_bytes += header.record_bytes
            used.add(header.slot)
        self.free_slots = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]
        return len(self.entries)

    def get(self, key: DiskKey) -> DiskEntry | None:
        """The entry of `key`, or None; no LRU change."""
        return self.entries.get(key)

    def touch(self, key: DiskKey) -> None:
        """Make `key` the most recently used (it was read or spilled again)."""
        self.entries.move_to_end(key)

    def reserve(self) -> int | None:
        """A slot to write a new chunk into: an empty one, else the least recently used
        chunk's (evicted; a slot being read is passed over). None when every candidate
        within MAX_EVICTION_SKIPS is being read."""
        if self.free_slots:
            return self.free_slots.pop()
        skipped = []
        slot = None
        while self.entries and len(skipped) < MAX_EVICTION_SKIPS:
            key, entry = self.entries.popitem(last=False)
            if entry.slot in self.reading:
                skipped.append((key, entry))
                continue
            slot = entry.slot
            self.num_evictions += 1
            self.num_stored_bytes -= entry.record_bytes
            if self.events is not None:
                self.events.disk_removed(key)
            break
        for key, entry in reversed(skipped):  # back at the front, in their order
            self.entries[key] = entry
            self.entries.move_to_end(key, last=False)
        return slot

    def insert(self, key: DiskKey, slot: int, record_bytes: int, parent: bytes = b"") -> bool:
        """Index a slot whose write completed, most recently used; `parent` as
        `DiskEntry`'s. A key indexed meanwhile in another slot keeps it: False, and the
        caller erases this slot and then `release`s it (its envelope names the key too)."""
        if key in self.entries:
            return False
        self.entries[key] = DiskEntry(slot, record_bytes, parent)
        self.num_stored_bytes += record_bytes
        if self.events is not None:
            self.events.disk_stored(key, parent)
        return True

    def forget(self, key: DiskKey) -> DiskEntry | None:
        """Remove `key` from the index and return its entry (None when absent); its slot
        stays out of the empty ones until the caller `release`s it (after erasing it)."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.num_stored_bytes -= entry.record_bytes
            if self.events is not None:
                self.events.disk_removed(key)
        return entry

    def forget_all(self) -> list[DiskEntry]:
        """`forget` every chunk; returns their entries."""
        entries = list(self.entries.values())
        if self.events is not None:
            for key in self.entries:
                self.events.disk_removed(key)
        self.entries.clear()
        self.num_stored_bytes = 0
        return entries

    def release(self, slot: int) -> None:
        """Give back a reserved or forgotten slot once its envelope holds no chunk
        (erased, or never written): a restart must not find in an empty slot a chunk
        the index forgot."""
        self.free_slots.append(slot)

    def start_read(self, slot: int) -> None:
        """Mark a slot as being read: `reserve` never hands it out meanwhile."""
        self.reading[slot] = self.reading.get(slot, 0) + 1

    def end_read(self, slot: int) -> None:
        """A read of `slot` ended."""
        left = self.reading[slot] - 1
        if left:
            self.reading[slot] = left
        else:
            del self.reading[slot]
