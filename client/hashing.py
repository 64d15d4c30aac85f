"""Prefix-chain hashes of token chunks (after vLLM's `hash_block_tokens`).

    h_i = xxh3_128(h_{i-1} || little-endian int64 token bytes of chunk i), seed FIXED_SEED, h_{-1} = ROOT

The chain makes a chunk's hash depend on every token before it, so equal hashes mean
equal prefixes (up to a 2^-128 collision, which readers still catch by comparing token
ids). The seed is fixed so that every process on every node agrees: never Python's
salted `hash`, never a per-process random seed. Tokens are hashed from one contiguous
int64 array (converting a Python list of ints costs far more than hashing them).

A cache salt (vLLM's `cache_salt`: one per tenant) enters the chain at its root, as vLLM
folds the salt into its first block's hash: a salted chain starts from
`root_hash(salt) = xxh3_128(b"lmcached-salt\\0" || utf-8 salt)`, seed FIXED_SEED, instead of
ROOT_HASH, so that no chunk of one salt (or of an unsalted request) has the hash of a chunk
of another, and the salt costs nothing per chunk.

A deliberate deviation from the seed (LMCache's `LMCacheEngine` hashes chunks with
sha256): xxh3-128, chained as vLLM chains its block hashes. It is much faster, and its
weaker collision resistance costs nothing here, because every reader compares the token
ids stored in the record before it serves it (client/records.py).
"""

from typing import NewType, Sequence

import numpy as np
import torch
import xxhash

from lmcached.wire.protocol import TENANT_BYTES
from lmcached.wire.record_format import FIXED_SEED, hash_block_tokens  # noqa: F401 (re-export)
from lmcached.wire.record_format import ROOT_HASH as _ROOT_HASH

ChunkHash = NewType("ChunkHash", bytes)  # 16 bytes

ROOT_HASH = ChunkHash(_ROOT_HASH)
Tokens = torch.Tensor | np.ndarray | Sequence[int]  # token ids `[num_tokens]`, any of these

_SALT_PREFIX = b"lmcached-salt\0"


def root_hash(salt: str | None = None) -> ChunkHash:
    """The parent hash of a chain's first chunk: ROOT_HASH without a salt, otherwise
    `xxh3_128(b"lmcached-salt\\0" || salt.encode("utf-8"))` with seed FIXED_SEED (after
    vLLM, which folds `cache_salt` into its first block's hash).

    Args:
        salt: the request's cache salt (a tenant's name or secret), or None.

    Returns:
        16 bytes; ROOT_HASH exactly when `salt` is None.

    Raises:
        TypeError: `salt` is not a str.
        ValueError: `salt` is the empty string (vLLM refuses it too; an empty salt would
            look salted and share nothing with anyone, which no caller means).
    """
    if salt is None:
        return ROOT_HASH
    if not isinstance(salt, str):
        raise TypeError(f"a cache salt must be a str, got {type(salt).__name__}")
    if not salt:
        raise ValueError("a cache salt must not be empty: pass None for an unsalted request")
    return ChunkHash(xxhash.xxh3_128(_SALT_PREFIX + salt.encode("utf-8"), seed=FIXED_SEED).digest())


def tenant_fingerprint(salt: str | None = None) -> bytes:
    """The tenant fingerprint LOOKUP and ACQUIRE carry (wire `tenant`), by which the
    daemon counts hits and misses per tenant: the first TENANT_BYTES of `root_hash(salt)`,
    b"" without a salt. It tells the daemon no more than a request's `parent` already
    does at the start of a salted chain (README, "Trust model").

    Raises:
        TypeError / ValueError: as `root_hash`.
    """
    return b"" if salt is None else root_hash(salt)[:TENANT_BYTES]


def as_token_array(tokens: Tokens) -> np.ndarray:
    """Token ids as a contiguous little-endian int64 numpy array `[num_tokens]` (no copy
    when possible), so that every node hashes the same bytes whatever its byte order.

    Raises:
        TypeError: not an integer tensor, array or sequence.
        ValueError: not one-dimensional.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.is_floating_point() or tokens.is_complex():
            raise TypeError(f"token ids must be integers, got a {tokens.dtype} tensor")
        array = tokens.detach().cpu().numpy()
    elif isinstance(tokens, np.ndarray):
        array = tokens
    else:
        array = np.asarray(tokens, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional [num_tokens], got shape {array.shape}")
    return np.ascontiguousarray(array, dtype="<i8")


def hash_request_tokens(chunk_size: int, token_ids, salt: str | None = None) -> list[ChunkHash]:
    """Prefix-chain hashes of every chunk of a request, including a partial last chunk.

    Args:
        chunk_size: tokens per chunk, >= 1.
        token_ids: `[num_tokens]` integer tokens (tensor, array or sequence).
        salt: the request's cache salt, or None: the chain starts from `root_hash(salt)`.

    Returns:
        ceil(num_tokens / chunk_size) 16-byte hashes.

    Raises:
        ValueError: chunk_size < 1, or an empty salt.
        TypeError: a salt that is not a str.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    tokens = as_token_array(token_ids)
    hashes = []
    parent = root_hash(salt)
    for start in range(0, len(tokens), chunk_size):
        parent = ChunkHash(hash_block_tokens(parent, tokens[start : start + chunk_size]))
        hashes.append(parent)
    return hashes
