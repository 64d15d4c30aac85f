"""PagedBlocks (the vLLM connector's worker side) without vLLM: paged KV caches in the
layouts vLLM's backends register, copied block by block into arena records and back.

Runs everywhere on CPU; the CUDA cases run where a device is present (`pytest -m cuda`).
"""

import pytest
import torch

from lmcached.client.layout import KVLayout
from lmcached.client.vllm_worker import PagedBlocks

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE = 12, 16, 2, 32
LAYERS = ["layer.0", "layer.1", "layer.2"]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


def cpu_layout_cache(device: str) -> torch.Tensor:
    """vLLM 0.32 CPU backend: [num_blocks, num_kv_heads, block_size, 2*head_size], dense."""
    return torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE,
                       device=device).to(torch.bfloat16)


def permuted_layout_cache(device: str) -> torch.Tensor:
    """A GPU-style view: allocated [num_blocks, block_size, 2, heads, head] (per-block dense),
    seen as [num_blocks, 2, block_size, heads, head] with permuted strides."""
    base = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, KV_HEADS, HEAD_SIZE,
                       device=device).to(torch.bfloat16)
    return base.permute(0, 2, 1, 3, 4)


def page_bytes_of(cache: torch.Tensor) -> int:
    return cache[0].numel() * cache.element_size()


def raw_block(cache: torch.Tensor, block_id: int) -> bytes:
    """The bytes of one block as they lie in memory (dense slab in storage order)."""
    start = cache.storage_offset() + block_id * cache.stride(0)
    flat = torch.as_strided(cache, (cache[0].numel(),), (1,), start)
    return flat.cpu().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_cache", [cpu_layout_cache, permuted_layout_cache],
                         ids=["cpu-layout", "permuted-strides"])
def test_gather_then_scatter_moves_whole_blocks_bit_exactly(device, make_cache):
    caches = {name: make_cache(device) for name in LAYERS}
    paged = PagedBlocks(caches, LAYERS, {name: "TEST" for name in LAYERS})
    page_bytes = page_bytes_of(caches[LAYERS[0]])
    assert paged.page_bytes == page_bytes
    src_blocks = [7, 2, 9]
    record = torch.empty(len(LAYERS) * len(src_blocks) * page_bytes, dtype=torch.uint8)
    paged.gather(src_blocks, record)
    # record layout: [num_layers][blocks][page_bytes], each page the block's raw bytes
    rec = record.view(len(LAYERS), len(src_blocks), page_bytes)
    for layer, name in enumerate(LAYERS):
        for j, block_id in enumerate(src_blocks):
            assert rec[layer, j].numpy().tobytes() == raw_block(caches[name], block_id)
    # load the 2nd and 3rd pages of the record into blocks 0 and 11
    before = {name: raw_block(caches[name], 5) for name in LAYERS}
    paged.scatter(record, [1, 2], [0, 11])
    for name in LAYERS:
        assert raw_block(caches[name], 0) == raw_block(caches[name], 2)
        assert raw_block(caches[name], 11) == raw_block(caches[name], 9)
        assert raw_block(caches[name], 5) == before[name]  # other blocks untouched


def test_gather_into_an_arena_record_round_trips(daemon):
    """Through a real arena: gather into a record's KV bytes, read them back, scatter."""
    from lmcached.client import CacheEngine

    caches = {name: cpu_layout_cache("cpu") for name in LAYERS}
    paged = PagedBlocks(caches, LAYERS, {})
    blocks_per_chunk = 2
    layout = KVLayout("paged-test", num_layers=len(LAYERS), num_kv_heads=1,
                      head_size=paged.page_bytes // (2 * BLOCK_SIZE), dtype="uint8",
                      chunk_size=BLOCK_SIZE * blocks_per_chunk)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        tokens = torch.arange(layout.chunk_size)
        kv = torch.empty(layout.chunk_shape(layout.chunk_size), dtype=torch.uint8)
        paged.gather([4, 8], kv)
        assert engine.store(tokens, kv) == 1
        got, _ = engine.retrieve(tokens, return_tuple=False)
        paged.scatter(got, [0, 1], [1, 3])
    for name in LAYERS:
        assert raw_block(caches[name], 1) == raw_block(caches[name], 4)
        assert raw_block(caches[name], 3) == raw_block(caches[name], 8)


def test_blocks_that_are_not_dense_slabs_are_refused():
    padded = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE + 8)[..., :2 * HEAD_SIZE]
    with pytest.raises(ValueError, match="not dense slabs"):
        PagedBlocks({"layer.0": padded}, ["layer.0"], {})


def test_a_missing_layer_or_unequal_pages_are_refused():
    with pytest.raises(ValueError, match="layer.1 has no registered KV cache"):
        PagedBlocks({"layer.0": cpu_layout_cache("cpu")}, ["layer.0", "layer.1"], {})
    small = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="-byte pages, others"):
        PagedBlocks({"a": cpu_layout_cache("cpu"), "b": small}, ["a", "b"], {})


def test_the_physical_format_is_part_of_the_description():
    a = PagedBlocks({"l": cpu_layout_cache("cpu")}, ["l"], {"l": "CPU_ATTN"})
    b = PagedBlocks({"l": permuted_layout_cache("cpu")}, ["l"], {"l": "CPU_ATTN"})
    c = PagedBlocks({"l": cpu_layout_cache("cpu")}, ["l"], {"l": "FLASH_ATTN"})
    assert a.page_bytes == b.page_bytes == c.page_bytes
    assert len({a.description, b.description, c.description}) == 3
