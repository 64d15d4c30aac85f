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

Record header (docs/architecture.md, "Record layout"): 64 bytes, then the token ids as
int64 at offset RECORD_HEADER_BYTES::

    identity (32): <IIQ16s  magic "LMK2", num_tokens, layout fingerprint, chunk hash
    integrity (16): <IIQ    checksum kind, reserved, checksum
    zero (16)
"""

import struct

import numpy as np
import xxhash

FIXED_SEED = 0x6C6D63616368  # "lmcach"
ROOT_HASH = b"\0" * 16
HASH_BYTES = 16

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


def record_token_ids(record) -> np.ndarray:
    """The token ids of a record, read from its header (no verification of the hash).

    Args:
        record: the record's bytes (bytes or memoryview), header first.

    Returns:
        `[num_tokens]` little-endian int64 array viewing `record` (no copy).

    Raises:
        ValueError: the record is shorter than its header says, or has another magic.
    """
    if len(record) < RECORD_HEADER_BYTES:
        raise ValueError(f"a record is at least {RECORD_HEADER_BYTES} bytes, got {len(record)}")
    magic, num_tokens, _, _ = RECORD_HEADER.unpack_from(record, 0)
    if magic != RECORD_MAGIC:
        raise ValueError(f"record magic {magic:#x}, expected {RECORD_MAGIC:#x} (LMK2)")
    end = RECORD_HEADER_BYTES + 8 * num_tokens
    if len(record) < end:
        raise ValueError(f"record of {len(record)} bytes is shorter than its {num_tokens} token ids")
    return np.frombuffer(record, dtype="<i8", count=num_tokens, offset=RECORD_HEADER_BYTES)
