"""The daemon's KV event feed: chunks entering and leaving the arena and the disk tier.

Why this file exists: a cluster's router sends a request to the node that holds most of
its prefix, and learns what each node holds from KV events (vLLM's `BlockStored` /
`BlockRemoved`, docs/kv-events.md). The daemon knows every chunk on the node whichever
process stored it; this feed says so, and every engine attached to the daemon polls it
and republishes it in its own terms (client/serving/events.py).

One ring of the last `capacity` events, shared by every subscriber, after Redis's
replication backlog: publishing is one tuple written into a list slot (O(1), no
allocation beyond the tuple, whatever the number of subscribers), on the loop thread,
from the points where a chunk enters or leaves a tier (`stored`, `removed`,
`disk_stored`, `disk_removed`). A subscriber reads with a cursor (the sequence number of
the next event it wants, SUBSCRIBE / EVENTS on the socket); the daemon never pushes a
frame. A subscriber that lags more than `capacity` events behind loses the oldest: its
next EVENTS reply says how many (`lost`), counted in INFO. Nothing a subscriber does or
fails to do costs a store anything.

    seq:   1 ........ head-capacity ....................... head
    ring:  [ overwritten |  the last `capacity` events, readable  ]
                           ^ a cursor below here has lost events

Events never carry a chunk's bytes. The token ids of a stored chunk are read from its
record header in the arena when a subscriber asks for them, at EVENTS time (lazy: the
store pays nothing), while the arena still holds it; otherwise they are empty. They are
prompt content: a subscriber whose peer cannot read the arena itself (a member of
--allow-group the segment's mode leaves out, `Subscriber.token_ids`) gets none.

A subscriber that arrives after chunks were stored may ask for a snapshot (SUBSCRIBE
`snapshot`): the keys the arena and the spill tiers hold at that moment (those that list
their keys: the disk tier; `SpillTier.snapshot_keys`), copied once (a list of
references, 8 bytes a chunk; the arena's copy is shared by the SUBSCRIBEs that follow
while its index holds still, so a storm of them costs one copy), paged by its EVENTS as
"stored" events of sequence number 0 before the live events from its cursor, so that
nothing is lost or announced twice between the two: a chunk removed before its page is
skipped (its removal follows in the live events), one stored after the SUBSCRIBE is in
the live events. The arena's chunks come first (in the order they were cached), then the
disk's, most recently used first, but for a chunk's ancestors on disk, which are paged
before it (the disk index's order is eviction's, a chain's tail first, or the order of
writes), each with its parent hash (the pool's `parents`, the tier's
`SpillTier.chunk_parent`), so that a subscriber can chain them. A disk chunk's token ids
are read from the arena when it is there too, else from its tier (`SpillTier.token_ids`,
from its slot): one small read on the loop thread, at most SNAPSHOT_DISK_READS a page.
The feed knows the tiers through that interface only.

Parents travel with a chunk: the arena pool keeps the parent its writer's ALLOC named
(`ValueLedger.parents`), a device tier's pool too (its demotion carries it to the arena),
a disk slot keeps it beside its envelope (lmcached/daemon/disk/slots.py), so that a
chunk a fetch, the prewarm after a restart or a demotion installs is announced with it.
"""

import dataclasses

from lmcached.daemon.keys import CHUNK_TAG
from lmcached.wire.protocol import ChunkEvent
from lmcached.wire.record_format import RECORD_HEADER_BYTES, read_header

DEFAULT_CAPACITY = 1 << 16  # events kept (~ 64k chunks = 16M tokens at chunk size 256)
MAX_REPLY_EVENTS = 4096  # events in one EVENTS reply at most
MAX_REPLY_TOKEN_BYTES = 512 << 10  # token id bytes in one EVENTS reply at most (frame: 1 MiB)
SNAPSHOT_SCAN_FACTOR = 8  # snapshot keys examined per event an EVENTS page may return
RING_SCAN_FACTOR = 2  # ring slots examined per event an EVENTS page may return
EVENTS_PER_UNIT = 1024  # events or keys examined per unit of the per-pass budget
SNAPSHOT_DISK_READS = 64  # disk chunks one snapshot page reads token ids of from disk
SNAPSHOT_MAX_WALK = 4096  # ancestors a disk snapshot page looks up for one chunk at most
# A page's price grows with what it sends too: each event is read (token ids from its
# record), built and encoded, ~3 us here against ~20 us for one unit (admin_handlers.py).
EVENTS_SENT_PER_UNIT = 8  # events one unit of the per-pass budget pays for
TOKEN_BYTES_PER_UNIT = 32 << 10  # token id bytes one unit pays for
DISK_READS_PER_UNIT = 1  # snapshot token reads from disk one unit pays for (~20-100 us)
MAX_SNAPSHOTS_PER_PEER = 16  # snapshots being paged at once per peer uid (`busy` beyond)

STORED, REMOVED = "stored", "removed"
MEDIUM_ARENA, MEDIUM_DISK = "cpu", "disk"
_CHUNK_TAG = CHUNK_TAG[0]


@dataclasses.dataclass(slots=True)
class Subscriber:
    """One session's subscription.

    Attributes:
        namespaces: namespace ids it wants (empty: all).
        fingerprints: their 16-byte fingerprints (disk events are keyed by them).
        cursor: the sequence number of the next event it asked for.
        delivered: events it was sent.
        lost: events that fell off the ring before it read them.
        snapshot: the arena's keys when it subscribed with a snapshot, paged from
            `snapshot_pos` on (None: no snapshot, or all of it read); read-only, shared
            with the sessions that subscribed while the index held still.
        snapshot_pos: index in `snapshot` of the next key to page.
        disk_snapshot: the spill tiers' keys then, most recently used first, paged (those
            of its namespaces) after `snapshot` from `disk_pos` on (None: none left).
        disk_pos: index in `disk_snapshot` of the next key to page.
        disk_sent: disk keys of `disk_snapshot` paged already (sent ahead of their
            place with a child that came first).
        peer: the uid whose MAX_SNAPSHOTS_PER_PEER its snapshot counts against while it
            is paged (None: none counted).
        token_ids: it may be sent the token ids of chunks (its peer can read the arena,
            lmcached/daemon/peers.py `can_read_arena`); False: its events carry none.
    """

    namespaces: frozenset[int]
    fingerprints: frozenset[bytes]
    cursor: int
    delivered: int = 0
    lost: int = 0
    snapshot: list[bytes] | None = None
    snapshot_pos: int = 0
    disk_snapshot: list[tuple[bytes, bytes]] | None = None
    disk_pos: int = 0
    disk_sent: set = dataclasses.field(default_factory=set)
    peer: int | None = None
    token_ids: bool = True

    @property
    def snapshot_left(self) -> int:
        """Snapshot keys not paged yet (arena and disk)."""
        left = 0
        if self.snapshot is not None:
            left += len(self.snapshot) - self.snapshot_pos
        if self.disk_snapshot is not None:
            left += len(self.disk_snapshot) - self.disk_pos
        return left


class EventFeed:
    """The ring of the last `capacity` chunk events and its subscribers.

    Args:
        capacity: events kept, >= 1.

    Raises:
        ValueError: capacity < 1.

    Attributes:
        head: sequence number of the next event published (the first is 1).
        subscribers: session id -> `Subscriber`.
        num_published: events published since start.
        num_lost: events subscribers lost, summed over them.
        num_snapshot_events: snapshot events sent, summed over subscribers.
        examined: ring slots or snapshot keys the last `read` / `read_snapshot`
            examined, filtered ones included: what the request costs the loop.
        sent_token_bytes, disk_reads: token id bytes the last `read` / `read_snapshot`
            sent, and token reads from a spill tier it did (its price too).
        arena_version: changes of the arena's index told to the feed (`stored`,
            `removed`: every key, string keys too), so that SUBSCRIBEs while it holds
            still share one copy of its keys (`arena_keys`).
        num_snapshot_copies: copies of the arena's keys made for snapshots.
        snapshots_by_peer: uid -> its snapshots being paged now.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"event feed capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ring: list[tuple | None] = [None] * capacity
        self.head = 1
        self.subscribers: dict[int, Subscriber] = {}
        self.num_published = 0
        self.num_lost = 0
        self.num_snapshot_events = 0
        self.fingerprints: dict = {}  # ns id -> (layout, its fingerprint) (`_fingerprints`)
        self.examined = 0  # events or snapshot keys the last read examined (its price)
        self.sent_token_bytes = 0
        self.disk_reads = 0
        self.arena_version = 0
        self.num_snapshot_copies = 0
        self._arena_copy: tuple | None = None  # (index, version, its keys then)
        self.snapshots_by_peer: dict[int, int] = {}

    # ------------------------------------------------------------- publishing
    def _publish(self, event: tuple) -> None:
        seq = self.head
        self._ring[seq % self.capacity] = event
        self.head = seq + 1
        self.num_published += 1

    def stored(self, key: bytes, parent: bytes, block_id: int) -> None:
        """A chunk entered the arena (COMMIT). O(1).

        Args:
            key: its block-pool key (`keys.chunk_prefix(ns) + chunk hash`); a string key
                (key-value adapters) is not published.
            parent: the chunk hash before it in its chain (b"": not known, or the root).
            block_id: its first arena block, where its record header is.
        """
        self.arena_version += 1
        if key[0] == _CHUNK_TAG:
            self._publish((self.head, STORED, MEDIUM_ARENA, key, parent, block_id))

    def removed(self, key: bytes) -> None:
        """A chunk left the arena's index (eviction, EVICT, CLEAR, INVALIDATE). O(1)."""
        self.arena_version += 1
        if key[0] == _CHUNK_TAG:
            self._publish((self.head, REMOVED, MEDIUM_ARENA, key, b"", -1))

    def disk_stored(self, key: tuple[bytes, bytes], parent: bytes = b"") -> None:
        """A chunk's disk slot was committed; `key` is (namespace fingerprint, hash),
        `parent` as `stored`'s."""
        self._publish((self.head, STORED, MEDIUM_DISK, key, parent, -1))

    def disk_removed(self, key: tuple[bytes, bytes]) -> None:
        """The disk tier forgot a chunk (its LRU, EVICT, CLEAR, INVALIDATE, a bad slot)."""
        self._publish((self.head, REMOVED, MEDIUM_DISK, key, b"", -1))

    # ------------------------------------------------------------ subscribers
    def arena_keys(self, cached: dict) -> tuple[list[bytes], bool]:
        """The keys of the arena's index `cached` now, in its order, for a snapshot:
        (keys, copied). Read-only and shared: while the index holds still (no `stored` /
        `removed` since) every SUBSCRIBE gets the same list, O(1); after a change, one
        copy (8 bytes a key, at C speed) that the next ones share."""
        last = self._arena_copy
        if last is not None and last[0] is cached and last[1] == self.arena_version:
            return last[2], False
        keys = list(cached)
        self._arena_copy = (cached, self.arena_version, keys)
        self.num_snapshot_copies += 1
        return keys, True

    def snapshots_of(self, peer: int, session_id: int) -> int:
        """Snapshots of uid `peer` being paged now, but for session `session_id`'s own
        (a SUBSCRIBE replaces it)."""
        held = self.snapshots_by_peer.get(peer, 0)
        own = self.subscribers.get(session_id)
        return held - (own is not None and own.peer == peer)

    def _snapshot_over(self, sub: Subscriber) -> None:
        """`sub`'s snapshot no longer counts against its peer (read, replaced, ended)."""
        if sub.peer is None:
            return
        left = self.snapshots_by_peer[sub.peer] - 1
        if left:
            self.snapshots_by_peer[sub.peer] = left
        else:
            del self.snapshots_by_peer[sub.peer]
        sub.peer = None

    def subscribe(self, session_id: int, namespaces: list[int], fingerprints: list[bytes],
                  cursor: int, snapshot: list[bytes] | None = None,
                  disk_snapshot: list[tuple[bytes, bytes]] | None = None,
                  peer: int | None = None, token_ids: bool = True) -> int:
        """(Re)subscribe a session; returns the cursor it starts at: `cursor` when it
        is still readable or lost (the next EVENTS says how many), `head` for 0.
        `snapshot`, `disk_snapshot`: the arena's and the disk tier's keys now, paged
        before the live events (`read_snapshot`; not modified, `snapshot` may be
        shared); `peer`: the uid it counts against (`snapshots_of`) while paged;
        `token_ids`: False, its events never carry token ids (`Subscriber.token_ids`)."""
        start = self.head if cursor == 0 else min(cursor, self.head)
        old = self.subscribers.get(session_id)
        if old is not None:
            self._snapshot_over(old)
        sub = self.subscribers[session_id] = Subscriber(frozenset(namespaces),
                                                        frozenset(fingerprints), start,
                                                        snapshot=snapshot or None,
                                                        disk_snapshot=disk_snapshot or None,
                                                        token_ids=token_ids)
        if peer is not None and (sub.snapshot is not None or sub.disk_snapshot is not None):
            sub.peer = peer
            self.snapshots_by_peer[peer] = self.snapshots_by_peer.get(peer, 0) + 1
        return start

    def read_snapshot(self, sub: Subscriber, max_events: int, arena_entry, disk_entry,
                      resolve) -> list[ChunkEvent]:
        """The next page of `sub`'s snapshot, the arena's keys then the disk's: at most
        `max_events` events (0: MAX_REPLY_EVENTS, which also caps it), of at most
        SNAPSHOT_SCAN_FACTOR times as many keys examined (a page's cost is bounded
        whatever the other namespaces hold), at most SNAPSHOT_DISK_READS disk chunks
        whose token ids come from disk, and at most MAX_REPLY_TOKEN_BYTES of token ids
        but for its first event (a reply always fits a frame: `read_token_ids` caps one
        event's).

        Args:
            sub: a subscription with a snapshot left to page.
            max_events: as `read`.
            arena_entry: `arena_entry(key) -> (block id, parent) | None`: the arena
                holds it now (its first block, its parent hash or b"").
            disk_entry: `disk_entry(disk key) -> (parent, from disk) | None`: a spill
                tier holds it now; `from disk`: its token ids are read from its slot
                (the arena does not hold it).
            resolve: as `read`, given the event tuple of the chunk's stored event.

        Returns:
            The events (sequence number 0); `sub.snapshot` and `sub.disk_snapshot`
            become None once all of them is read.
        """
        limit = min(max_events or MAX_REPLY_EVENTS, MAX_REPLY_EVENTS)
        scan_left = limit * SNAPSHOT_SCAN_FACTOR
        out: list[ChunkEvent] = []
        token_bytes = 0
        full = False  # the next event would take the reply past MAX_REPLY_TOKEN_BYTES
        examined = 0
        reads = 0
        keys, pos = sub.snapshot, sub.snapshot_pos
        if keys is not None:
            end = min(len(keys), pos + scan_left)
            scan_left -= end - pos
            while pos < end and len(out) < limit:
                key = keys[pos]
                if key[0] != _CHUNK_TAG:
                    pos += 1
                    continue
                found = arena_entry(key)
                if found is None:
                    pos += 1
                    continue  # left the arena since: its removal is in the live events
                event = resolve((0, STORED, MEDIUM_ARENA, key, found[1], found[0]), True, sub)
                if event is not None:
                    if out and token_bytes + len(event.token_ids) > MAX_REPLY_TOKEN_BYTES:
                        full = True  # the next page's first event: the reply fits a frame
                        break
                    out.append(event)
                    token_bytes += len(event.token_ids)
                pos += 1
            examined += pos - sub.snapshot_pos
            sub.snapshot_pos = pos
            if pos >= len(keys):
                sub.snapshot, sub.snapshot_pos = None, 0
        keys, pos = sub.disk_snapshot, sub.disk_pos
        if sub.snapshot is None and keys is not None and not full:
            first = pos
            end = min(len(keys), pos + max(scan_left, 0))
            sent, wanted = sub.disk_sent, sub.fingerprints
            while pos < end and len(out) < limit and not full and reads < SNAPSHOT_DISK_READS:
                key = keys[pos]
                found = None
                if key not in sent and (not wanted or key[0] in wanted):
                    found = disk_entry(key)
                if found is None:  # another namespace's, sent with a child, or left
                    pos += 1  # the disk since (its removal is in the live events)
                    continue
                # Its ancestors on disk not sent yet go first, the oldest first, as
                # many as the page has room for; the rest, it among them, next page.
                chain = [(key, found)]
                walked = {key}  # a parent cycle (a client's wrong parents) ends too
                parent = found[0]
                while parent and len(chain) < SNAPSHOT_MAX_WALK:
                    up = (key[0], parent)
                    if up in sent or up in walked:
                        break
                    above = disk_entry(up)
                    if above is None:
                        break
                    chain.append((up, above))
                    walked.add(up)
                    parent = above[0]
                for chain_key, (chain_parent, from_disk) in reversed(chain):
                    if len(out) >= limit or reads >= SNAPSHOT_DISK_READS:
                        break
                    reads += from_disk
                    event = resolve((0, STORED, MEDIUM_DISK, chain_key, chain_parent, -1),
                                    True, sub)
                    if event is not None:
                        if out and token_bytes + len(event.token_ids) > MAX_REPLY_TOKEN_BYTES:
                            full = True  # the next page's first event, as above
                            break
                        out.append(event)
                        token_bytes += len(event.token_ids)
                    sent.add(chain_key)
                if key in sent:
                    pos += 1
            examined += pos - first
            sub.disk_pos = pos
            if pos >= len(keys):
                sub.disk_snapshot, sub.disk_pos, sub.disk_sent = None, 0, set()
        self.examined = examined
        self.sent_token_bytes = token_bytes
        self.disk_reads = reads
        if sub.snapshot is None and sub.disk_snapshot is None:
            self._snapshot_over(sub)
        sub.delivered += len(out)
        self.num_snapshot_events += len(out)
        return out

    def unsubscribe(self, session_id: int) -> None:
        """Forget a session's subscription (it ended); nothing if it had none."""
        sub = self.subscribers.pop(session_id, None)
        if sub is not None:
            self._snapshot_over(sub)

    def read(self, sub: Subscriber, cursor: int, max_events: int, with_tokens: bool,
             resolve) -> tuple[list[ChunkEvent], int, int]:
        """The events from `cursor` on that `sub` wants, at most `max_events`.

        Args:
            sub: the session's subscription.
            cursor: sequence number of the first event wanted (a previous reply's).
            max_events: at most this many (0: MAX_REPLY_EVENTS, which also caps it).
            with_tokens: read each stored arena chunk's token ids (`resolve`).
            resolve: `resolve(event_tuple, with_tokens) -> ChunkEvent | None`: the
                event on the wire, or None when the subscriber's filter drops it.

        Returns:
            (events, next cursor, events lost before `cursor` could be read; counted
            in `num_lost` once, however often a subscriber polls from a cursor it had
            passed: a client rewinding does not inflate the operators' figure). At most
            `max_events` times RING_SCAN_FACTOR ring slots are examined, filtered
            ones included (a page's cost is bounded whatever the subscriber filters out:
            the next cursor then moves on with no events), and the token ids stay within
            MAX_REPLY_TOKEN_BYTES but for the first event's, as `read_snapshot`.
        """
        head, capacity, ring = self.head, self.capacity, self._ring
        cursor = min(max(cursor, 1), head)
        oldest = max(1, head - capacity)
        lost = newly_lost = 0
        if cursor < oldest:
            lost = oldest - cursor
            newly_lost = oldest - max(cursor, min(sub.cursor, oldest))  # not counted before
            cursor = oldest
        limit = min(max_events or MAX_REPLY_EVENTS, MAX_REPLY_EVENTS)
        end = min(head, cursor + limit * RING_SCAN_FACTOR)  # filtered ones count too
        out: list[ChunkEvent] = []
        token_bytes = 0
        first = cursor
        while cursor < end and len(out) < limit:
            event = resolve(ring[cursor % capacity], with_tokens, sub)
            if event is not None:
                if out and token_bytes + len(event.token_ids) > MAX_REPLY_TOKEN_BYTES:
                    break  # the next page's first event: the reply stays within a frame
                out.append(event)
                token_bytes += len(event.token_ids)
            cursor += 1
        self.examined = cursor - first
        self.sent_token_bytes = token_bytes
        self.disk_reads = 0
        sub.cursor = cursor
        sub.delivered += len(out)
        sub.lost += newly_lost
        self.num_lost += newly_lost
        return out, cursor, lost

    def info(self) -> dict[str, int]:
        """INFO fields (section `stats`): published, subscribers, those lagging now (a
        cursor the ring has overwritten), and events lost."""
        oldest = max(1, self.head - self.capacity)
        return {
            "events_published": self.num_published,
            "events_subscribers": len(self.subscribers),
            "events_subscribers_lagging": sum(s.cursor < oldest
                                              for s in self.subscribers.values()),
            "events_lost": self.num_lost,
            "events_snapshot_sent": self.num_snapshot_events,
        }


def read_token_ids(arena, block_id: int, chunk_hash: bytes) -> bytes:
    """The token ids (int64 little-endian bytes) of the record in arena block `block_id`
    when its header names `chunk_hash`, else b"" (replaced since, or not a record, or
    more than MAX_REPLY_TOKEN_BYTES of them: any writer of the namespace states the
    count, and one reply must fit a frame whatever it states).

    Reads the header (64 bytes) and the token ids only: ~1 us for 256 tokens."""
    block_bytes = arena.block_bytes
    header = arena.numpy_view(arena.block_offset(block_id), RECORD_HEADER_BYTES)
    try:
        parsed = read_header(header)
    except ValueError:
        return b""
    if (parsed.chunk_hash != chunk_hash or parsed.tokens_end > block_bytes
            or parsed.tokens_end - RECORD_HEADER_BYTES > MAX_REPLY_TOKEN_BYTES):
        return b""
    view = arena.numpy_view(arena.block_offset(block_id) + RECORD_HEADER_BYTES,
                            parsed.tokens_end - RECORD_HEADER_BYTES)
    return view.tobytes()
