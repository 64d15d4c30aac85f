"""Golden digests of the prefix hash chain (client/hashing.py).

Chunk hashes are keys shared by every process on every node and by whatever a daemon has
already stored: a change of seed, byte encoding, root hash or chaining silently turns every
cached chunk into a miss (or, between mixed versions, makes two clients disagree). So the
expected digests are written here literally, and each one is also recomputed by
`_reference_chain`, an independent re-implementation of the documented rule

    h_i = xxh3_128(h_{i-1} || int64 little-endian bytes of chunk i), seed 0x6C6D63616368,
    h_{-1} = 16 zero bytes

that builds the bytes itself with `struct` (no numpy, no torch, no code from the package).
A deliberate change of hashing must update the literals here, and say so.
"""

import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import assume, given
from hypothesis import strategies as st

from lmcached.client.hashing import as_token_array, hash_block_tokens, hash_request_tokens, root_hash

DOCUMENTED_SEED = 0x6C6D63616368  # b"lmcach": hashing.py; docs/architecture.md, "Chunk hashes"
DOCUMENTED_ROOT = b"\0" * 16

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)

# (chunk_size, token ids, expected hex digests, one per chunk): computed once with
# _reference_chain and with hash_request_tokens, which agreed.
GOLDEN = {
    "600 tokens by 256: two full chunks and a partial one": (
        256,
        list(range(600)),
        [
            "24a1c57ece0f31b682fae8529e35f607",
            "1c14bc4432a6445f58b787798e9df3c3",
            "b29e4f5ada7eae25b89f009a54e0d5f6",
        ],
    ),
    "600 tokens by 128: the same tokens give other hashes": (
        128,
        list(range(600)),
        [
            "d9b834c3101039d5c531f5df81c6b001",
            "c9255c655ade7276c127312ddbf1e63d",
            "1eb841bd17bf9c8d665595e1c9beee35",
            "3f4c99868d0df2f67b408af39b87b268",
            "71d399c8f9e3edffd484c2e2960635ac",
        ],
    ),
    "no tokens: no chunks": (256, [], []),
    "one partial chunk": (256, [1, 2, 3], ["e549b12afab785950ac7c80adc259307"]),
    "int64 values beyond int32, negatives and both extremes": (
        4,
        [2**31, 2**40 + 7, 2**63 - 1, -1, -(2**63), 5],
        [
            "9e24bedab57e1f294e7ba0b2933f636e",
            "b02af97b15d07356554baf336151405d",
        ],
    ),
}


def _reference_chain(chunk_size: int, token_ids: list[int]) -> list[bytes]:
    """The documented rule, written out: one xxh3_128 over parent || packed int64 tokens."""
    hashes = []
    parent = DOCUMENTED_ROOT
    for start in range(0, len(token_ids), chunk_size):
        chunk = token_ids[start : start + chunk_size]
        data = parent + struct.pack(f"<{len(chunk)}q", *chunk)
        parent = xxhash.xxh3_128_digest(data, seed=DOCUMENTED_SEED)
        hashes.append(parent)
    return hashes


def test_xxh3_128_library_matches_the_published_test_vector():
    # XXH3_128bits("", seed 0) from xxHash's own test suite (canonical big-endian form):
    # pins the algorithm the golden digests below rely on, independently of this project.
    assert xxhash.xxh3_128_hexdigest(b"", seed=0) == "99aa06d3014798d86001c324468d497f"


@pytest.mark.parametrize("case", list(GOLDEN))
def test_hash_request_tokens_matches_golden_digests(case):
    chunk_size, token_ids, expected = GOLDEN[case]
    assert [h.hex() for h in hash_request_tokens(chunk_size, token_ids)] == expected


@pytest.mark.parametrize("case", list(GOLDEN))
def test_golden_digests_follow_the_documented_rule(case):
    chunk_size, token_ids, expected = GOLDEN[case]
    assert [h.hex() for h in _reference_chain(chunk_size, token_ids)] == expected


def test_hash_block_tokens_chains_from_the_root():
    chunk_size, token_ids, expected = GOLDEN["600 tokens by 256: two full chunks and a partial one"]
    tokens = np.arange(600, dtype=np.int64)
    h0 = hash_block_tokens(DOCUMENTED_ROOT, tokens[:256])
    h1 = hash_block_tokens(h0, tokens[256:512])
    h2 = hash_block_tokens(h1, tokens[512:])
    assert [h0.hex(), h1.hex(), h2.hex()] == expected
    assert all(isinstance(h, bytes) and len(h) == 16 for h in (h0, h1, h2))


@pytest.mark.parametrize(
    "tokens",
    [
        list(range(600)),
        np.arange(600, dtype=np.int32),
        np.arange(600, dtype=np.uint16),
        np.arange(600, dtype=np.int64)[::1],
        np.arange(1200, dtype=np.int64)[::2] // 2,  # non-contiguous view
        torch.arange(600, dtype=torch.int32),
        torch.arange(600, dtype=torch.int64),
    ],
    ids=["list", "int32", "uint16", "int64", "strided", "torch-int32", "torch-int64"],
)
def test_hash_does_not_depend_on_the_container_or_integer_dtype(tokens):
    # A vLLM worker passes int32 tensors, the engine int64 arrays, a user a list: all must
    # find the same chunks, because the tokens are widened to int64 before hashing.
    expected = GOLDEN["600 tokens by 256: two full chunks and a partial one"][2]
    assert [h.hex() for h in hash_request_tokens(256, tokens)] == expected


def test_misuse_raises_with_the_fix():
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        hash_request_tokens(0, [1, 2, 3])
    with pytest.raises(TypeError, match="must be integers"):
        hash_request_tokens(4, torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="must be integers"):
        hash_request_tokens(4, np.array([1.5, 2.5]))
    with pytest.raises(ValueError, match="one-dimensional"):
        hash_request_tokens(4, np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="one-dimensional"):
        as_token_array(torch.zeros((1, 8), dtype=torch.int64))


@given(
    tokens=st.lists(INT64, min_size=1, max_size=60),
    chunk_size=st.integers(min_value=1, max_value=16),
    data=st.data(),
)
def test_changing_one_token_changes_its_chunk_and_every_later_one_only(tokens, chunk_size, data):
    position = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1), label="position")
    new_value = data.draw(INT64.filter(lambda v: v != tokens[position]), label="new_value")
    changed = list(tokens)
    changed[position] = new_value

    before = hash_request_tokens(chunk_size, tokens)
    after = hash_request_tokens(chunk_size, changed)

    changed_chunk = position // chunk_size
    assert len(before) == len(after) == -(-len(tokens) // chunk_size)
    assert before[:changed_chunk] == after[:changed_chunk]
    assert all(b != a for b, a in zip(before[changed_chunk:], after[changed_chunk:]))


@given(tokens=st.lists(INT64, max_size=80), chunk_size=st.integers(min_value=1, max_value=20))
def test_chain_matches_the_reference_on_any_tokens(tokens, chunk_size):
    assert hash_request_tokens(chunk_size, tokens) == _reference_chain(chunk_size, tokens)


@given(
    tokens=st.lists(INT64, min_size=1, max_size=80),
    chunk_size=st.integers(min_value=1, max_value=20),
    data=st.data(),
)
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(tokens, chunk_size, data):
    # What lets a shorter prompt find the chunks a longer one stored (and the reverse).
    num_full = data.draw(st.integers(min_value=0, max_value=len(tokens) // chunk_size))
    full = hash_request_tokens(chunk_size, tokens)
    assert hash_request_tokens(chunk_size, tokens[: num_full * chunk_size]) == full[:num_full]


@given(
    tokens=st.lists(INT64, min_size=2, max_size=64),
    sizes=st.lists(st.integers(min_value=1, max_value=32), min_size=2, max_size=2, unique=True),
)
def test_chain_depends_on_chunk_size(tokens, sizes):
    # Two layouts with different chunk sizes never share a first hash: their chunks cover
    # different token runs (the namespace separates them as well; this is the second guard).
    small, large = sorted(sizes)
    assume(small < len(tokens))  # else both are one chunk of the same tokens: equal by design
    assert hash_request_tokens(small, tokens)[0] != hash_request_tokens(large, tokens)[0]


# A salted chain starts from xxh3_128(b"lmcached-salt\0" || utf-8 salt), seed as above
# (client/hashing.py, `root_hash`): written literally, as the digests above are.
SALTED_ROOT_TENANT_A = "301523b1a6ae90d3e9db61631e1f6509"


def test_a_salted_chain_starts_from_the_documented_salted_root():
    assert root_hash("tenant-a").hex() == SALTED_ROOT_TENANT_A
    expected = xxhash.xxh3_128(b"lmcached-salt\0" + "tenant-a".encode(), seed=DOCUMENTED_SEED).hexdigest()
    assert root_hash("tenant-a").hex() == expected
    tokens = np.arange(600, dtype=np.int64)
    first = hash_block_tokens(bytes.fromhex(SALTED_ROOT_TENANT_A), tokens[:256])
    assert hash_request_tokens(256, tokens, salt="tenant-a")[0] == first


def test_no_salt_is_the_unsalted_chain_and_salts_share_no_hash():
    tokens = np.arange(1000, dtype=np.int64)
    plain = hash_request_tokens(256, tokens)
    assert root_hash(None) == DOCUMENTED_ROOT
    assert hash_request_tokens(256, tokens, salt=None) == plain
    a = hash_request_tokens(256, tokens, salt="a")
    b = hash_request_tokens(256, tokens, salt="b")
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)


def test_a_salt_that_is_not_a_non_empty_str_is_refused():
    with pytest.raises(ValueError, match="pass None"):
        root_hash("")
    with pytest.raises(TypeError, match="must be a str"):
        hash_request_tokens(256, [1, 2, 3], salt=b"a")
