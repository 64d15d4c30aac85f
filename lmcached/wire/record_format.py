"""The bytes both sides agree on without torch: chunk prefix hashes and the record header.

Why this file exists: the client writes chunk records (client/layout.py, client/records.py)
and hashes chunks (client/hashing.py), and the daemon must check both when it takes a
record from outside the arena (the L2 tier, lmcached/daemon/l2/): it fetches a value from Redis and
verifies that its token ids hash to the chunk hash it asked for. The daemon never imports
torch or `lmcached.client`, so the constants and the one hash function live here, and the
client re-exports them. It imports nothing of the daemon (like `protocol`).

Chunk hash chain (after vLLM's `hash_block_tokens`)::

    h_i = xxh3_128(h_{i-1} || little-endian int64 token bytes of chunk i), seed FIXED_SEED
    h_{-1} = ROOT_HASH (16 zero bytes)

Record header (docs/architecture.md, "Record layout"), written by `write_header` (or,
several at once, `header_rows`) and parsed by `read_header` (and `record_matches`, on
the readers' hot path) only: 64 bytes, then the token ids as int64 at offset
RECORD_HEADER_BYTES::

    identity (32): <IIQ16s  magic "LMK2", num_tokens, layout fingerprint, chunk hash
    integrity (16): <IIQ    checksum kind, reserved, checksum
    zero (16)
"""

import struct
from typing import NamedTuple

import numpy as np
import xxhash

FIXED_SEED = 0x6C6D63616368  # "lmcach"
ROOT_HASH = b"\0" * 16

RECORD_MAGIC = 0x324B4D4C  # "LMK2" (format 2: integrity fields; format 1 was "LMKV")
RECORD_HEADER_BYTES = 64
# Identity, compared whole by readers: magic u32, num_tokens u32, layout fingerprint u64,
# chunk hash 16 bytes.
RECORD_HEADER = struct.Struct("<IIQ16s")
# Integrity, at offset RECORD_HEADER.size: checksum kind u32, reserved u32, checksum u64.
RECORD_CHECKSUM = struct.Struct("<IIQ")
CHECKSUM_NONE = 0
CHECKSUM_XXH3_64 = 1


def hash_block_tokens(parent_hash: bytes, token_ids) -> bytes:
    """Hash of one chunk given its parent's hash.

    Args:
        parent_hash: 16-byte hash of the previous chunk, or ROOT_HASH for the first.
        token_ids: the chunk's token ids, a contiguous little-endian int64 buffer
            (`np.ndarray` `[chunk_tokens]`, or bytes / memoryview of 8 bytes per token).

    Returns:
        The 16-byte xxh3_128 digest.
    """
    hasher = xxhash.xxh3_128(parent_hash, seed=FIXED_SEED)
    hasher.update(token_ids)
    return hasher.digest()


class RecordHeader(NamedTuple):
    """A record's identity as its header states it (not verified: see `record_matches`).

    Attributes:
        num_tokens: token ids that follow the header (int64 at RECORD_HEADER_BYTES).
        fingerprint: the 64-bit identity of the writer's layout.
        chunk_hash: the chunk's 16-byte prefix hash.
    """

    num_tokens: int
    fingerprint: int
    chunk_hash: bytes

    @property
    def tokens_end(self) -> int:
        """Offset of the byte after the record's token ids (where its KV starts)."""
        return RECORD_HEADER_BYTES + 8 * self.num_tokens


def write_header(header: np.ndarray, fingerprint: int, chunk_hash: bytes,
                 chunk_tokens: np.ndarray) -> None:
    """Write a record's header and token ids: the one writer of the record header.

    Every header byte is written (checksum kind CHECKSUM_NONE until the client seals
    the record): nothing of a block's previous record survives into this one.

    Args:
        header: the record's first bytes, uint8, at least
            RECORD_HEADER_BYTES + 8 * len(chunk_tokens) bytes (an arena view).
        fingerprint: the writer's layout fingerprint.
        chunk_hash: the chunk's 16-byte prefix hash.
        chunk_tokens: `[num_tokens]` int64 token ids of the chunk.
    """
    t = len(chunk_tokens)
    header[:RECORD_HEADER_BYTES] = 0
    RECORD_HEADER.pack_into(header, 0, RECORD_MAGIC, t, fingerprint, chunk_hash)
    header[RECORD_HEADER_BYTES : RECORD_HEADER_BYTES + 8 * t].view(np.int64)[:] = chunk_tokens


def header_rows(fingerprint: int, chunk_hashes: list[bytes],
                chunk_tokens: np.ndarray) -> np.ndarray:
    """The header and token id bytes of several records of equal token counts, one row
    each, as `write_header` writes them (every byte: the checksum kind is
    CHECKSUM_NONE until the client seals a record).

    Args:
        fingerprint: the writer's layout fingerprint.
        chunk_hashes: each chunk's 16-byte prefix hash.
        chunk_tokens: `[len(chunk_hashes), num_tokens]` int64 token ids.

    Returns:
        uint8 `[len(chunk_hashes), RECORD_HEADER_BYTES + 8 * num_tokens]`, to be copied
        to the start of each record.
    """
    n, t = chunk_tokens.shape
    rows = np.zeros((n, RECORD_HEADER_BYTES + 8 * t), dtype=np.uint8)
    rows[:, : RECORD_HEADER.size] = np.frombuffer(
        b"".join([RECORD_HEADER.pack(RECORD_MAGIC, t, fingerprint, h) for h in chunk_hashes]),
        dtype=np.uint8).reshape(n, RECORD_HEADER.size)
    rows[:, RECORD_HEADER_BYTES:].view(np.int64)[:] = chunk_tokens
    return rows


def read_header(record) -> RecordHeader:
    """The identity a record's header states: the one parser of the record header.

    Args:
        record: the record's bytes (bytes, memoryview or uint8 array), header first.

    Returns:
        Its `RecordHeader`; whether the token ids are all there is the caller's to
        check against `tokens_end`.

    Raises:
        ValueError: the record is shorter than a header, or has another magic.
    """
    if len(record) < RECORD_HEADER_BYTES:
        raise ValueError(f"record of {len(record)} bytes has no header")
    magic, num_tokens, fingerprint, chunk_hash = RECORD_HEADER.unpack_from(record, 0)
    if magic != RECORD_MAGIC:
        raise ValueError(f"record magic {magic:#x}, expected {RECORD_MAGIC:#x} (LMK2)")
    return RecordHeader(num_tokens, fingerprint, chunk_hash)


def record_matches(header: np.ndarray, chunk_hash: bytes, chunk_tokens: np.ndarray,
                   fingerprint: int) -> bool:
    """True when a record's header bytes (uint8, header and token ids) name exactly this
    chunk: magic, token count, layout fingerprint, chunk hash and token ids.

    Unpacks the header inline rather than through `read_header`: readers call it once
    per chunk on the retrieve path, where an exception per miss would cost more.
    """
    t = len(chunk_tokens)
    magic, num_tokens, record_fingerprint, record_hash = RECORD_HEADER.unpack_from(header, 0)
    if (
        magic != RECORD_MAGIC
        or num_tokens != t
        or record_fingerprint != fingerprint
        or record_hash != chunk_hash
    ):
        return False
    # A byte comparison in C: ~1 us for 256 tokens, 4x faster than np.array_equal.
    return header[RECORD_HEADER_BYTES : RECORD_HEADER_BYTES + 8 * t].tobytes() == chunk_tokens.tobytes()
