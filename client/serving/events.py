"""KV events for routers, engine-neutral: the daemon's chunk events as an engine's block events.

Why this file exists: a cluster's router learns what each engine can load from the
engine's KV events (vLLM's `BlockStored` / `BlockRemoved`, docs/kv-events.md). The daemon
publishes chunk events (lmcached/daemon/events.py): a chunk of `chunk_size` tokens under
its lmcached chain hash entered or left the arena ("cpu") or the disk tier ("disk"),
whichever process stored it. Every engine attached to the daemon can load those chunks,
so each one announces them in its own terms: its block size, and the block hashes its own
prefix cache computes for those tokens (`block_hasher`, the engine's hash function).
`EventRelay` polls the feed over a connection of its own (never the serving session:
a poll never delays a lookup) and turns each chunk event into one `BlockEvent` of the
chunk's full blocks.

    daemon feed:  stored(cpu, chunk c, parent p, token ids)     removed(disk, chunk c)
                          |                                            |
    EventRelay:   block hashes of c = hasher chain from p's last   the hashes it announced
                  block over c's tokens, `block_size` at a time     for c on that medium
                          v                                            v
    engine:       BlockEvent("stored", "cpu", [h..], parent, ...)  BlockEvent("removed", ...)

A chunk is announced per medium: stored on "cpu" when it enters the arena, removed from
"cpu" when it leaves it (a chunk that stays on disk keeps its "disk" announcement). A
daemon that restarts (another arena generation) lost its arena and a CLEAR empties every
tier: both become removals of what was announced, one `BlockEvent` per chunk; a relay
never announces a wholesale clear (a router would drop the engine's own cache with it).

A relay that attaches to a daemon already holding chunks announces them first (SUBSCRIBE
with a snapshot, on by default): the daemon pages the namespace's chunks in the arena
("cpu") and then on disk ("disk") to it at most `max_events` a poll, before the live
events from the moment it subscribed, so that each chunk is announced once and nothing
stored or removed meanwhile is missed. A snapshot chunk whose parent comes later in the
snapshot waits for it.

What a relay cannot announce, counted in `stats` and never guessed: a chunk whose parent
it never saw (stored before the relay subscribed without a snapshot, or whose parent the
arena no longer holds), whose token ids the daemon no longer holds (its record left the arena before the poll), or a salted chain's first chunk whose
salt this engine has not seen (`note_salt`: the daemon never learns salts).
"""

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from lmcached.client.hashing import root_hash
from lmcached.wire.connection import Connection, DaemonError, hello
from lmcached.wire.protocol import ChunkEvent, Events, Layout, Subscribe
from lmcached.wire.record_format import ROOT_HASH, hash_block_tokens
from lmcached.wire.socket_path import UnsafeSocketPathError, connect_first, daemon_socket_paths

# Engine block hash of (parent engine block hash or None, the block's token ids, extra
# keys or None) -> bytes: the engine's prefix-cache hash (vLLM: `hash_block_tokens`).
BlockHasher = Callable[[bytes | None, list[int], tuple | None], bytes]

MAX_SALTS = 1024  # salts remembered (`note_salt`), least recently noted dropped first
RECONNECT_INTERVAL_S = 1.0  # at most one reconnect attempt per interval


@dataclasses.dataclass
class BlockEvent:
    """One engine-level event: full blocks of one chunk stored on or removed from a medium.

    Attributes:
        kind: "stored" or "removed".
        medium: "cpu" (the daemon's shared-memory arena) or "disk" (its disk tier).
        block_hashes: the engine's block hashes of the chunk's full blocks, in order.
        parent_block_hash: the engine block hash before the first (None: the root).
        token_ids: the blocks' token ids (stored only; len = block_size * blocks).
        block_size: tokens per block.
        extra_keys: per block, the extra keys the engine folds into its hash, as its
            events publish them (the cache salt on a salted chain's first block), or None.
    """

    kind: str
    medium: str
    block_hashes: list[bytes]
    parent_block_hash: bytes | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    block_size: int = 0
    extra_keys: list[tuple | None] | None = None


class _Chunk:
    """What a relay announced for one chunk: its engine block hashes and the media."""

    __slots__ = ("block_hashes", "media")

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes
        self.media: set[str] = set()


class EventRelay:
    """Polls the daemon's chunk events of one namespace and returns them as `BlockEvent`s.

    Args:
        layout: the namespace to follow (the engine's TP rank 0 layout, wire form).
        block_size: the engine's tokens per block; a chunk's tokens past its last full
            block are not announced (the engine hashes full blocks only).
        block_hasher: the engine's block hash (`BlockHasher`).
        salt_key: `salt_key(salt)` -> the extra keys a salted chain's first block hashes
            with (vLLM: `(("cache_salt", salt),)`); None: salted chains are never announced.
        event_salt_key: the same as the engine's events publish it (vLLM: `(salt,)`).
        socket: the daemon's socket (None: that of `daemon_name`).
        daemon_name: the daemon's name when `socket` is None.
        max_events: chunk events read per `poll` at most (bounds a step's cost).
        min_interval_s: a `poll` sooner than this after the last one returns nothing
            and sends nothing (an engine polls once per step: at most one round trip
            per interval).
        timeout_s: per-request timeout, seconds.
        snapshot: on (re)connecting, announce the chunks the daemon holds already.

    Attributes:
        snapshot_left: snapshot chunks the daemon has left to page (0: live events).
        stats: counters: "polls", "chunk_events", "stored", "snapshot" (stored events of
            the snapshot announced), "removed", "lost" (events the
            daemon's feed dropped before this relay read them), "unresolved_parent",
            "unresolved_tokens", "unresolved_salt", "errors", "restarts".
    """

    def __init__(self, layout: Layout, block_size: int, block_hasher: BlockHasher, *,
                 salt_key: Callable[[str], tuple] | None = None,
                 event_salt_key: Callable[[str], tuple] | None = None,
                 socket: str | None = None, daemon_name: str | None = None,
                 max_events: int = 1024, min_interval_s: float = 0.0,
                 timeout_s: float = 1.0, snapshot: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.layout = layout
        self.block_size = block_size
        self.block_hasher = block_hasher
        self.salt_key = salt_key
        self.event_salt_key = event_salt_key or salt_key
        self.socket, self.daemon_name = socket, daemon_name
        self.max_events = max_events
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self.snapshot = snapshot
        self.snapshot_left = 0
        self._waiting: dict[bytes, list[ChunkEvent]] = {}  # parent hash -> snapshot children
        self._last_poll_at = float("-inf")
        self.stats: collections.Counter = collections.Counter()
        self._conn: Connection | None = None
        self._cursor = 0
        self._generation: int | None = None
        self._next_connect_at = 0.0
        self._chunks: dict[bytes, _Chunk] = {}  # lmcached chunk hash -> what was announced
        self._salts: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    # ------------------------------------------------------------------ salts
    def note_salt(self, salt: str | None) -> None:
        """Remember a cache salt this engine served, so that chains under it can be
        announced (the daemon only sees their hashes). At most MAX_SALTS are kept."""
        if not salt or self.salt_key is None:
            return
        root = root_hash(salt)
        self._salts[root] = salt
        self._salts.move_to_end(root)
        if len(self._salts) > MAX_SALTS:
            self._salts.popitem(last=False)

    # ------------------------------------------------------------------- poll
    def poll(self) -> list[BlockEvent]:
        """The block events since the last poll (at most `max_events` chunk events
        read). Never raises: a daemon that cannot be reached is retried at most once a
        RECONNECT_INTERVAL_S, counted in stats["errors"]."""
        out: list[BlockEvent] = []
        now = time.monotonic()
        if now - self._last_poll_at < self.min_interval_s:
            return out
        self._last_poll_at = now
        try:
            if self._conn is None and not self._connect(out):
                return out
            reply = self._conn.request(Events(self._cursor, self.max_events, True),
                                       timeout_s=self.timeout_s)
        except (OSError, ConnectionError, TimeoutError, DaemonError, UnsafeSocketPathError):
            self.stats["errors"] += 1
            self._drop_connection()
            return out
        self.stats["polls"] += 1
        self.stats["lost"] += reply.lost
        self._cursor = reply.cursor
        out.extend(self.translate(reply.events, reply.snapshot_left))
        return out

    def translate(self, events: list[ChunkEvent], snapshot_left: int = 0) -> list[BlockEvent]:
        """The block events of one EVENTS reply's chunk events (what `poll` does with
        a reply; public for a caller that reads the feed itself).

        Args:
            events: the reply's chunk events, in order.
            snapshot_left: the reply's `snapshot_left`: 0 ends the snapshot (snapshot
                chunks still waiting for their parent are counted unresolved).
        """
        out: list[BlockEvent] = []
        for event in events:
            self.stats["chunk_events"] += 1
            if event.kind == "stored":
                self._stored(event, out)
            else:
                self._removed(event.chunk_hash, event.medium, out)
        self.snapshot_left = snapshot_left
        if not snapshot_left and self._waiting:  # the snapshot is over
            self.stats["unresolved_parent"] += sum(map(len, self._waiting.values()))
            self._waiting.clear()
        return out

    def close(self) -> None:
        """Close the relay's connection (its announced chunks stay announced)."""
        self._drop_connection()

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connect(self, out: list[BlockEvent]) -> bool:
        """Connect, HELLO with the followed layout, SUBSCRIBE to its namespace. A daemon
        of another generation than the last one lost its arena, and its feed began
        again: everything announced is removed, on every medium (what a warm restart
        brought back to the disk tier is not announced again until it is stored)."""
        now = time.monotonic()
        if now < self._next_connect_at:
            return False
        self._next_connect_at = now + RECONNECT_INTERVAL_S
        conn = connect_first(daemon_socket_paths(self.socket, self.daemon_name),
                             lambda path: Connection(path, timeout_s=self.timeout_s))
        try:
            ns = hello(conn, "event-relay", [self.layout]).namespaces[0]
            reply = conn.request(Subscribe([ns], 0, self.snapshot))
        except BaseException:
            conn.close()
            raise
        if self._generation is not None and reply.generation != self._generation:
            self.stats["restarts"] += 1
            self._forget_everything(out)
        self._generation = reply.generation
        self._cursor = reply.cursor
        self._waiting.clear()
        self._conn = conn
        return True

    def _forget_everything(self, out: list[BlockEvent]) -> None:
        for chunk_hash in list(self._chunks):
            chunk = self._chunks[chunk_hash]
            for medium in sorted(chunk.media):
                self._removed(chunk_hash, medium, out)

    # ------------------------------------------------------------- translation
    def _stored(self, event: ChunkEvent, out: list[BlockEvent]) -> None:
        """Announce a stored chunk, then the snapshot chunks that waited for it."""
        todo = [event]
        while todo:
            event = todo.pop()
            if self._stored_one(event, out):
                if event.seq == 0:
                    self.stats["snapshot"] += 1
                todo.extend(self._waiting.pop(event.chunk_hash, ()))

    def _stored_one(self, event: ChunkEvent, out: list[BlockEvent]) -> bool:
        """Announce one stored chunk; True when it is announced on a new medium."""
        chunk = self._chunks.get(event.chunk_hash)
        if chunk is not None:
            if event.medium in chunk.media:
                return False  # announced already on this medium
            chunk.media.add(event.medium)
            self.stats["stored"] += 1
            out.append(self._stored_event(event.medium, chunk.block_hashes, event.parent,
                                          event.token_ids))
            return True
        if not event.token_ids:
            self.stats["unresolved_tokens"] += 1
            return False
        tokens = np.frombuffer(event.token_ids, dtype="<i8")
        parent, salt = self._parent_of(event, tokens)
        if parent is False:
            return False
        token_list = tokens.tolist()
        bs = self.block_size
        hashes = []
        prev = parent
        for start in range(0, len(token_list) - bs + 1, bs):
            extra = self.salt_key(salt) if salt is not None and start == 0 else None
            prev = self.block_hasher(prev, token_list[start:start + bs], extra)
            hashes.append(prev)
        if not hashes:
            return False  # shorter than one block: nothing the engine would hash
        chunk = self._chunks[event.chunk_hash] = _Chunk(hashes)
        chunk.media.add(event.medium)
        self.stats["stored"] += 1
        extra_keys = None
        if salt is not None and self.event_salt_key is not None:
            extra_keys = [self.event_salt_key(salt)] + [None] * (len(hashes) - 1)
        out.append(BlockEvent("stored", event.medium, hashes, parent,
                              token_list[:len(hashes) * bs], bs, extra_keys))
        return True

    def _stored_event(self, medium: str, hashes: list[bytes], parent_chunk: bytes,
                      token_ids: bytes) -> BlockEvent:
        """A stored event for a chunk announced before on another medium."""
        bs = self.block_size
        parent = self._chunks.get(parent_chunk)
        tokens = np.frombuffer(token_ids, dtype="<i8").tolist()[:len(hashes) * bs]
        return BlockEvent("stored", medium, list(hashes),
                          parent.block_hashes[-1] if parent is not None else None,
                          tokens, bs)

    def _parent_of(self, event: ChunkEvent, tokens: np.ndarray):
        """(engine parent block hash or None, salt or None) of a new chunk; (False,
        None) when it cannot be resolved (counted).

        The daemon names as a chunk's parent the one its writer's ALLOC named, or, for a
        writer that named none, the chunk before it in the same ALLOC, which is another
        request's when one ALLOC stores several requests' chunks: a stated parent is
        followed only when the chunk's hash chains from it, and a chunk that does not
        chain from it may still be a chain's first (from the root or a noted salt's
        root)."""
        stated = event.parent if event.parent and event.parent not in self._salts else None
        if stated is not None:
            parent = self._chunks.get(stated)
            if parent is not None and hash_block_tokens(stated, tokens) == event.chunk_hash:
                return parent.block_hashes[-1], None
        if hash_block_tokens(ROOT_HASH, tokens) == event.chunk_hash:
            return None, None
        for root, salt in self._salts.items():
            if hash_block_tokens(root, tokens) == event.chunk_hash:
                return None, salt
        if stated is None:
            self.stats["unresolved_salt"] += 1
        elif parent is None and event.seq == 0:
            self._waiting.setdefault(stated, []).append(event)  # may come later in the snapshot
        else:
            self.stats["unresolved_parent"] += 1
        return False, None

    def _removed(self, chunk_hash: bytes, medium: str, out: list[BlockEvent]) -> None:
        chunk = self._chunks.get(chunk_hash)
        if chunk is None or medium not in chunk.media:
            return
        chunk.media.discard(medium)
        if not chunk.media:
            del self._chunks[chunk_hash]
        self.stats["removed"] += 1
        out.append(BlockEvent("removed", medium, list(chunk.block_hashes)))

    @property
    def num_announced_chunks(self) -> int:
        """Chunks announced on at least one medium now."""
        return len(self._chunks)
