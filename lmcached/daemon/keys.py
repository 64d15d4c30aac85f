"""Keys of cached values in the daemon's block pool: what bytes a request's names become.

Why this file exists: the block pool indexes opaque bytes (`BlockHash`), and every
request that names a value (LOOKUP, ACQUIRE, ALLOC by chunk hash; PUT, GET, DELETE, SCAN
by string key; an admin's EVICT of a key) must build the same bytes for it. This is the
one place that says what they are:

    KV chunk:    b"c" + namespace id (u32 le) + 16-byte chunk hash
    string key:  b"s" + namespace id (u32 le) + utf-8 key

The tag keeps chunks and string keys apart, the namespace id (assigned at HELLO, one
per layout) keeps models, TP ranks and dtypes apart. Keys are plain bytes so that the
pool's dict hashes them once, in C. Validation (whose namespace, how many hashes) is
request semantics and stays in `service.py`.
"""

import functools
import operator
import struct
from typing import Iterable

from lmcached.wire.protocol import HASH_BYTES

CHUNK_TAG = b"c"
STRING_TAG = b"s"


# The namespace id bytes of a key, chunk or string (`namespace_tag`): what the block
# pool counts its values by (`ValueLedger.group_of`), so that the daemon knows when no
# cached value uses a namespace any more. In C: no Python frame per commit or eviction.
namespace_tag_of = operator.itemgetter(slice(1, 5))


def namespace_tag(ns: int) -> bytes:
    """The 4 bytes that name namespace `ns` in each of its keys (`namespace_tag_of`)."""
    return ns.to_bytes(4, "little")


def chunk_prefix(ns: int) -> bytes:
    """The 5 bytes that start the key of every KV chunk of namespace `ns`."""
    return CHUNK_TAG + namespace_tag(ns)


def string_prefix(ns: int) -> bytes:
    """The 5 bytes that start every string key of namespace `ns`."""
    return STRING_TAG + namespace_tag(ns)


@functools.lru_cache(maxsize=512)
def _hash_splitter(num_hashes: int) -> struct.Struct:
    """A Struct that splits `num_hashes` concatenated digests in C (4x a Python loop)."""
    return struct.Struct(f"{HASH_BYTES}s" * num_hashes)


def chunk_keys(prefix: bytes, hashes: bytes) -> list[bytes]:
    """Keys of the chunks whose digests are concatenated in `hashes`, in order.

    Args:
        prefix: `chunk_prefix(ns)` of the request's namespace.
        hashes: HASH_BYTES-byte chunk hashes back to back; the caller has checked that
            the length is a multiple of HASH_BYTES.
    """
    return list(map(prefix.__add__, _hash_splitter(len(hashes) // HASH_BYTES).unpack(hashes)))


def string_key(ns: int, key: str) -> bytes:
    """Key of the string key `key` of namespace `ns`."""
    return string_prefix(ns) + key.encode()


def keys_named(namespaces: Iterable[int], name: str) -> list[bytes]:
    """Every key an admin's `EVICT <name>` may mean, namespace by namespace.

    In each namespace: the string key `name`, and, when `name` is 2 * HASH_BYTES hex
    digits, the KV chunk of that hash.
    """
    chunk_hash = None
    if len(name) == 2 * HASH_BYTES:
        try:
            chunk_hash = bytes.fromhex(name)
        except ValueError:
            pass
    out = []
    for ns in namespaces:
        out.append(string_key(ns, name))
        if chunk_hash is not None:
            out.append(chunk_prefix(ns) + chunk_hash)
    return out
