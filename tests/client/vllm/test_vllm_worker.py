"""The vLLM connector's worker side without vLLM: paged KV caches in the layouts vLLM's
backends register, copied block by block into arena records and back (PagedBlocks), and
LMCachedConnectorWorker's save -> load round trip through a real daemon; its saves behave
as the engine's (client/chain/): a split save never evicts its own beginning, and
verify="checksum" seals every record and checks it on load.

Runs everywhere on CPU; the CUDA cases run where a device is present (`pytest -m cuda`).
"""

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from lmcached.client.daemon_link import DaemonLink
from lmcached.client.hashing import hash_request_tokens
from lmcached.client.layout import KVLayout
from lmcached.client.serving.specs import ConnectorSettings, LoadSpec, SaveSpec
from lmcached.client.vllm.worker import LMCachedConnectorWorker, PagedBlocks
from lmcached.wire.protocol import Acquire, Lookup
from lmcached.wire.record_format import RECORD_HEADER_BYTES

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


# ------------------------------------------------------------ LMCachedConnectorWorker
CHUNK = 2 * BLOCK_SIZE  # 2 vLLM blocks per chunk


def worker_settings(socket: str, page_bytes: int) -> ConnectorSettings:
    layout = KVLayout("worker-test", num_layers=len(LAYERS), num_kv_heads=1,
                      head_size=page_bytes // (2 * BLOCK_SIZE), dtype="uint8",
                      chunk_size=CHUNK, fmt="vllm")
    return ConnectorSettings(layouts=[layout], chunk_size=CHUNK, block_size=BLOCK_SIZE,
                             world_size=1, socket=socket, daemon_name="unused", timeout_s=5.0)


def registered_worker(settings: ConnectorSettings, caches: dict) -> LMCachedConnectorWorker:
    worker = LMCachedConnectorWorker(settings, rank=0)
    worker.register(caches, LAYERS, {}, page_bytes_of(caches[LAYERS[0]]))
    return worker


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arena_block", ["1MiB", "8KiB"], ids=["record-in-one-block",
                                                               "record-over-blocks"])
def test_a_saved_prompt_loads_into_another_workers_blocks(daemon_factory, device, arena_block):
    daemon = daemon_factory("--capacity", "64MiB", "--block-size", arena_block)
    caches_a = {name: cpu_layout_cache(device) for name in LAYERS}
    caches_b = {name: torch.zeros_like(caches_a[name]) for name in LAYERS}
    settings = worker_settings(daemon.socket, page_bytes_of(caches_a[LAYERS[0]]))
    tokens = np.arange(100, 100 + 2 * CHUNK, dtype=np.int64)
    hashes = hash_request_tokens(CHUNK, tokens)
    first, second = registered_worker(settings, caches_a), registered_worker(settings, caches_b)
    pins = DaemonLink(daemon.socket, layouts=[settings.layouts[0].to_wire()])
    try:
        first.save([SaveSpec("a", 0, tokens, hashes, block_ids=[3, 5, 7, 9])])
        assert first.num_saved_chunks == 2 and daemon.info()["stores"] == 2
        # the scheduler's part: pin both chunks, plan a load into blocks 1, 2 and 4, 6
        acquired = pins.request(Acquire(pins.ensure_connected().namespaces, b"".join(hashes)))
        spans = acquired.spans()
        generation = pins.hello_reply.generation

        def plan(req_tokens):
            return LoadSpec("b", 0, 0, req_tokens, hashes, [spans], [generation],
                            [[0, 1], [0, 1]], [[1, 2], [4, 6]])

        second.load([plan(tokens)])
        assert second.take_load_errors() == set() and second.num_loaded_tokens == 2 * CHUNK
        for name in LAYERS:
            for dst, src in ((1, 3), (2, 5), (4, 7), (6, 9)):
                assert raw_block(caches_b[name], dst) == raw_block(caches_a[name], src)
        # a record whose token ids differ from the request's is never loaded
        second.load([plan(tokens + 1)])
        assert second.take_load_errors() == {1, 2, 4, 6} and second.num_load_errors == 2
        assert second.take_failed_chunks() == {"b": 0}
        pins.release([acquired.lease], pins.hello_reply.session_id)
        assert daemon.info()["pinned_blocks"] == 0
    finally:
        pins.close()
        first.shutdown()
        second.shutdown()


def test_a_worker_without_a_daemon_saves_nothing_and_fails_its_loads(short_tmp):
    caches = {name: cpu_layout_cache("cpu") for name in LAYERS}
    settings = worker_settings(f"{short_tmp}/nobody.sock", page_bytes_of(caches[LAYERS[0]]))
    worker = registered_worker(settings, caches)
    tokens = np.arange(CHUNK, dtype=np.int64)
    hashes = hash_request_tokens(CHUNK, tokens)
    worker.save([SaveSpec("a", 0, tokens, hashes, block_ids=[0, 1])])
    worker.load([LoadSpec("a", 0, 0, tokens, hashes, [[[0]]], [1], [[0, 1]], [[2, 3]])])
    assert worker.num_saved_chunks == 0
    assert worker.take_load_errors() == {2, 3}  # vLLM recomputes them
    worker.shutdown()


@contextlib.contextmanager
def a_saved_prompt_pinned(socket: str, verify: str = "tokens"):
    """Worker A saves a 2-chunk prompt from its vLLM blocks 3, 5, 7, 9; a scheduler's
    session pins both chunks and plans their load into worker B's blocks 1, 2 and 4, 6.

    Yields:
        (worker B, the LoadSpec, the pinned spans, the pinning link, the settings).
    """
    caches_a = {name: cpu_layout_cache("cpu") for name in LAYERS}
    caches_b = {name: torch.zeros_like(caches_a[name]) for name in LAYERS}
    settings = dataclasses.replace(
        worker_settings(socket, page_bytes_of(caches_a[LAYERS[0]])), verify=verify)
    tokens = np.arange(100, 100 + 2 * CHUNK, dtype=np.int64)
    hashes = hash_request_tokens(CHUNK, tokens)
    first, second = registered_worker(settings, caches_a), registered_worker(settings, caches_b)
    pins = DaemonLink(socket, layouts=[settings.layouts[0].to_wire()])
    try:
        first.save([SaveSpec("a", 0, tokens, hashes, block_ids=[3, 5, 7, 9])])
        acquired = pins.request(Acquire(pins.ensure_connected().namespaces, b"".join(hashes)))
        spans = acquired.spans()
        load = LoadSpec("b", 0, 0, tokens, hashes, [spans], [pins.hello_reply.generation],
                        [[0, 1], [0, 1]], [[1, 2], [4, 6]])
        yield second, load, spans, pins, settings
        pins.release([acquired.lease], pins.hello_reply.session_id)
    finally:
        pins.close()
        first.shutdown()
        second.shutdown()


def test_a_record_rewritten_while_it_is_loaded_becomes_a_load_error(daemon_factory):
    # The scheduler's pins were lost while this worker copied (its session ended): the
    # daemon gave the block to a writer, which wrote its own record's header first. The
    # check after the copies turns the chunk, and the rest of its request, into load
    # errors, so vLLM recomputes blocks that may hold another prompt's KV.
    daemon = daemon_factory("--capacity", "64MiB", "--block-size", "1MiB")
    with a_saved_prompt_pinned(daemon.socket) as (second, load, spans, _, _):
        scatter = second._mover.scatter

        def scatter_then_a_writer_takes_the_first_block(*args):
            scatter(*args)
            records = second.chain.records(second._link.snapshot())
            header = records._u8[records.arena.block_offset(spans[0][0]):]
            header[RECORD_HEADER_BYTES : RECORD_HEADER_BYTES + 8] = 0xFF  # another token

        second._mover.scatter = scatter_then_a_writer_takes_the_first_block
        second.load([load])
        assert second.take_load_errors() == {1, 2, 4, 6}
        assert second.take_failed_chunks() == {"b": 0} and second.num_recheck_failures == 1


def test_a_save_split_over_several_requests_never_evicts_its_own_beginning(daemon_factory,
                                                                           monkeypatch):
    # Requests of 2 chunks, and a save of 2 chunks more than the arena has blocks.
    # Committed request by request, the save's last requests would evict its first ones
    # (then the least recently used), leaving a chain whose first chunk is gone: nothing
    # of it could ever be loaded. Kept WRITING until the whole save is filled, it keeps
    # its beginning, and the chunks that do not fit are NOSPACE.
    monkeypatch.setattr("lmcached.client.chain.frames.MAX_CHUNKS_PER_REQUEST", 2)
    daemon = daemon_factory("--capacity", "256KiB", "--block-size", "32KiB",
                            "--max-session-share", "100")
    caches = {name: cpu_layout_cache("cpu") for name in LAYERS}
    settings = worker_settings(daemon.socket, page_bytes_of(caches[LAYERS[0]]))
    assert settings.layouts[0].record_bytes(CHUNK) <= 32 * 1024  # one block a chunk
    worker = registered_worker(settings, caches)
    reader = DaemonLink(daemon.socket, layouts=[settings.layouts[0].to_wire()])
    try:
        num_blocks = worker._link.hello_reply.num_blocks
        num_chunks = num_blocks + 2
        tokens = np.arange(500, 500 + num_chunks * CHUNK, dtype=np.int64)
        hashes = hash_request_tokens(CHUNK, tokens)
        vllm_blocks = [i % NUM_BLOCKS for i in range(num_chunks * 2)]
        worker.save([SaveSpec("a", 0, tokens, hashes, vllm_blocks)])
        namespaces = reader.ensure_connected().namespaces
        num_cached = reader.request(Lookup(namespaces, b"".join(hashes))).num_chunks
        assert num_cached == num_blocks  # the chain from its first chunk
        assert worker.num_saved_chunks == num_blocks  # and what was counted saved is it
        assert daemon.info()["writing_blocks"] == 0
    finally:
        reader.close()
        worker.shutdown()


def test_with_verify_checksum_saves_are_sealed_and_a_changed_record_fails_its_load(
        daemon_factory):
    daemon = daemon_factory("--capacity", "64MiB", "--block-size", "1MiB")
    with a_saved_prompt_pinned(daemon.socket, "checksum") as (second, load, spans, pins,
                                                             settings):
        records = second.chain.records(second._link.snapshot())
        assert [records.checksum_ok(span, CHUNK) for span in spans] == [True, True]
        second.load([load])
        assert second.take_load_errors() == set() and second.num_loaded_tokens == 2 * CHUNK
        # One KV byte of the second record changes after its COMMIT: header and token ids
        # still match, the checksum does not.
        arena = pins.arena
        kv_byte = arena.block_offset(spans[1][0]) + settings.layouts[0].kv_offset + 5
        arena.numpy_view(kv_byte, 1)[0] ^= 0xFF
        second.load([load])
        assert second.take_load_errors() == {4, 6} and second.take_failed_chunks() == {"b": 1}
        assert second.chain.num_checksum_failures == 1 and second.num_load_errors == 1
