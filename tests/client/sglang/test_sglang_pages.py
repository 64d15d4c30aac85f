"""The page copies and key ids of the SGLang backend (lmcached/client/sglang/pages.py):
every run split, into and out of records in one block or across blocks, moves exactly
the page's bytes; a batch's key ids are each key's. Skipped where SGLang is not
installed (`make test-sglang` installs it)."""

import ctypes
import hashlib

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from lmcached.client.sglang import pages  # noqa: E402

pytestmark = pytest.mark.sglang

BLOCK = 4096


def runs_of(buf: np.ndarray, sizes: list[int], gap: int = 16) -> list[tuple[int, int]]:
    """(address, bytes) runs of `sizes` in `buf`, `gap` bytes apart."""
    runs, at = [], 0
    for n in sizes:
        runs.append((buf.ctypes.data + at, n))
        at += n + gap
    return runs


@pytest.mark.parametrize("sizes", [[3000], [1000, 1000, 1000], [2999, 1]])
@pytest.mark.parametrize("start", [0, BLOCK - 3000, BLOCK - 2999, BLOCK - 1])  # in one block or two
def test_a_page_goes_into_a_record_and_back_byte_exact(sizes, start):
    total = sum(sizes)
    rng = np.random.default_rng(len(sizes) * 10_000 + start)
    arena = np.zeros(4 * BLOCK, dtype=np.uint8)
    span = [2, 0]  # the record's blocks, out of order
    page = rng.integers(0, 256, 2 * total, dtype=np.uint8)
    back = np.zeros_like(page)
    block_offset = lambda block: block * BLOCK  # noqa: E731
    record = pages.record_runs(arena.ctypes.data, block_offset, BLOCK, span, start,
                               start + total)
    assert len(record) == (1 if start + total <= BLOCK else 2)
    pages.copy_runs(record, runs_of(page, sizes))
    stored = np.concatenate([arena[2 * BLOCK :][: BLOCK], arena[:BLOCK]])[start : start + total]
    expected = np.concatenate([page[a - page.ctypes.data :][:n] for a, n in runs_of(page, sizes)])
    assert stored.tobytes() == expected.tobytes()
    pages.copy_runs(runs_of(back, sizes), record)
    for (a, n), (b, _) in zip(runs_of(page, sizes), runs_of(back, sizes)):
        assert ctypes.string_at(a, n) == ctypes.string_at(b, n)


def test_runs_of_different_sizes_are_refused_before_any_copy():
    src, dst = np.ones(100, dtype=np.uint8), np.zeros(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="the page runs do not match the record"):
        pages.copy_runs([(dst.ctypes.data, 100)], [(src.ctypes.data, 99)])
    assert not dst.any()


def test_a_batchs_key_ids_are_each_keys_own():
    keys = ["a" * 64, "", "é" * 10, "x" * (pages.KEY_BYTES_MAX + 1)]
    batch = pages.keys_tokens(keys)
    assert batch.shape == (len(keys), pages.KEY_TOKENS) and batch.dtype == np.int64
    for key, row in zip(keys, batch):
        assert row.tobytes() == pages.key_tokens(key).tobytes()
    raw = "é".encode() * 10
    assert batch[2, 0] == len(raw) and batch[2].tobytes()[8 : 8 + len(raw)] == raw
    assert batch[3, 0] == (1 << 62) | (pages.KEY_BYTES_MAX + 1)
    assert batch[3].tobytes()[8:40] == hashlib.sha256(keys[3].encode()).digest()


@pytest.mark.parametrize("keys", [["a" * 64], ["a" * 65, "b"], ["", "é" * 10], [""],
                                  ["x" * (pages.KEY_BYTES_MAX + 1), "y"], ["z" * pages.KEY_BYTES_MAX],
                                  ["x" * (pages.KEY_BYTES_MAX + 1), "y" * 100]])
def test_key_slots_hold_every_byte_of_every_key_and_only_zeros_follow(keys):
    """The cheap page check compares `key_slots` slots: every key's length and bytes (or
    digest) lie in them, and each row is zero after them."""
    batch = pages.keys_tokens(keys)
    slots = pages.key_slots(batch)
    assert pages.keys_slots(keys) == slots  # the same count from the keys alone
    assert not batch[:, slots:].any()
    for key, row in zip(keys, batch):
        raw = key.encode()
        held = row[:slots].tobytes()
        if len(raw) > pages.KEY_BYTES_MAX:
            assert held[8:40] == hashlib.sha256(raw).digest()
        else:
            assert held[8 : 8 + len(raw)] == raw


@pytest.mark.parametrize("keys", [[f"{i:064x}" for i in range(64)], ["é" * 5, "ab" * 5], ["", ""],
                                  ["z" * pages.KEY_BYTES_MAX] * 2])
def test_keys_of_one_length_get_their_length_and_bytes_then_zeros(keys):
    """A batch of keys of one byte length (SGLang's: 64 hex digits) is encoded in one
    copy; each row is the key's length, its bytes, then zeros, as for any other key."""
    batch = pages.keys_tokens(keys)
    assert batch.shape == (len(keys), pages.KEY_TOKENS) and batch.dtype == np.int64
    for key, row in zip(keys, batch):
        raw = key.encode()
        expected = len(raw).to_bytes(8, "little") + raw
        assert row.tobytes() == expected + bytes(8 * pages.KEY_TOKENS - len(expected))


def test_the_batch_check_stops_at_the_first_page_that_is_not_its_keys(unique_name):
    """`RecordIO.verify_leading_slots` over page records: every page that holds its key
    passes; a wrong key hash, a key byte that differs, another fingerprint, or a block
    this arena does not have stops the count there."""
    from lmcached.client.records import RecordIO
    from lmcached.shm.arena import HEADER_BYTES, Arena

    layout = pages.page_layout("sglang/test", 1, 0, 1000)
    block = -(-layout.record_bytes(layout.chunk_size) // 64) * 64
    arena = Arena.create(unique_name, HEADER_BYTES + 8 * block, block, prefault=False)
    try:
        records = RecordIO(arena, layout)
        keys = [f"{i:064x}" for i in range(5)]
        tokens = pages.keys_tokens(keys)
        hashes = [pages.page_hash(t) for t in tokens]
        blocks = [6, 1, 3, 0, 7]
        for b, h, t in zip(blocks, hashes, tokens):
            records.write_with([b], h, t, lambda dst: dst.zero_())
        slots = pages.key_slots(tokens)
        assert records.verify_leading_slots(blocks, hashes, tokens, slots) == 5
        assert records.verify_leading_slots(blocks, hashes[:2] + [hashes[3]] + hashes[3:],
                                            tokens, slots) == 2
        other = tokens.copy()
        other[3, slots - 1] ^= 1 << 8  # the key's last slot: one byte differs
        assert records.verify_leading_slots(blocks, hashes, other, slots) == 3
        assert records.verify_leading_slots(blocks[:1] + [8] + blocks[2:], hashes, tokens,
                                            slots) == 1  # block 8: not in this arena
        assert RecordIO(arena, layout, fingerprint=layout.fingerprint ^ 1) \
            .verify_leading_slots(blocks, hashes, tokens, slots) == 0
        with pytest.raises(ValueError, match="num_slots=0"):
            records.verify_leading_slots(blocks, hashes, tokens, 0)
    finally:
        arena.close()
