"""Wire protocol between clients and the daemon: typed msgpack messages on a Unix socket.

Why this file exists: it is the only contract between worker processes and the daemon.
Every request is one round trip and batches all chunks of a request (never one message
per chunk or per layer); bulk KV bytes never cross the socket, only block ids.

Frame::

    +----------------------+-----------------------------------------------+
    | length: u32 little   | msgspec msgpack of one tagged Struct (array)  |
    +----------------------+-----------------------------------------------+

A frame longer than MAX_FRAME_BYTES closes the connection. Messages are msgspec Structs
(never pickle from a peer). Chunk hashes travel as one `bytes` of 16 bytes per chunk
(xxh3_128 digests). Encoding and decoding a small Struct costs far less than the
socket round trip itself (DESIGN.md, "Performance rules").
"""

import os
import socket
import struct

import msgspec

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20
HASH_BYTES = 16
MAX_CHUNKS_PER_REQUEST = 1 << 16  # 16M tokens at chunk_size 256
_LENGTH = struct.Struct("<I")

# Per-chunk status in an ALLOC reply.
ALLOCATED = 0  # blocks handed out in WRITING for this session: write, then COMMIT
EXISTS = 1  # already READY: nothing to write
NOSPACE = 2  # nothing evictable: not stored (every later chunk is NOSPACE too)


class Layout(msgspec.Struct, frozen=True):
    """What a KV chunk is: the namespace of its hashes (see DESIGN.md, "Keys").

    Two processes share cached chunks only when their layouts are equal.
    `chunk_bytes` is the size of the record of one full chunk in the arena (header
    plus KV bytes), which sizes the daemon's blocks when `--block-size` is unset.
    """

    model_name: str
    world_size: int
    worker_id: int
    fmt: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    chunk_size: int
    chunk_bytes: int


# ------------------------------------------------------------------------ requests
class Hello(msgspec.Struct, tag="hello", array_like=True):
    """Opens a session. `layout` is None for admin tools that store nothing."""

    version: int
    pid: int
    name: str
    layout: Layout | None = None


class Lookup(msgspec.Struct, tag="lookup", array_like=True):
    """How many leading chunks of `hashes` are READY. No pins, no LRU change."""

    ns: int
    hashes: bytes


class Acquire(msgspec.Struct, tag="acquire", array_like=True):
    """Pin the READY prefix of `hashes` (ref_cnt += 1) and return its blocks."""

    ns: int
    hashes: bytes


class Release(msgspec.Struct, tag="release", array_like=True):
    """Unpin blocks this session pinned (every block id, in chain order)."""

    block_ids: list[int]


class Alloc(msgspec.Struct, tag="alloc", array_like=True):
    """Blocks to write the chunks of `hashes` that are not cached; `nbytes` per chunk."""

    ns: int
    hashes: bytes
    nbytes: list[int]


class Commit(msgspec.Struct, tag="commit", array_like=True):
    """WRITING -> READY for every value one of whose blocks is listed."""

    block_ids: list[int]


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """WRITING -> FREE for every value one of whose blocks is listed."""

    block_ids: list[int]


class Put(msgspec.Struct, tag="put", array_like=True):
    """Blocks to write a value of `nbytes` under a string key (replaces on COMMIT)."""

    ns: int
    key: str
    nbytes: int


class Get(msgspec.Struct, tag="get", array_like=True):
    """Pin the value under a string key and return its blocks (empty when missing)."""

    ns: int
    key: str


class Delete(msgspec.Struct, tag="delete", array_like=True):
    """Remove a string key now (its readers keep their pinned bytes)."""

    ns: int
    key: str


class Scan(msgspec.Struct, tag="scan", array_like=True):
    """String keys of namespace `ns` starting with `prefix`, at most `limit`."""

    ns: int
    prefix: str
    limit: int


class Info(msgspec.Struct, tag="info", array_like=True):
    """Server statistics: every section, or one."""

    section: str | None = None


class Clients(msgspec.Struct, tag="clients", array_like=True):
    """One entry per connected session."""


class Evict(msgspec.Struct, tag="evict", array_like=True):
    """Evict the `lru` least recently used values, or the value(s) under `key`.

    `key` is a string key of the key-value adapter, or 32 hex digits of a chunk hash;
    it is evicted in every namespace.
    """

    lru: int = 0
    key: str | None = None


class Clear(msgspec.Struct, tag="clear", array_like=True):
    """Evict every value nobody pins."""


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """Liveness check."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Graceful stop, as SIGTERM."""


class ConfigGet(msgspec.Struct, tag="config_get", array_like=True):
    """The daemon's effective configuration."""


Request = (
    Hello | Lookup | Acquire | Release | Alloc | Commit | Abort | Put | Get | Delete
    | Scan | Info | Clients | Evict | Clear | Ping | Shutdown | ConfigGet
)


# ------------------------------------------------------------------------- replies
class HelloReply(msgspec.Struct, tag="hello_reply", array_like=True):
    """Where the arena is. `ns` is None for a session without a layout."""

    session_id: int
    arena_name: str
    generation: int
    block_bytes: int
    num_blocks: int
    capacity_bytes: int
    ns: int | None
    server_pid: int


class Ok(msgspec.Struct, tag="ok", array_like=True):
    """Success with nothing to return."""


class Error(msgspec.Struct, tag="error", array_like=True):
    """The request was refused; the session stays open unless the frame was bad."""

    code: str
    message: str


class LookupReply(msgspec.Struct, tag="lookup_reply", array_like=True):
    """How many leading chunks of a LOOKUP are READY (no pins taken)."""

    num_chunks: int


class BlocksReply(msgspec.Struct, tag="blocks_reply", array_like=True):
    """Values found (ACQUIRE, GET): all their block ids, in order.

    `num_blocks[i]` blocks of `block_ids` belong to value i, which holds `nbytes[i]`.
    """

    block_ids: list[int]
    num_blocks: list[int]
    nbytes: list[int]


class AllocReply(msgspec.Struct, tag="alloc_reply", array_like=True):
    """Per chunk a status (ALLOCATED, EXISTS, NOSPACE); blocks of the ALLOCATED ones."""

    status: list[int]
    block_ids: list[int]
    num_blocks: list[int]


class CountReply(msgspec.Struct, tag="count_reply", array_like=True):
    """How many values a DELETE, EVICT or CLEAR removed."""

    count: int


class KeysReply(msgspec.Struct, tag="keys_reply", array_like=True):
    """String keys (of the key-value adapters) a SCAN found."""

    keys: list[str]


class InfoReply(msgspec.Struct, tag="info_reply", array_like=True):
    """Sections of `field -> value`, in display order."""

    sections: dict[str, dict[str, int | float | str]]


class ClientsReply(msgspec.Struct, tag="clients_reply", array_like=True):
    """One `field -> value` dict per connected session (CLIENTS)."""

    clients: list[dict[str, int | float | str]]


Reply = (
    HelloReply | Ok | Error | LookupReply | BlocksReply | AllocReply | CountReply
    | KeysReply | InfoReply | ClientsReply
)

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode_frame(message: msgspec.Struct) -> bytes:
    """Length-prefixed msgpack of `message`.

    Raises:
        ValueError: the encoded message exceeds MAX_FRAME_BYTES.
    """
    payload = _encoder.encode(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(
            f"message of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit"
        )
    return _LENGTH.pack(len(payload)) + payload


class DaemonError(RuntimeError):
    """The daemon answered a request with an Error reply.

    Attributes:
        code: machine-readable error kind (e.g. "bad_request", "not_owner").
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Connection:
    """A blocking client connection to the daemon: one request, one reply.

    Blocking sockets give the lowest round trip here (~22 us, against ~33 us for a
    selectors loop and 56-160 us for asyncio). Not thread-safe: callers that share one
    connection between threads hold their own lock.

    A request that fails half-way (timeout, closed socket, undecodable reply) leaves the
    byte stream out of step: a late reply would be read as the answer to the next
    request. The connection then refuses every later request; open a new one.

    Args:
        socket_path: path of the daemon's Unix socket.
        timeout_s: connect timeout, and the default timeout of each request, in seconds.

    Raises:
        OSError (FileNotFoundError, ConnectionRefusedError, PermissionError,
            TimeoutError, ...): no daemon answers at `socket_path`.
    """

    # The reply type of each request (see lmcached/service.py); any other reply, other
    # than an Error, means the peer does not speak this protocol.
    REPLY_TYPES: dict[type, type] = {
        Hello: HelloReply, Lookup: LookupReply, Acquire: BlocksReply, Release: Ok,
        Alloc: AllocReply, Commit: Ok, Abort: Ok, Put: AllocReply, Get: BlocksReply,
        Delete: CountReply, Scan: KeysReply, Info: InfoReply, Clients: ClientsReply,
        Evict: CountReply, Clear: CountReply, Ping: Ok, Shutdown: Ok, ConfigGet: InfoReply,
    }

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock_timeout_s = timeout_s
        try:
            self._sock.connect(socket_path)
        except BaseException:
            self._sock.close()
            raise
        self._header = bytearray(_LENGTH.size)
        self._broken: str | None = None

    def request(self, message: msgspec.Struct, timeout_s: float | None = None) -> msgspec.Struct:
        """Send one request and return its reply.

        Args:
            message: a request Struct.
            timeout_s: how long the send, and each receive of the reply, may wait, in
                seconds (None: the connection's `timeout_s`). A stopped daemon costs
                one timeout.

        Raises:
            DaemonError: the daemon answered with an Error (the connection stays usable).
            ValueError: the message exceeds MAX_FRAME_BYTES; nothing was sent (the
                connection stays usable).
            TimeoutError: no reply within the timeout; the connection is then unusable.
            ConnectionError: the daemon closed the connection (it stopped or crashed),
                answered with a frame that does not decode or is not this request's
                reply type, or an earlier request on this connection failed half-way.
        """
        if self._broken is not None:
            raise ConnectionError(
                f"connection to {self.socket_path} is out of step after an earlier failure "
                f"({self._broken}): open a new Connection"
            )
        frame = encode_frame(message)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if timeout_s != self._sock_timeout_s:  # settimeout costs a syscall: only on change
            self._sock.settimeout(timeout_s)
            self._sock_timeout_s = timeout_s
        try:
            self._sock.sendall(frame)
            self._recv_exactly(self._header)
            (length,) = _LENGTH.unpack(self._header)
            if length > MAX_FRAME_BYTES:
                raise ConnectionError(f"reply frame of {length} bytes exceeds the limit")
            payload = bytearray(length)
            self._recv_exactly(payload)
            try:
                reply = reply_decoder.decode(payload)
            except (msgspec.MsgspecError, ValueError) as exc:  # ValueError: bad UTF-8
                raise ConnectionError(
                    f"undecodable reply from the daemon ({type(exc).__name__}: {exc})"
                ) from None
            if isinstance(reply, Error):
                raise DaemonError(reply.code, reply.message)
            expected = self.REPLY_TYPES.get(type(message))
            if expected is not None and not isinstance(reply, expected):
                raise ConnectionError(
                    f"the daemon answered {type(message).__name__} with "
                    f"{type(reply).__name__}, expected {expected.__name__}"
                )
        except DaemonError:
            raise
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise
        return reply

    def _recv_exactly(self, buf: bytearray) -> None:
        view = memoryview(buf)
        while view:
            n = self._sock.recv_into(view)
            if n == 0:
                raise ConnectionResetError("the daemon closed the connection")
            view = view[n:]

    def close(self) -> None:
        """Close the socket (the daemon then releases this session's pins)."""
        self._sock.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hello(conn: Connection, name: str, layout: Layout | None = None) -> HelloReply:
    """Open a session on `conn` (see `Hello`)."""
    return conn.request(Hello(PROTOCOL_VERSION, os.getpid(), name, layout))
