"""The envelope of a chunk that leaves the arena: what one writer writes and any reader can trust.

Why this file exists: a chunk spilled below the arena (an L2 value in Redis, a disk tier
slot) is read back by another daemon, a restarted one, or a node that serves another
model, and anyone who can reach Redis or the file can write to it. A value read back is
therefore checked before the daemon installs it in its arena: that it is a value of this
namespace and this chunk, that its bytes are the bytes that were written, and that its
token ids hash to the chunk hash that was asked for (so a colliding key or a record of
another prompt is a miss, never served). Every spill tier writes, parses and verifies the
envelope here, once. Pure functions, no I/O.

Value (an L2 value is both parts in one string; a disk slot has the envelope in its first
page and the record page-aligned after it, lmcached/daemon/disk/slots.py)::

    offset 0                                                        64
    | envelope <4sHHQQ16s16s, zero pad to 64 bytes:                 | record, as in the
    |   magic "LML2", version u16 = 1, flags u16 = 0,                |   arena: header,
    |   record bytes u64, xxh3_64 (seed 0) of the record u64,        |   token ids (int64
    |   namespace fingerprint 16, chunk hash 16                      |   LE at 64), KV

All integers little-endian; the hashes are HASH_BYTES (16) long. A writer that can write a
value can write a consistent one: the checks catch corruption, collisions and mix-ups, not
an attacker with write access.
"""

import struct
from typing import NamedTuple

import msgspec
import xxhash

from lmcached.wire.protocol import HASH_BYTES, Layout
from lmcached.wire.record_format import (
    FIXED_SEED,
    RECORD_HEADER_BYTES,
    hash_block_tokens,
    read_header,
)

MAGIC = b"LML2"  # the envelope's first bytes, in L2 values and disk slots alike
ENVELOPE_VERSION = 1
# magic, version, flags, record length, xxh3_64 of the record, namespace fp, chunk hash.
ENVELOPE = struct.Struct("<4sHHQQ16s16s")
ENVELOPE_BYTES = 64
_PAD = bytes(ENVELOPE_BYTES - ENVELOPE.size)

VERIFY_REASONS = ("envelope", "foreign", "checksum", "tokens")


class VerifyError(Exception):
    """A value read back from a spill tier that must not be served (a counted miss).

    Attributes:
        reason: one of VERIFY_REASONS: "envelope" (too short, another magic, envelope
            version or flags, a pad that is not zero, or a record length that is not the
            value's), "foreign" (the envelope names another namespace or chunk: another
            namespace's value under a colliding key), "checksum" (the record bytes
            changed since they were written), "tokens" (not the record of that chunk:
            another record magic or chunk hash in its header, no token ids, or token ids
            that do not hash to the chunk hash from its parent).
        slot_sound: the value passed every check of its own (envelope, checksum, its
            record's header) and failed only the one that depends on the request: its
            token ids do not hash to the chunk hash from the parent the request gave.
            The request is wrong or the value is, and nothing tells which: a store (the
            disk tier's index) keeps such a value, so one client's wrong `parent`
            never deletes what others read.
    """

    def __init__(self, reason: str, detail: str, slot_sound: bool = False) -> None:
        assert reason in VERIFY_REASONS, f"unknown verify reason {reason!r} (a bug)"
        super().__init__(f"L2 value refused ({reason}): {detail}")
        self.reason = reason
        self.slot_sound = slot_sound


class Envelope(NamedTuple):
    """An envelope's fields (`parse_envelope`).

    Attributes:
        record_bytes: the length of the record it covers, in bytes.
        checksum: xxh3_64 (seed 0) of the record's bytes.
        ns_fp: the namespace fingerprint, HASH_BYTES.
        chunk_hash: the chunk hash, HASH_BYTES.
    """

    record_bytes: int
    checksum: int
    ns_fp: bytes
    chunk_hash: bytes


def parse_envelope(data) -> Envelope | None:
    """The fields of an envelope, or None when `data` is not one this version wrote.

    Checks the envelope alone, nothing it covers: ENVELOPE_BYTES long at least (longer is
    cut), MAGIC, ENVELOPE_VERSION, flags 0 and a zero pad.
    The record, its checksum and its token ids are `verify_parts`'.

    Args:
        data: bytes-like, the envelope first.
    """
    view = memoryview(data).cast("B")[:ENVELOPE_BYTES]
    if view.nbytes < ENVELOPE_BYTES:
        return None
    magic, version, flags, record_bytes, checksum, ns_fp, chunk_hash = ENVELOPE.unpack_from(view)
    if (magic != MAGIC or version != ENVELOPE_VERSION or flags
            or view[ENVELOPE.size:ENVELOPE_BYTES] != _PAD):
        return None
    return Envelope(record_bytes, checksum, ns_fp, chunk_hash)


def check_hash(name: str, value: bytes) -> None:
    """Raise ValueError naming `name` unless `value` is bytes of HASH_BYTES."""
    if not isinstance(value, bytes | bytearray) or len(value) != HASH_BYTES:
        raise ValueError(f"{name} must be {HASH_BYTES} bytes, got {value!r:.60}")


def namespace_fingerprint(layout: Layout) -> bytes:
    """The 16-byte fingerprint of a namespace, the same on every node and process.

    xxh3_128 (seed FIXED_SEED) of `msgspec.msgpack.encode(layout)`: every field counts
    (model name, world size, TP rank, format, dtype, geometry, chunk size, record bytes;
    the vLLM connector's model name also carries its version and block layout), so two
    nodes share values only when their layouts are equal. Namespace ids, unlike this,
    are per daemon.

    Args:
        layout: the namespace's layout, as the client sent it in HELLO.

    Returns:
        16 bytes.

    Raises:
        TypeError: `layout` is not a `protocol.Layout` (pass `KVLayout.to_wire()`).
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"namespace_fingerprint takes a protocol.Layout (KVLayout.to_wire()), "
                        f"got {type(layout).__name__}")
    return xxhash.xxh3_128_digest(msgspec.msgpack.encode(layout), seed=FIXED_SEED)


def encode_value(ns_fp: bytes, chunk_hash: bytes, record_pieces: list) -> bytes:
    """The value of a record: the envelope, then the record's bytes (one join), as L2
    stores it.

    Args:
        ns_fp: namespace fingerprint, 16 bytes.
        chunk_hash: the chunk's hash, 16 bytes.
        record_pieces: the record's bytes in order (bytes or memoryviews of any format:
            a record that spans several arena blocks is one view per block, the last
            one cut to the record's length). Read once, not kept.

    Returns:
        ENVELOPE_BYTES + record length bytes.

    Raises:
        ValueError: a hash that is not 16 bytes.
    """
    views = [memoryview(piece).cast("B") for piece in record_pieces]
    return b"".join([encode_envelope(ns_fp, chunk_hash, views), *views])


def encode_envelope(ns_fp: bytes, chunk_hash: bytes, record_pieces: list) -> bytes:
    """The envelope alone (ENVELOPE_BYTES, pad included) of a record: what goes before
    it in an L2 value, or in a disk tier slot (lmcached/daemon/disk/slots.py), which
    writes the record in place and the envelope last.

    Args:
        ns_fp: namespace fingerprint, 16 bytes.
        chunk_hash: the chunk's hash, 16 bytes.
        record_pieces: the record's bytes in order (bytes or memoryviews); read once.

    Returns:
        ENVELOPE_BYTES bytes.

    Raises:
        ValueError: a hash that is not 16 bytes.
    """
    check_hash("ns_fp", ns_fp)
    check_hash("chunk_hash", chunk_hash)
    hasher = xxhash.xxh3_64()
    record_bytes = 0
    for piece in record_pieces:
        view = memoryview(piece).cast("B")
        hasher.update(view)
        record_bytes += view.nbytes
    return ENVELOPE.pack(MAGIC, ENVELOPE_VERSION, 0, record_bytes, hasher.intdigest(),
                         bytes(ns_fp), bytes(chunk_hash)) + _PAD


def verify_value(value, ns_fp: bytes, chunk_hash: bytes, parent_hash: bytes) -> memoryview:
    """Check a value read back whole (an L2 value) and return its record.

    The checks are `verify_parts`', on the envelope and the record of one value.

    Args:
        value: the value as GET returned it (bytes, bytearray or memoryview).
        ns_fp: the namespace fingerprint asked for, 16 bytes.
        chunk_hash: the chunk hash asked for, 16 bytes.
        parent_hash: the hash of the chunk before it (ROOT_HASH for the first chunk).

    Returns:
        A memoryview of the record inside `value` (no copy): header, token ids, KV.

    Raises:
        VerifyError: the value must not be served; its `reason` says why.
    """
    view = memoryview(value).cast("B")
    if view.nbytes < ENVELOPE_BYTES:
        raise VerifyError("envelope", f"{view.nbytes} bytes, shorter than the envelope")
    record = view[ENVELOPE_BYTES:]
    verify_parts(view[:ENVELOPE_BYTES], [record], ns_fp, chunk_hash, parent_hash)
    return record


def verify_parts(envelope, record_pieces: list, ns_fp: bytes, chunk_hash: bytes,
                 parent_hash: bytes) -> None:
    """Check an envelope and the record it covers, wherever each lies (an L2 value's
    two parts, or a disk tier slot's envelope page and the arena blocks its record was
    read into: lmcached/daemon/disk/fetch.py).

    The checks run cheapest first: the envelope, whose value it is, the checksum of the
    record bytes, then the record's header and its token ids, hashed from the parent's
    hash as the chunk hash chain does (`record_format.hash_block_tokens`).

    Args:
        envelope: the envelope's ENVELOPE_BYTES (bytes-like; longer is cut).
        record_pieces: the record's bytes in order (bytes-like, any number of pieces, as
            the arena blocks of a value that spans several); read, not kept.
        ns_fp: the namespace fingerprint asked for, 16 bytes.
        chunk_hash: the chunk hash asked for, 16 bytes.
        parent_hash: the hash of the chunk before it (ROOT_HASH for the first chunk).

    Raises:
        VerifyError: the value must not be served; its `reason` says why.
    """
    view = memoryview(envelope).cast("B")[:ENVELOPE_BYTES]
    if view.nbytes < ENVELOPE_BYTES:
        raise VerifyError("envelope", f"{view.nbytes} bytes, shorter than the envelope")
    pieces = [memoryview(piece).cast("B") for piece in record_pieces]
    total = sum(piece.nbytes for piece in pieces)
    fields = parse_envelope(view)
    if fields is None:
        magic, version, flags = ENVELOPE.unpack_from(view)[:3]
        raise VerifyError("envelope", f"magic {magic!r}, version {version}, flags {flags:#x}")
    record_bytes, checksum, value_fp, value_hash = fields
    if record_bytes != total:
        raise VerifyError("envelope", f"record of {record_bytes} bytes in a value of "
                                      f"{ENVELOPE_BYTES + total}")
    if value_fp != ns_fp or value_hash != chunk_hash:
        raise VerifyError("foreign", f"value of namespace {value_fp.hex()}, chunk "
                                     f"{value_hash.hex()}")
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    if hasher.intdigest() != checksum:
        raise VerifyError("checksum", "record bytes differ from the bytes written")
    try:
        header = read_header(_prefix(pieces, RECORD_HEADER_BYTES))
    except ValueError as exc:
        raise VerifyError("tokens", str(exc)) from None
    tokens_end = header.tokens_end
    if header.chunk_hash != chunk_hash or header.num_tokens == 0 or tokens_end > record_bytes:
        raise VerifyError("tokens", f"record of chunk {header.chunk_hash.hex()}, "
                                      f"{header.num_tokens} tokens in {record_bytes} bytes")
    token_ids = _prefix(pieces, tokens_end)[RECORD_HEADER_BYTES:tokens_end]
    if hash_block_tokens(parent_hash, token_ids) != chunk_hash:
        raise VerifyError("tokens", "token ids do not hash to the chunk hash from the "
                                      "request's parent", slot_sound=True)


def _prefix(pieces: list[memoryview], num_bytes: int):
    """The first `num_bytes` of a record in pieces (fewer if it is shorter): a view of
    the first piece when it holds them, else a copy of them."""
    if pieces and pieces[0].nbytes >= num_bytes:
        return pieces[0][:num_bytes]
    return b"".join(pieces)[:num_bytes]
