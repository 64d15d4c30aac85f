"""Opt-in payload checksums (verify="checksum"): what they catch, and what they cost nothing.

A reader with verify="tokens" checks layout, chunk hash and token ids; one with
verify="checksum" also recomputes the record's xxh3-64 of identity || token ids || KV.
Every tamper below is one a stray or careless writer could do through the shared mapping.
"""

import logging
import os
import struct

import numpy as np
import pytest
import torch
import xxhash

from engine_worker import prompt_kv, small_layout
from lmcached.client import CacheEngine, KVLayout, hash_request_tokens
from lmcached.client.layout import (
    CHECKSUM_XXH3_64,
    RECORD_HEADER,
    RECORD_HEADER_BYTES,
)

LAYOUT = small_layout()  # chunk_size 16
TOKENS = list(range(48))  # 3 chunks


def connect(daemon, verify: str, layout: KVLayout = LAYOUT) -> CacheEngine:
    return CacheEngine.connect(layout, socket=daemon.socket, strict=True, verify=verify)


def stored_blocks(engine: CacheEngine, tokens) -> list[int]:
    """Block id of each chunk of `tokens` (pins them for a moment)."""
    with engine.retrieve_views(tokens) as views:
        assert views.num_tokens == len(tokens)
        return list(views.block_ids)


def record_bytes(engine: CacheEngine, block_id: int, num_tokens: int) -> np.ndarray:
    """uint8 view of one one-block record: header, token ids and KV (the arena)."""
    arena = engine.link.arena
    return arena.numpy_view(arena.block_offset(block_id), engine.layout.record_bytes(num_tokens))


def segment_bytes(engine: CacheEngine, block_id: int, num_bytes: int) -> bytes:
    """`num_bytes` of block `block_id` read from the segment's file in /dev/shm (a mapping
    of our own, not the engine's)."""
    arena = engine.link.arena
    with open(f"/dev/shm{arena.segment_name}", "rb") as segment:
        return os.pread(segment.fileno(), num_bytes, arena.block_offset(block_id))


def test_checksummed_records_round_trip_and_carry_their_checksum(daemon):
    # The record format as client/layout.py documents it, for chunk_size 16: identity
    # (32 bytes) and integrity (kind u32, reserved u32, checksum u64) in a 64-byte header,
    # int64 token ids from offset 64 (16 slots), KV from the next multiple of 64 (192);
    # the checksum is xxh3-64 of identity || the chunk's token ids || its KV bytes.
    kv = prompt_kv(LAYOUT, TOKENS)
    num_kv_bytes = kv[:, :, :16].numel() * 2  # bfloat16
    with connect(daemon, "checksum") as engine:
        assert engine.store(TOKENS, kv) == 3
        for i, block_id in enumerate(stored_blocks(engine, TOKENS)):
            record = segment_bytes(engine, block_id, 192 + num_kv_bytes)
            identity, token_ids, kv_bytes = record[:32], record[64:64 + 8 * 16], record[192:]
            _, num_tokens, _, chunk_hash = struct.unpack("<IIQ16s", identity)
            assert (num_tokens, chunk_hash) == (16, hash_request_tokens(16, TOKENS)[i])
            assert token_ids == struct.pack("<16q", *TOKENS[16 * i : 16 * (i + 1)])
            chunk_kv = kv[:, :, 16 * i : 16 * (i + 1)].contiguous()
            assert kv_bytes == chunk_kv.view(torch.uint8).numpy().tobytes()
            kind, reserved, checksum = struct.unpack_from("<IIQ", record, 32)
            assert (kind, reserved) == (CHECKSUM_XXH3_64, 0)
            assert checksum == xxhash.xxh3_64_intdigest(identity + token_ids + kv_bytes)
        got, ret_mask = engine.retrieve(TOKENS, return_tuple=False)
        assert bool(ret_mask.all()) and torch.equal(got, kv)
        with engine.retrieve_views(TOKENS) as views:
            assert torch.equal(torch.cat(views.chunks, dim=LAYOUT.token_dim), kv)
        assert engine.num_checksum_failures == 0 and engine.num_verify_failures == 0


@pytest.mark.parametrize("reader_verify, served", [("tokens", True), ("checksum", False)])
def test_a_kv_byte_changed_after_commit_is_a_counted_miss_only_with_checksums(
        daemon, reader_verify, served):
    kv = prompt_kv(LAYOUT, TOKENS)
    with connect(daemon, "checksum") as writer, connect(daemon, reader_verify) as reader:
        writer.store(TOKENS, kv)
        second = stored_blocks(writer, TOKENS)[1]
        record_bytes(writer, second, 16)[LAYOUT.kv_offset + 100] ^= 0x01  # one bit of chunk 1
        got, ret_mask = reader.retrieve(TOKENS, return_tuple=False)
        if served:  # token ids are intact: a tokens-only reader cannot tell
            assert int(ret_mask.sum()) == 48 and not torch.equal(got, kv)
            return
        assert ret_mask.tolist() == [True] * 16 + [False] * 32
        assert torch.equal(got, kv[:, :, :16])
        # The reader invalidated chunk 1: the next read does not even find it.
        with reader.retrieve_views(TOKENS) as views:
            assert views.num_tokens == 16
        assert reader.num_checksum_failures == 1 and reader.num_verify_failures == 0
        assert (reader.hit_tokens, reader.miss_tokens) == (32, 64)
    fields = daemon.info()
    assert fields["pinned_blocks"] == 0 and fields["invalidated_chunks"] == 1


def test_a_record_written_without_checksum_is_a_miss_for_a_checksum_reader(daemon, caplog):
    kv = prompt_kv(LAYOUT, TOKENS)
    other = list(range(1000, 1048))
    with connect(daemon, "tokens") as writer, connect(daemon, "checksum") as reader:
        writer.store(TOKENS, kv)
        writer.store(other, kv)
        with caplog.at_level(logging.WARNING, logger="lmcached"):
            for tokens in (TOKENS, other, TOKENS):
                got, ret_mask = reader.retrieve(tokens)
                assert got == () and not ret_mask.any()
        assert reader.num_checksum_failures == 2  # the third read found nothing to check
        assert sum("no payload checksum" in r.getMessage() for r in caplog.records) == 1
        # The checksum reader invalidated the unsealed records; its own store seals them,
        # and both kinds of readers read those.
        assert reader.store(TOKENS, kv) == 3
        for engine in (writer, reader):
            got, ret_mask = engine.retrieve(TOKENS, return_tuple=False)
            assert bool(ret_mask.all()) and torch.equal(got, kv)
    fields = daemon.info()
    assert fields["pinned_blocks"] == 0 and fields["invalidated_chunks"] == 6


@pytest.mark.parametrize("reader_verify", ["checksum", "tokens"])
def test_a_corrupt_hot_chunk_is_a_miss_once_and_hits_again_after_one_store(daemon,
                                                                            reader_verify):
    # One stray write into the first chunk of a hot prompt: a KV bit (found by the
    # checksum) or a token id (found by any reader). Without INVALIDATE each re-store's
    # ALLOC answers EXISTS and the prompt would miss for every client for ever.
    tokens = list(range(64))  # 4 chunks
    kv = prompt_kv(LAYOUT, tokens)
    with connect(daemon, "checksum") as writer, connect(daemon, reader_verify) as reader:
        assert writer.store(tokens, kv) == 4
        first = stored_blocks(writer, tokens)[0]
        offset = LAYOUT.kv_offset + 100 if reader_verify == "checksum" else RECORD_HEADER_BYTES
        record_bytes(writer, first, 16)[offset] ^= 0x01
        got, ret_mask = reader.retrieve(tokens)
        assert got == () and not ret_mask.any()  # a miss, once
        assert reader.store(tokens, kv) == 1  # the next store replaces that chunk only
        for _ in range(128):
            got, ret_mask = reader.retrieve(tokens, return_tuple=False)
            assert bool(ret_mask.all())
        assert torch.equal(got, kv)
        assert reader.num_checksum_failures + reader.num_verify_failures == 1
    fields = daemon.info()
    assert fields["invalidated_chunks"] == 1 and fields["pinned_blocks"] == 0


def test_the_checksum_binds_the_kv_to_its_chunk(daemon):
    # Copy chunk 0's KV and its valid checksum into chunk 1's record, keeping chunk 1's
    # header and token ids: a checksum of the KV alone would accept it.
    kv = prompt_kv(LAYOUT, TOKENS)
    with connect(daemon, "checksum") as engine:
        engine.store(TOKENS, kv)
        first, second = stored_blocks(engine, TOKENS)[:2]
        src, dst = record_bytes(engine, first, 16), record_bytes(engine, second, 16)
        dst[LAYOUT.kv_offset :] = src[LAYOUT.kv_offset :]
        integrity = slice(RECORD_HEADER.size, RECORD_HEADER_BYTES)  # chunk 0's checksum
        dst[integrity] = src[integrity]
        got, ret_mask = engine.retrieve(TOKENS, return_tuple=False)
        assert int(ret_mask.sum()) == 16 and torch.equal(got, kv[:, :, :16])
        assert engine.num_checksum_failures == 1


def test_records_spanning_several_blocks_are_checksummed(daemon_factory):
    layout = KVLayout("wide", num_layers=4, num_kv_heads=4, head_size=32, chunk_size=64)
    assert layout.record_bytes(64) > 3 * 4096
    daemon = daemon_factory("--capacity", "4MiB", "--block-size", "4KiB")
    tokens = list(range(100))
    kv = prompt_kv(layout, tokens)
    with connect(daemon, "checksum", layout) as engine:
        assert engine.store(tokens, kv) == 2
        got, _ = engine.retrieve(tokens, return_tuple=False)
        assert torch.equal(got, kv)
        # Flip one KV byte in the third block of the first record.
        run = engine._acquire(np.asarray(tokens, dtype=np.int64), 0)
        spans = run.spans
        run.release()
        assert [len(span) for span in spans] == [33, 19]
        arena = engine.link.arena
        arena.numpy_view(arena.block_offset(spans[0][2]) + 7, 1)[0] ^= 0x80
        got, ret_mask = engine.retrieve(tokens, return_tuple=False)
        assert not ret_mask.any() and engine.num_checksum_failures == 1


def test_a_record_of_the_previous_format_is_never_read(daemon):
    kv = prompt_kv(LAYOUT, TOKENS)
    with connect(daemon, "tokens") as engine:
        engine.store(TOKENS, kv)
        block_id = stored_blocks(engine, TOKENS)[0]
        record = record_bytes(engine, block_id, 16)
        magic, *rest = RECORD_HEADER.unpack_from(record, 0)
        RECORD_HEADER.pack_into(record, 0, 0x564B4D4C, *rest)  # "LMKV", format 1
        got, ret_mask = engine.retrieve(TOKENS)
        assert got == () and not ret_mask.any() and engine.num_verify_failures == 1


def test_verify_must_be_tokens_or_checksum(daemon):
    with pytest.raises(ValueError, match='"tokens" or "checksum"'):
        CacheEngine.connect(LAYOUT, socket=daemon.socket, verify="crc")
    assert daemon.info()["connected_clients"] == 1  # the INFO session only: none was opened


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_records_stored_from_gpu_are_sealed_after_the_copies_land(daemon):
    # cuda_register: the device-to-host copies into the arena are asynchronous DMA; the
    # checksum must be computed after they completed, or every record fails it.
    layout = KVLayout("gpu-llama", num_layers=4, num_kv_heads=4, head_size=64, chunk_size=64)
    kv = torch.randn(layout.chunk_shape(300), device="cuda").to(torch.bfloat16)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True, verify="checksum",
                             cuda_register=True) as engine:
        assert engine.store(torch.arange(300), kv) == 5
        got, ret_mask = engine.retrieve(torch.arange(300), return_tuple=False)
        assert bool(ret_mask.all()) and torch.equal(got, kv.cpu())
        assert engine.num_checksum_failures == 0
