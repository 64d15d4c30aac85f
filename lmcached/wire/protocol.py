"""Wire protocol between clients and the daemon: typed msgpack messages on a Unix socket.

Why this file exists: it is the only contract between worker processes and the daemon.
Every request batches all chunks of a request (never one message per chunk or per layer)
and is one round trip, except RELEASE and INVALIDATE, which have no reply: a client sends
them and goes on, so a retrieve costs one synchronous round trip (ACQUIRE). Bulk KV bytes
never cross the socket, only block ids.

Version 2 (this one) against version 1: ACQUIRE and GET answer a lease id and RELEASE
takes leases (no reply, no block ids sent back); LOOKUP and ACQUIRE carry a list of
namespaces (a session may register one layout per tensor parallel rank in HELLO), so a
vLLM scheduler asks for every rank in one frame; fields renamed: `span_lengths` (blocks
per value), `num_bytes` (bytes per value), `Layout.record_bytes` (bytes of one full chunk
record). A version-1 HELLO gets an Error with code "version".

Messages are msgspec Structs (never pickle from a peer). Chunk hashes travel as one
`bytes` of 16 bytes per chunk (xxh3_128 digests). A message travels in a frame
(`frames.py`); clients send it on a blocking `Connection` (`connection.py`).
"""

from typing import Annotated, Literal

import msgspec

PROTOCOL_VERSION = 2
MAX_FRAME_BYTES = 1 << 20
HASH_BYTES = 16
TENANT_BYTES = 8  # a tenant fingerprint: the first bytes of a salted chain's root hash
MAX_CHUNKS_PER_REQUEST = 1 << 16  # 16M tokens at chunk_size 256

# Per-chunk status in an ALLOC reply.
ALLOCATED = 0  # blocks handed out in WRITING for this session: write, then COMMIT
EXISTS = 1  # already READY: nothing to write
NOSPACE = 2  # nothing evictable: not stored (every later chunk is NOSPACE too)

# A block reference on the wire names a tier and a block of it: `tier << 32 | block`.
# Tier 0 is the host arena, so a host block's reference is its block id, unchanged
# since version 2 began (docs/architecture.md, "Tiers").
TIER_SHIFT = 32
MAX_TIERS = 17  # the host arena and at most 16 device tiers
MAX_DEVICES_PER_SESSION = 16
ANY_DEVICE = "*"  # Hello.devices: accept blocks of every tier, mapping none (a scheduler)


def block_ref(tier_id: int, block_id: int) -> int:
    """The wire reference of block `block_id` of tier `tier_id` (tier 0: the block id)."""
    return tier_id << TIER_SHIFT | block_id


def tier_of(ref: int) -> int:
    """The tier id of a block reference."""
    return ref >> TIER_SHIFT


def local_block(ref: int) -> int:
    """The block id, within its tier, of a block reference."""
    return ref & ((1 << TIER_SHIFT) - 1)


# Every integer a client sends is bounded by the schema, so the decoder refuses one out
# of range (`bad_request`, counted under errors_bad_request) before a handler, numpy or
# a struct.pack meets it: an int64 at most, never negative.
MAX_WIRE_INT = (1 << 63) - 1
PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=MAX_WIRE_INT)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_WIRE_INT)]  # sizes, leases, cursors
NamespaceId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
BlockRef = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TIERS << TIER_SHIFT)]  # block_ref()
ShortName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class Layout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a KV chunk is: the namespace of its hashes (docs/architecture.md, "Namespaces").

    Two processes share cached chunks only when their layouts are equal. The schema
    declares every constraint, so the daemon's decoder refuses a bad layout as
    `bad_request` before any handler runs.

    Fields:
        model_name: model identifier, 1-256 characters.
        world_size: tensor parallel world size, >= 1.
        worker_id: the tensor parallel rank, 0 <= worker_id < world_size.
        fmt: "vllm" or "huggingface" (order of the token and head dimensions of a KV
            chunk), "sglang" (SGLang HiCache pages: chunk records whose chunks are
            independent, see UNCHAINED_FORMATS), or "kv" (values of the key-value
            adapters, under string keys).
        dtype: KV dtype name (e.g. "bfloat16").
        num_layers, num_kv_heads, head_size: KV geometry of this rank, each >= 1.
        chunk_size: tokens per chunk, >= 1.
        record_bytes: bytes of the arena record of one full chunk (header, token ids
            and KV), which sizes the daemon's blocks when `--block-size` is unset.
    """

    model_name: ShortName
    world_size: PositiveInt
    worker_id: Annotated[int, msgspec.Meta(ge=0, le=MAX_WIRE_INT)]
    fmt: Literal["vllm", "huggingface", "sglang", "kv"]
    dtype: ShortName
    num_layers: PositiveInt
    num_kv_heads: PositiveInt
    head_size: PositiveInt
    chunk_size: PositiveInt
    record_bytes: PositiveInt

    def __post_init__(self) -> None:
        if self.worker_id >= self.world_size:
            raise ValueError(
                f"worker_id {self.worker_id} must be < world_size {self.world_size}"
            )


# Chunk formats whose chunks are not a prefix chain: each chunk's hash is its own
# (`hash_block_tokens(parent, token ids)` from the request's parent, ROOT_HASH, never from
# the chunk before it). SGLang names its pages by keys that already hold their prefix, and
# asks for any run of them (client/sglang/): the disk and L2 tiers verify such a chunk from
# the request's parent.
UNCHAINED_FORMATS = frozenset({"sglang"})


# ------------------------------------------------------------------------ requests
class Hello(msgspec.Struct, tag="hello", array_like=True):
    """Opens a session: one namespace per layout (e.g. one per tensor parallel rank).

    `layouts` is empty for admin tools that store nothing.
    """

    version: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
    pid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]  # a pid_t
    name: str
    layouts: list[Layout] = []
    # Device UUIDs whose tiers this session maps (OPEN_TIER) and may be handed blocks
    # of; ANY_DEVICE accepts blocks of every tier without mapping one. Empty (every
    # client before tiers): host blocks only.
    devices: Annotated[list[ShortName], msgspec.Meta(max_length=MAX_DEVICES_PER_SESSION)] = []


class Lookup(msgspec.Struct, tag="lookup", array_like=True):
    """How many leading chunks of `hashes` are READY in every namespace listed.

    No pins, no LRU change. `namespaces` are ids from this session's HELLO. `parent`
    is the hash of the chunk before `hashes[0]` (16 bytes; empty: the chain starts at
    ROOT_HASH), from which an L2 fetch verifies the chain: a salted chain (a tenant's
    cache salt enters its root hash, client/hashing.py) or a run that starts mid-chain
    sends it; the daemon never learns a salt. `tenant`: the request's tenant
    fingerprint, the first TENANT_BYTES of its salted chain's root hash (empty:
    unsalted), by which INFO's `tenants` section and the metrics count per tenant.
    """

    namespaces: list[NamespaceId]
    hashes: bytes
    parent: bytes = b""
    tenant: bytes = b""


class Acquire(msgspec.Struct, tag="acquire", array_like=True):
    """Pin the chunks of `hashes` READY in every namespace listed (the common prefix)
    under one lease (ref_cnt += 1 per block) and return their blocks, namespace-major.

    `parent`, `tenant`: as LOOKUP's. `salted`: the chain is a salted request's; a
    client of before `tenant` sends only this flag (its chunks count under the tenant
    "other"), a newer one sends both, so that an older daemon counts it as salted."""

    namespaces: list[NamespaceId]
    hashes: bytes
    parent: bytes = b""
    salted: bool = False
    tenant: bytes = b""


class Release(msgspec.Struct, tag="release", array_like=True):
    """Unpin the blocks of each lease. No reply (a client never waits for it); a lease
    this session does not hold is counted as error `not_owner` and logged."""

    leases: list[Count]


class Alloc(msgspec.Struct, tag="alloc", array_like=True):
    """Blocks to write the chunks of `hashes` that are not cached; `num_bytes` per chunk.

    `tier` is where the writer would like them: a device tier whose device is in the
    session's HELLO `devices` gets the chunks it has empty blocks for, the rest go to
    the host arena (tier 0, the default).

    `parents`: per chunk of `hashes`, the HASH_BYTES hash of the chunk before it in its
    chain, or ROOT_HASH (all zero) for a chain's first chunk, salted or not (the daemon
    never learns a salt), back to back; the daemon keeps it with the chunk and
    publishes it in the KV event feed (`ChunkEvent.parent`, b"" for ROOT_HASH). Empty
    (a client of before the field): each chunk's parent is the chunk before it in this
    ALLOC, the first has none.
    """

    ns: NamespaceId
    hashes: bytes
    num_bytes: list[Count]
    tier: Annotated[int, msgspec.Meta(ge=0, lt=MAX_TIERS)] = 0
    parents: Annotated[bytes, msgspec.Meta(max_length=MAX_CHUNKS_PER_REQUEST * HASH_BYTES)] = b""


class Commit(msgspec.Struct, tag="commit", array_like=True):
    """WRITING -> READY for every value one of whose blocks is listed."""

    block_ids: list[BlockRef]


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """WRITING -> FREE for every value one of whose blocks is listed."""

    block_ids: list[BlockRef]


class Put(msgspec.Struct, tag="put", array_like=True):
    """Blocks to write a value of `num_bytes` under a string key (replaces on COMMIT)."""

    ns: NamespaceId
    key: str
    num_bytes: Count


class Get(msgspec.Struct, tag="get", array_like=True):
    """Pin the value under a string key under a lease and return its blocks (empty and
    lease 0 when missing)."""

    ns: NamespaceId
    key: str


class Delete(msgspec.Struct, tag="delete", array_like=True):
    """Remove a string key now (its readers keep their pinned bytes)."""

    ns: NamespaceId
    key: str


class Scan(msgspec.Struct, tag="scan", array_like=True):
    """String keys of namespace `ns` starting with `prefix`, at most `limit`, found in
    one page of the arena's blocks, after Redis's SCAN: `cursor` is where the page
    starts (0: the first block; the reply's `cursor` for the next page) and `count`
    how many blocks it walks (0: the daemon's default; it caps larger counts). Page
    until the reply's cursor is 0: a key cached for the whole scan is returned exactly
    once; one stored or removed meanwhile may or may not be. A page may hold no key.
    A client of before the cursor (three fields) gets the first page."""

    ns: NamespaceId
    prefix: str
    limit: Count
    cursor: Count = 0
    count: Count = 0


# The sections INFO answers, in order (lmcached/daemon/info.py builds them; the CLI checks
# a section name against them before it sends anything).
INFO_SECTIONS = ("server", "memory", "blocks", "clients", "stats", "l2", "disk", "tenants")


class Info(msgspec.Struct, tag="info", array_like=True):
    """Server statistics: every section, or one (INFO_SECTIONS)."""

    section: str | None = None


class OpenTier(msgspec.Struct, tag="open_tier", array_like=True):
    """Ask for the memory of a device tier: the reply `TierHandle` carries its file
    descriptor as SCM_RIGHTS ancillary data. Only a tier whose device is in the
    session's HELLO `devices` (not ANY_DEVICE) is opened; else error `bad_tier`."""

    tier_id: Annotated[int, msgspec.Meta(ge=1, lt=MAX_TIERS)]


class Clients(msgspec.Struct, tag="clients", array_like=True):
    """One entry per connected session, a page at a time: the sessions from id `cursor`
    on (0: the first), at most `count` of them (0: the daemon's page size, which also
    caps larger counts). Page until the reply's cursor is 0 (`list_clients`); a client
    of before the cursor (no field) gets the first page."""

    cursor: Count = 0
    count: Count = 0


class Evict(msgspec.Struct, tag="evict", array_like=True):
    """Evict the `lru` least recently used values, or the value(s) under `key`.

    `key` is a string key of the key-value adapter, or 32 hex digits of a chunk hash;
    it is evicted in every namespace.
    """

    lru: Count = 0
    key: str | None = None


class Clear(msgspec.Struct, tag="clear", array_like=True):
    """Evict every value from every tier (a pinned one stays with its readers)."""


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """Liveness check."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Graceful stop, as SIGTERM."""


class ConfigGet(msgspec.Struct, tag="config_get", array_like=True):
    """The daemon's effective configuration."""


class Invalidate(msgspec.Struct, tag="invalidate", array_like=True):
    """Chunks a reader found corrupt (their record does not hold their tokens, or fails
    its payload checksum): drop each from the index so that the next store replaces it.

    Chunk i is `hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES]` of namespace `ns`, read in
    the value whose first block is `block_ids[i]`; the daemon drops it only while the
    index still maps that chunk to that block (a chunk evicted and stored again since
    is left alone). Pinned blocks keep their bytes for their readers until released.
    No reply, as RELEASE (a reader never waits for it); any session may send it.
    """

    ns: NamespaceId
    hashes: bytes
    block_ids: list[BlockRef]


class Subscribe(msgspec.Struct, tag="subscribe", array_like=True):
    """Subscribe this session to the daemon's chunk event feed (docs/kv-events.md).

    `namespaces`: namespace ids whose events it wants (empty: every namespace).
    `cursor`: sequence number of the first event wanted (0: from now on). Replaces an
    earlier subscription of the session. `snapshot`: first announce, as "stored" events
    of sequence number 0 paged by EVENTS before any event from `cursor` on, every chunk
    of those namespaces the arena holds now (in the order they were cached: parents
    first, but for a parent cached again later), then every chunk the disk tier holds
    (medium "disk", its ancestors on disk first). Reply: `SubscribeReply`; error `busy`
    for a snapshot while the peer's uid has `MAX_SNAPSHOTS_PER_PEER` others being paged
    (lmcached/daemon/events.py, docs/kv-events.md). A peer that cannot read the arena's
    segment (a member of --allow-group that --shm-mode leaves out) is subscribed all
    the same, but its events never carry token ids (the reply does not say so; the
    daemon logs it).
    """

    namespaces: list[NamespaceId] = []
    cursor: Count = 0
    snapshot: bool = False


class Events(msgspec.Struct, tag="events", array_like=True):
    """The subscribed events from sequence number `cursor` on, at most `max_events` (0:
    the daemon's page size, which also caps larger counts); `token_ids`: read the token
    ids of each chunk stored in the arena from its record (empty when gone, or when this
    peer cannot read the arena itself: see `Subscribe`). Polled by
    the subscriber: the daemon never sends a frame unasked. Reply: `EventsReply`;
    error `no_subscription` before SUBSCRIBE."""

    cursor: Count
    max_events: Count = 0
    token_ids: bool = False


Request = (
    Hello | Lookup | Acquire | Release | Alloc | Commit | Abort | Put | Get | Delete
    | Scan | Info | Clients | Evict | Clear | Ping | Shutdown | ConfigGet | OpenTier
    | Invalidate | Subscribe | Events
)


# ------------------------------------------------------------------------- replies
class HelloReply(msgspec.Struct, tag="hello_reply", array_like=True):
    """Where the arena is, and the namespace id of each layout of the HELLO, in order.

    `num_blocks` is the arena's block count (0 until a first layout sets the block size).
    """

    session_id: int
    arena_name: str
    generation: int
    block_bytes: int
    num_blocks: int
    capacity_bytes: int
    namespaces: list[int]
    server_pid: int
    # Every tier, tier 0 (the host arena) first. Empty from a daemon without tiers.
    tiers: list["TierInfo"] = []


class TierInfo(msgspec.Struct, array_like=True):
    """One tier of the daemon's memory, as HELLO announces it.

    Attributes:
        tier_id: the tier part of its block references (0: the host arena).
        kind: "host" (the POSIX arena), "cuda" (a CUDA VMM allocation exported as a
            POSIX file descriptor) or "fake" (a memfd standing in for a device, tests).
        device: the device's UUID (e.g. "GPU-8f6a..."; "fake-0"); "" for the host.
        size_bytes: bytes of the tier's memory (a device tier: what OPEN_TIER maps).
        block_bytes: bytes of one block (as the arena's; 0 until a first layout).
        num_blocks: blocks of the tier.
    """

    tier_id: int
    kind: str
    device: str
    size_bytes: int
    block_bytes: int
    num_blocks: int


class TierHandle(msgspec.Struct, tag="tier_handle", array_like=True):
    """Reply to OPEN_TIER; the tier's file descriptor comes with the reply's first byte.

    `generation` is the daemon's (a mapping is valid for that generation only); a
    "fake" tier's memory starts with an arena segment header (shm/arena.py), a
    "cuda" tier's is `size_bytes` of device memory, blocks from offset 0.
    """

    tier_id: int
    generation: int
    kind: str
    device: str
    size_bytes: int


class Ok(msgspec.Struct, tag="ok", array_like=True):
    """Success with nothing to return."""


class Error(msgspec.Struct, tag="error", array_like=True):
    """The request was refused; the session stays open unless the frame was bad."""

    code: str
    message: str


# Codes of a HELLO refusal that lasts as long as the daemon's and the client's settings
# do (another protocol version; a chunk record larger than the arena or than one
# session's share; a malformed HELLO; a request only the daemon's user may make): a
# client logs one error and retries only after a long back-off, not as for an outage.
PERMANENT_ERROR_CODES = frozenset({"version", "too_large", "bad_request", "forbidden"})


class LookupReply(msgspec.Struct, tag="lookup_reply", array_like=True):
    """How many leading chunks of a LOOKUP are READY (no pins taken)."""

    num_chunks: int


class BlocksReply(msgspec.Struct, tag="blocks_reply", array_like=True):
    """Values found and pinned (ACQUIRE, GET) under `lease`, all their block ids in order.

    Value i has `span_lengths[i]` blocks of `block_ids` and holds `num_bytes[i]` bytes.
    For an ACQUIRE of n namespaces the values are namespace-major: n runs of
    len(span_lengths) // n chunks. `lease` is 0 when nothing was pinned (nothing to
    RELEASE).
    """

    lease: int
    block_ids: list[int]
    span_lengths: list[int]
    num_bytes: list[int]

    def spans(self) -> list[list[int]]:
        """The block ids of each value, in order."""
        return split_spans(self.block_ids, self.span_lengths)


class AllocReply(msgspec.Struct, tag="alloc_reply", array_like=True):
    """Per chunk a status (ALLOCATED, EXISTS, NOSPACE); blocks of the ALLOCATED ones.

    The i-th ALLOCATED value has `span_lengths[i]` blocks of `block_ids`.
    """

    status: list[int]
    block_ids: list[int]
    span_lengths: list[int]

    def spans(self) -> list[list[int] | None]:
        """Per chunk of the ALLOC, the block ids to write, or None (EXISTS, NOSPACE)."""
        allocated = iter(split_spans(self.block_ids, self.span_lengths))
        return [next(allocated) if status == ALLOCATED else None for status in self.status]


class CountReply(msgspec.Struct, tag="count_reply", array_like=True):
    """How many values a DELETE, EVICT or CLEAR removed."""

    count: int


class KeysReply(msgspec.Struct, tag="keys_reply", array_like=True):
    """String keys (of the key-value adapters) a SCAN found in its page, and the cursor
    of the next page (0: the scan is complete)."""

    keys: list[str]
    cursor: int = 0


class InfoReply(msgspec.Struct, tag="info_reply", array_like=True):
    """Sections of `field -> value`, in display order."""

    sections: dict[str, dict[str, int | float | str]]


class ClientsReply(msgspec.Struct, tag="clients_reply", array_like=True):
    """One `field -> value` dict per session of a CLIENTS page, and the cursor of the
    next page (0: no more sessions)."""

    clients: list[dict[str, int | float | str]]
    cursor: int = 0


class SubscribeReply(msgspec.Struct, tag="subscribe_reply", array_like=True):
    """The cursor the subscription starts at, the daemon's arena generation (a new one:
    the daemon restarted, its sequence numbers began again and its chunks are gone) and
    how many events the feed keeps (a subscriber further behind loses the oldest)."""

    cursor: int
    generation: int
    capacity: int


class ChunkEvent(msgspec.Struct, array_like=True):
    """One chunk entering or leaving a tier of the daemon. Never the chunk's bytes.

    Attributes:
        seq: its sequence number in the feed (consecutive; a gap is a filtered event).
        kind: "stored" or "removed".
        medium: "cpu" (the shared-memory arena) or "disk" (the disk tier).
        ns: namespace id (0: no namespace of this daemon has that fingerprint now).
        ns_fp: the namespace's 16-byte layout fingerprint (the same on every node).
        chunk_hash: the chunk's 16-byte prefix hash (a salt, if any, is folded in).
        parent: the hash of the chunk before it in its chain (b"": not known; a first
            chunk's parent is the root or a salted root).
        token_ids: int64 little-endian token ids of a stored chunk when asked, the
            arena still holds its record and the subscriber's peer can read the arena,
            else b"".
    """

    seq: int
    kind: str
    medium: str
    ns: int
    ns_fp: bytes
    chunk_hash: bytes
    parent: bytes = b""
    token_ids: bytes = b""


class EventsReply(msgspec.Struct, tag="events_reply", array_like=True):
    """Events of an EVENTS poll, the cursor to poll from next, how many events fell
    off the feed before they could be read (the subscriber lagged), and how many chunks
    of a SUBSCRIBE snapshot are left to page (at most: some may leave a tier first;
    live events from `cursor` come once it is 0)."""

    events: list[ChunkEvent]
    cursor: int
    lost: int
    snapshot_left: int = 0


Reply = (
    HelloReply | Ok | Error | LookupReply | BlocksReply | AllocReply | CountReply
    | KeysReply | InfoReply | ClientsReply | TierHandle | SubscribeReply | EventsReply
)

# Requests the daemon never answers (the client does not wait): see `Connection.send`.
NO_REPLY_REQUESTS = frozenset({Release, Invalidate})


def split_spans(block_ids: list[int], span_lengths: list[int]) -> list[list[int]]:
    """Cut `block_ids` into consecutive runs of `span_lengths[i]` ids (one per value).

    Raises:
        ValueError: the lengths do not add up to len(block_ids) (a reply out of protocol).
    """
    if len(span_lengths) == len(block_ids):  # one block per value: the usual case
        return [[block_id] for block_id in block_ids]
    spans, cursor = [], 0
    for length in span_lengths:
        spans.append(block_ids[cursor : cursor + length])
        cursor += length
    if cursor != len(block_ids):
        raise ValueError(f"span lengths add up to {cursor}, not {len(block_ids)} block ids")
    return spans
