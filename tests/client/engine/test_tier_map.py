"""The GPU tier's record reader (client/tier_map.py) on a CPU tensor standing in for the
tier's device memory: the same record format as the host arena, headers checked from one
gather of their rows, zero-copy KV views. The CUDA import itself runs only on a GPU
(tests/system/test_gpu_tier.py)."""

import types

import numpy as np
import pytest
import torch

from lmcached.client import KVLayout, hash_request_tokens
from lmcached.client.records import RecordIO
from lmcached.client.tier_map import DeviceRecordIO
from lmcached.shm.arena import HEADER_BYTES, Arena

LAYOUT = KVLayout("tier-map", num_layers=2, num_kv_heads=2, head_size=16, chunk_size=16)
BLOCK_BYTES = 16384


def stand_in_tier(num_blocks: int = 8):
    """What DeviceRecordIO reads of a CudaTierMap, with host memory."""
    return types.SimpleNamespace(u8=torch.zeros(num_blocks * BLOCK_BYTES, dtype=torch.uint8),
                                 num_blocks=num_blocks, block_bytes=BLOCK_BYTES)


def test_device_records_have_the_host_format_and_verify_by_header_rows(unique_name):
    tokens = np.arange(40, dtype=np.int64)  # 2 full chunks and one of 8 tokens
    hashes = hash_request_tokens(LAYOUT.chunk_size, tokens)
    chunks = [(0, 16), (16, 32), (32, 40)]
    tier = stand_in_tier()
    records = DeviceRecordIO(tier, LAYOUT)
    kvs = [torch.randn(LAYOUT.chunk_shape(e - s)).to(LAYOUT.torch_dtype) for s, e in chunks]
    for block, h, (s, e), kv in zip([5, 2, 7], hashes, chunks, kvs):
        records.write_with([block], h, tokens[s:e], lambda dst, kv=kv: dst.copy_(kv))
    spans = [[5], [2], [7]]
    assert records.verify_prefix(spans, hashes, tokens, chunks, LAYOUT.fingerprint) == 3
    for span, (s, e), kv in zip(spans, chunks, kvs):
        view = records.kv_view(span[0], e - s)
        assert torch.equal(view, kv)
        assert view.untyped_storage().data_ptr() == tier.u8.untyped_storage().data_ptr()
    # A record elsewhere, or another chunk's, is refused where it stands.
    assert records.verify_prefix([[5], [3], [7]], hashes, tokens, chunks,
                                 LAYOUT.fingerprint) == 1
    assert not records.verify([2], hashes[0], tokens[0:16], LAYOUT.fingerprint)
    # Byte for byte what the host arena's RecordIO writes for the same chunk.
    arena = Arena.create(unique_name, HEADER_BYTES + 8 * BLOCK_BYTES, BLOCK_BYTES,
                         prefault=False)
    try:
        host = RecordIO(arena, LAYOUT)
        host.write_with([5], hashes[0], tokens[0:16], lambda dst: dst.copy_(kvs[0]))
        record_bytes = LAYOUT.record_bytes(16)
        assert bytes(arena.numpy_view(arena.block_offset(5), record_bytes)) == \
            bytes(tier.u8[5 * BLOCK_BYTES : 5 * BLOCK_BYTES + record_bytes].numpy())
    finally:
        arena.close()


def test_device_records_refuse_what_needs_the_cpu():
    records = DeviceRecordIO(stand_in_tier(), LAYOUT)
    with pytest.raises(ValueError, match="one-block"):
        records.write_with([1, 2], b"\0" * 16, np.arange(16), lambda dst: None)
    for method in (records.seal, records.checksum_ok, records.pieces):
        with pytest.raises(NotImplementedError, match="GPU tier"):
            method([1], 16)
    records.synchronize()  # a CPU stand-in: nothing to wait for
