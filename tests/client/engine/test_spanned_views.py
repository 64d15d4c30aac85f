"""`retrieve_views` of records that span several arena blocks (client/views.py
`SpannedRecord`, `RecordIO.layer_view`): the same bytes as `retrieve`, a view of every
layer that lies in one block, a copy only where a layer crosses a block boundary, and
no pin left after the views are closed. Real daemons (the conftest fixture stops them by
pid; `no_leaked_segments` checks /dev/shm after each test)."""

import numpy as np
import pytest
import torch

from lmcached.client import CacheEngine, KVLayout, hash_request_tokens
from lmcached.client.kv_io import KVSource
from lmcached.client.records import RecordIO
from lmcached.client.tiered_records import TieredRecords
from lmcached.client.views import SpannedRecord
from lmcached.shm.arena import Arena
from test_engine import make_kv

# fp32, 8 layers of 16 KiB for a full 64-token chunk: a 131,648-byte record over three
# 64 KiB blocks, whose layers 3 and 7 cross a block boundary and the others do not.
SPANNED = dict(num_layers=8, num_kv_heads=2, head_size=16, dtype="float32", chunk_size=64)
CROSSING_LAYERS = {3, 7}


def arena_range(eng: CacheEngine, tokens: torch.Tensor) -> range:
    """Addresses of the engine's mapped arena (read from a pinned run of `tokens`)."""
    run = eng.acquire(tokens)
    try:
        arena = run.records.arena
        base = arena.block_view(0).data_ptr() - arena.block_offset(0)
        return range(base, base + arena.capacity_bytes)
    finally:
        run.release()


@pytest.mark.parametrize("fmt", ["vllm", "huggingface"])
@pytest.mark.parametrize("skip", [0, 70])
def test_views_of_multi_block_records_equal_retrieve(daemon_factory, fmt, skip):
    layout = KVLayout("spanned", fmt=fmt, **SPANNED)
    assert layout.record_bytes(64) > 2 * 65536
    daemon = daemon_factory("--capacity", "8MiB", "--block-size", "64KiB")
    tokens = torch.arange(200)  # chunks of 64, 64, 64 and 8 tokens (the last: one block)
    mask = torch.arange(200) >= skip
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as eng:
        kv = make_kv(layout, 200)
        assert eng.store(tokens, kv) == 4
        expected, ret_mask = eng.retrieve(tokens, mask=mask, return_tuple=False)
        assert int(ret_mask.sum()) == 200 - skip
        torch.testing.assert_close(expected, kv.narrow(layout.token_dim, skip, 200 - skip),
                                   rtol=0, atol=0)
        layers_out = tuple((torch.zeros(layout.chunk_shape(200)[2:]),
                            torch.zeros(layout.chunk_shape(200)[2:])) for _ in range(8))
        got, _ = eng.retrieve(tokens, mask=mask, out=layers_out)  # per-layer destinations
        for layer, (k, v) in enumerate(got):
            assert torch.equal(torch.stack((k, v)), expected[layer]), layer
        arena = arena_range(eng, tokens)
        with eng.retrieve_views(tokens, mask=mask) as views:
            assert (views.start_token, views.num_tokens) == (skip, 200 - skip)
            num_spanned = 3 - skip // 64  # full chunks viewed, from the one holding `skip`
            assert len(views.block_ids) == 3 * num_spanned + 1
            for layer in range(layout.num_layers):
                pieces = views.layer(layer)
                assert torch.equal(torch.cat(pieces, dim=layout.token_dim - 1), expected[layer])
                in_arena = [piece.data_ptr() in arena for piece in pieces]
                # full spanned chunks: a view unless the layer crosses a block boundary;
                # the last, one-block chunk: always a view
                assert in_arena == [layer not in CROSSING_LAYERS] * num_spanned + [True], layer
            assert torch.equal(torch.cat(views.chunks, dim=layout.token_dim), expected)
            out = torch.full(layout.chunk_shape(256), float("nan"))
            assert torch.equal(views.copy_to(out), expected)
            assert daemon.pins_held() > 0
        with pytest.raises(RuntimeError, match="released"):
            views.layer(0)
        assert daemon.info()["pinned_blocks"] == 0


@pytest.mark.parametrize("fmt", ["vllm", "huggingface"])
def test_layers_of_a_record_in_scattered_blocks_read_through_tiered_records(unique_name, fmt):
    """Blocks of a record come from the LRU free queue in any order: a span of reversed,
    non-adjacent blocks reads back layer by layer, also through `TieredRecords` (an
    engine that mapped a device tier: multi-block records are in the host arena)."""
    layout = KVLayout("spanned", fmt=fmt, **SPANNED)
    host = Arena.create_memfd(unique_name, 7, 1 << 20, 64 * 1024)
    device = Arena.create_memfd(unique_name, 7, 1 << 20, 64 * 1024)
    try:
        records = TieredRecords({0: RecordIO(host, layout), 1: RecordIO(device, layout)})
        span = [9, 2, 5]
        tokens = np.arange(64, dtype=np.int64)
        kv = make_kv(layout, 64, seed=3)
        records.write(span, hash_request_tokens(64, tokens)[0], tokens,
                      KVSource(kv, layout), 0, 64)
        assert torch.equal(records.read_kv(span, 64), kv)
        for layer in range(layout.num_layers):
            assert torch.equal(records.layer_view(span, 64, layer), kv[layer]), layer
        viewed = SpannedRecord(records, span, 64, first=10)
        expected = kv.narrow(layout.token_dim, 10, 54)
        assert torch.equal(viewed.gather(layout.token_dim), expected)
        out = torch.zeros(layout.chunk_shape(54))
        viewed.copy_to(out)
        assert torch.equal(out, expected)
    finally:
        host.close()
        device.close()


LLAMA_3_8B = dict(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                  chunk_size=256)  # README's layout: a 32 MiB + 2,112-byte chunk record


@pytest.mark.parametrize("capacity, blocks_per_chunk", [("1536MiB", 1), ("512MiB", 2)])
def test_views_on_a_derived_block_size_with_a_llama_3_8b_layout(daemon_factory, capacity,
                                                                 blocks_per_chunk):
    """`lmcached serve --capacity 1536MiB` without --block-size used to derive 24 MiB
    blocks, and `retrieve_views` refused the 32 MiB chunks: now one block per chunk
    (views, no copy). A 512 MiB arena cuts each chunk into two equal blocks: served too."""
    layout = KVLayout("meta-llama/Meta-Llama-3-8B", **LLAMA_3_8B)
    daemon = daemon_factory("--capacity", capacity)
    tokens = torch.arange(512)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as eng:
        kv = make_kv(layout, 512)
        assert eng.store(tokens, kv) == 2
        arena = arena_range(eng, tokens)
        with eng.retrieve_views(tokens) as views:
            assert views.num_tokens == 512
            assert len(views.block_ids) == 2 * blocks_per_chunk
            assert torch.equal(torch.cat(views.chunks, dim=layout.token_dim), kv)
            assert all((chunk.data_ptr() in arena) == (blocks_per_chunk == 1)
                       for chunk in views.chunks)
            assert torch.equal(torch.cat(views.layer(31), dim=layout.token_dim - 1), kv[31])
        assert daemon.info()["pinned_blocks"] == 0
    block_bytes = daemon.info()["block_bytes"]
    assert block_bytes * blocks_per_chunk >= layout.record_bytes(256)
    fill_ratio = layout.record_bytes(256) / (blocks_per_chunk * block_bytes)
    assert (f"block_bytes={block_bytes} for the daemon's life" in daemon.log()
            and f"{blocks_per_chunk} block(s) per chunk, fill ratio {fill_ratio:.4f}; start "
            f"the daemon with --block-size {block_bytes} " in daemon.log())
