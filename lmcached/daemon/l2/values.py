"""Keys of chunks in L2: where each chunk's value lives in Redis.

Why this file exists: an L2 is shared by every node; a chunk's key names its namespace
(by fingerprint, the same on every node: `lmcached.daemon.spill.envelope.
namespace_fingerprint`), its chunk hash, and the L2's clear generation. The value under
the key is an envelope and the record (lmcached/daemon/spill/envelope.py). Pure
functions, no I/O: `redis_store.py` moves the bytes, `tier.py` decides when.

Key (no hash tag, so a Redis cluster spreads the chunks of one prompt over every
master), under the L2's clear generation G (`GENERATION_KEY`, an integer that each
CLEAR increments: docs/l2.md, "CLEAR and the L2")::

    lmcached:v1:<namespace fingerprint, 32 hex>:<chunk hash, 32 hex>          (G = 0)
    lmcached:v1:g<G>:<namespace fingerprint, 32 hex>:<chunk hash, 32 hex>     (G > 0)
"""

from lmcached.daemon.spill.envelope import check_hash

KEY_PREFIX = "lmcached:v1"
GENERATION_KEY = b"lmcached:v1:generation"  # the L2's clear generation (INCR by CLEAR)


def l2_key(ns_fp: bytes, chunk_hash: bytes, prefix: str = KEY_PREFIX,
           generation: int = 0) -> bytes:
    """The Redis key of one chunk: `<prefix>:<ns_fp hex>:<chunk_hash hex>`, or with
    `g<generation>:` after the prefix when `generation` > 0.

    Args:
        ns_fp: the namespace fingerprint (`namespace_fingerprint`), 16 bytes.
        chunk_hash: the chunk's prefix hash (`record_format.hash_block_tokens`), 16 bytes.
        prefix: the key space; the default names this value format (v1).
        generation: the L2's clear generation (`GENERATION_KEY`) the key belongs to:
            a CLEAR increments it, and keys of an older generation are never read again.

    Returns:
        The key, ASCII bytes.

    Raises:
        ValueError: a hash that is not 16 bytes, or a negative generation.
    """
    check_hash("ns_fp", ns_fp)
    check_hash("chunk_hash", chunk_hash)
    if generation < 0:
        raise ValueError(f"L2 generation must be >= 0, got {generation}")
    space = prefix.encode() if not generation else b"%s:g%d" % (prefix.encode(), generation)
    return b"%s:%s:%s" % (space, ns_fp.hex().encode(), chunk_hash.hex().encode())
