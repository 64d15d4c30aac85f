"""lmcached.wire.record_format: the record header's one writer and one parser agree."""

import numpy as np
import pytest

from lmcached.wire import record_format
from lmcached.wire.record_format import (
    CHECKSUM_NONE,
    RECORD_CHECKSUM,
    RECORD_HEADER,
    RECORD_HEADER_BYTES,
    RecordHeader,
    read_header,
    record_matches,
    write_header,
)

CHUNK_HASH = bytes(range(16))
FINGERPRINT = 0x1234_5678_9ABC_DEF0


def written(tokens: np.ndarray) -> np.ndarray:
    """A record's header and token ids as `write_header` lays them out over old bytes."""
    record = np.full(RECORD_HEADER_BYTES + 8 * len(tokens) + 32, 0xAB, dtype=np.uint8)
    write_header(record, FINGERPRINT, CHUNK_HASH, tokens)
    return record


def test_read_header_returns_what_write_header_wrote():
    tokens = np.arange(5, dtype=np.int64)
    header = read_header(written(tokens))
    assert header == RecordHeader(5, FINGERPRINT, CHUNK_HASH)
    assert header.tokens_end == RECORD_HEADER_BYTES + 40


def test_write_header_leaves_nothing_of_the_previous_record_in_the_header():
    record = written(np.arange(3, dtype=np.int64))
    kind, reserved, checksum = RECORD_CHECKSUM.unpack_from(record, RECORD_HEADER.size)
    assert (kind, reserved, checksum) == (CHECKSUM_NONE, 0, 0)
    assert not record[RECORD_HEADER.size + RECORD_CHECKSUM.size : RECORD_HEADER_BYTES].any()
    assert record[RECORD_HEADER_BYTES:].view(np.int64)[:3].tolist() == [0, 1, 2]


@pytest.mark.parametrize("length", [0, RECORD_HEADER_BYTES - 1])
def test_read_header_refuses_a_record_shorter_than_a_header(length):
    with pytest.raises(ValueError, match="has no header"):
        read_header(bytes(length))


def test_read_header_refuses_another_magic():
    record = written(np.arange(2, dtype=np.int64))
    record[0] ^= 0xFF
    with pytest.raises(ValueError, match="record magic"):
        read_header(record)


def test_record_matches_only_the_chunk_it_was_written_for():
    tokens = np.arange(4, dtype=np.int64)
    record = written(tokens)
    assert record_matches(record, CHUNK_HASH, tokens, FINGERPRINT)
    assert not record_matches(record, bytes(16), tokens, FINGERPRINT)
    assert not record_matches(record, CHUNK_HASH, tokens, FINGERPRINT + 1)
    assert not record_matches(record, CHUNK_HASH, tokens[::-1].copy(), FINGERPRINT)
    assert not record_matches(record, CHUNK_HASH, tokens[:3].copy(), FINGERPRINT)


def test_header_rows_are_byte_for_byte_what_write_header_writes():
    rng = np.random.default_rng(7)
    tokens = rng.integers(-2**63, 2**63 - 1, size=(5, 9), dtype=np.int64)
    hashes = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(5)]
    rows = record_format.header_rows(0x1234_5678_9ABC_DEF0, hashes, tokens)
    assert rows.shape == (5, record_format.RECORD_HEADER_BYTES + 8 * 9)
    for row, h, t in zip(rows, hashes, tokens):
        one = np.full(len(row), 0xEE, dtype=np.uint8)  # stale bytes: all overwritten
        record_format.write_header(one, 0x1234_5678_9ABC_DEF0, h, t)
        assert row.tobytes() == one.tobytes()
        assert record_format.record_matches(row, h, t, 0x1234_5678_9ABC_DEF0)
