"""CacheBlend's SPT retriever against a real daemon (seed: LMCache's tests/test_blend.py).

Segments are stored on their own from position 0, then read back inside a prompt that
joins them with a separator: masks, original positions, and every layer's K and V
compared byte for byte with what was stored; pins held until release; no daemon request
per layer.
"""

import gc
import os
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import start_daemon

from lmcached.client import CacheEngine, KVLayout
from lmcached.client.blend import retriever as retriever_module
from lmcached.client.blend.retriever import SPTBlendRetriever, split_on_spt
from lmcached.client.kv_io import copy_tensor

CHUNK = 16
SPT = 999  # the separator token id the caller inserts
PIN_DEADLINE_S = 10.0


def make_layout(fmt: str = "huggingface") -> KVLayout:
    return KVLayout("tiny-blend", num_layers=3, num_kv_heads=2, head_size=8,
                    dtype="bfloat16", chunk_size=CHUNK, fmt=fmt)


def make_kv(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.chunk_shape(num_tokens), generator=gen).to(layout.torch_dtype)


def segment(first_token: int, num_tokens: int, spt: bool = True) -> torch.Tensor:
    """Distinct token ids, ending with the separator when `spt`."""
    body = torch.arange(first_token, first_token + num_tokens - int(spt))
    return torch.cat([body, torch.tensor([SPT])]) if spt else body


def wait_for_pins(daemon, expected: int) -> int:
    """Pins held by every session, polled until `expected` or a deadline (RELEASE is not
    answered, so the daemon may read it after the next INFO of another connection)."""
    deadline = time.monotonic() + PIN_DEADLINE_S
    pins = daemon.pins_held()
    while pins != expected and time.monotonic() < deadline:
        time.sleep(0.02)
        pins = daemon.pins_held()
    return pins


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory("--capacity", "4MiB")  # blocks sized by the first layout


@pytest.fixture
def engine(daemon):
    eng = CacheEngine.connect(make_layout(), socket=daemon.socket, strict=True)
    yield eng
    eng.close()


def check_layers(task, layout: KVLayout, expected: list[tuple[int, torch.Tensor, int]]) -> None:
    """Every layer's K and V at each (dst_start, stored blob, num_valid) equal the blob's
    first num_valid tokens."""
    axis = layout.token_dim - 2
    for layer in range(layout.num_layers):
        res = task.result(layer)
        assert res.k.dtype == layout.torch_dtype and res.k.device.type == "cpu"
        assert res.k.shape == layout.chunk_shape(len(res.valid_mask))[2:] == res.v.shape
        for start, blob, num_valid in expected:
            for kv, got in ((0, res.k), (1, res.v)):
                want = blob[layer, kv].narrow(axis, 0, num_valid)
                assert torch.equal(got.narrow(axis, start, num_valid), want), (layer, kv, start)


# --------------------------------------------------------------------- splitting
@pytest.mark.parametrize("tokens, spt, expected", [
    ([1, 1, 1, 9, 2, 2, 9, 3, 3, 3, 3], 9, [(0, 4), (4, 7), (7, 11)]),  # LMCache's example
    ([1, 9, 2, 9], 9, [(0, 2), (2, 4)]),  # trailing separator: no empty last segment
    ([1, 2, 3], 9, [(0, 3)]),  # no separator
    ([9, 9], 9, [(0, 1), (1, 2)]),
    ([], 9, []),
    ([1, 8, 9, 2, 8, 9, 3], [8, 9], [(0, 3), (3, 6), (6, 7)]),  # two-token separator
    ([1, 8, 2, 9, 8], [8, 9], [(0, 5)]),  # its tokens apart are no separator
    ([8, 8, 8, 1], [8, 8], [(0, 2), (2, 4)]),  # matched left to right, never overlapping
])
def test_split_on_spt_cases(tokens, spt, expected):
    assert split_on_spt(torch.tensor(tokens, dtype=torch.int64), spt) == expected


@given(tokens=st.lists(st.integers(0, 3), max_size=40),
       spt=st.one_of(st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=3)))
def test_split_on_spt_segments_tile_the_input_and_end_with_the_separator(tokens, spt):
    sep = [spt] if isinstance(spt, int) else spt
    segments = split_on_spt(tokens, spt)
    # in order, without gaps or overlaps, covering every token
    assert [i for start, end in segments for i in range(start, end)] == list(range(len(tokens)))
    for i, (start, end) in enumerate(segments):
        assert end > start
        piece = tokens[start:end]
        ends_with_sep = piece[-len(sep):] == sep and len(piece) >= len(sep)
        assert ends_with_sep or i == len(segments) - 1
        # the first separator in a segment is the one that ends it: none was missed
        first = next((j for j in range(len(piece) - len(sep) + 1)
                      if piece[j : j + len(sep)] == sep), None)
        assert first == (len(piece) - len(sep) if ends_with_sep else None)


def test_bad_separators_and_batches_raise(engine):
    with pytest.raises(ValueError, match="spt is empty"):
        split_on_spt([1, 2], [])
    with pytest.raises(TypeError, match="bool"):
        SPTBlendRetriever(True, engine)
    retriever = SPTBlendRetriever(SPT, engine)
    with pytest.raises(ValueError, match="query_start_loc"):
        retriever.new_request(torch.arange(8), torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="query_start_loc"):
        retriever.new_request(torch.arange(8), torch.tensor([0, 5, 3, 8]))


# ----------------------------------------------------------------- retrieval
def test_segments_are_found_wherever_they_appear_with_their_stored_kv(engine, daemon):
    layout = engine.layout
    seg_a, seg_b, seg_c = segment(0, 40), segment(100, 21), segment(200, 18)
    kv_a, kv_b = make_kv(layout, 40, seed=1), make_kv(layout, 21, seed=2)
    assert engine.store(seg_a, kv_a) == 3 and engine.store(seg_b, kv_b) == 2
    question = torch.arange(300, 305)
    # B before A: each segment is found away from where it was stored
    prompt = torch.cat([seg_b, seg_a, seg_c, question])
    n = len(prompt)
    with SPTBlendRetriever(SPT, engine).new_request(prompt, torch.tensor([0, n])) as task:
        assert task.segments == [(0, 21), (21, 61), (61, 79), (79, n)]
        expected_mask = torch.zeros(n, dtype=torch.bool)
        expected_mask[:61] = True
        assert torch.equal(task.valid_mask, expected_mask)
        expected_pos = torch.zeros(n, dtype=torch.int64)
        expected_pos[:21], expected_pos[21:61] = torch.arange(21), torch.arange(40)
        assert torch.equal(task.original_positions, expected_pos)
        assert task.num_retrieved_tokens == 61
        check_layers(task, layout, [(0, kv_b, 21), (21, kv_a, 40)])
        res = task.result(layout.num_layers - 1)
        assert res.valid_mask is task.valid_mask and res.original_positions.dtype == torch.int64


def test_a_partially_stored_segment_is_valid_on_its_stored_chunks_only(engine):
    layout = engine.layout
    seg_a, kv_a = segment(0, 40), make_kv(engine.layout, 40, seed=3)
    assert engine.store(seg_a[:32], kv_a[:, :, :, :32]) == 2  # 2 of its 3 chunks
    prompt = torch.cat([torch.tensor([5, SPT]), seg_a])
    task = SPTBlendRetriever(SPT, engine).new_request(prompt, torch.tensor([0, 42]))
    assert task.valid_mask.tolist() == [False] * 2 + [True] * 32 + [False] * 8
    assert task.original_positions[2:34].tolist() == list(range(32))
    assert not task.original_positions[34:].any() and not task.original_positions[:2].any()
    check_layers(task, layout, [(2, kv_a, 32)])
    task.release()


def test_all_miss_gives_no_kv_and_an_empty_mask(engine, daemon):
    prompt = torch.cat([segment(0, 20), segment(50, 9, spt=False)])
    with SPTBlendRetriever(SPT, engine).new_request(prompt, torch.tensor([0, 29])) as task:
        for layer in range(engine.layout.num_layers):
            res = task.result(layer)
            assert res.k is None and res.v is None
            assert not res.valid_mask.any() and not res.original_positions.any()
        assert wait_for_pins(daemon, 0) == 0


def test_a_batch_of_two_requests_splits_at_query_start_loc(engine):
    layout = engine.layout
    # No separator in either request: the request boundary alone cuts the batch.
    first, second = torch.arange(0, 20), torch.arange(40, 57)
    kv_1, kv_2 = make_kv(layout, 20, seed=4), make_kv(layout, 17, seed=5)
    engine.store(first, kv_1)
    engine.store(second, kv_2)
    batch = torch.cat([first, second, torch.tensor([SPT])])  # request 2 = second + SPT
    with SPTBlendRetriever(SPT, engine).new_request(batch, torch.tensor([0, 20, 38])) as task:
        assert task.segments == [(0, 20), (20, 38)]
        # request 2's chain has one more token than was stored: its last (partial) chunk misses
        assert task.valid_mask.tolist() == [True] * 20 + [True] * 16 + [False] * 2
        assert task.original_positions.tolist() == list(range(20)) + list(range(16)) + [0, 0]
        check_layers(task, layout, [(0, kv_1, 20), (20, kv_2, 16)])


def test_vllm_format_gathers_on_the_token_axis_0(daemon):
    layout = make_layout("vllm")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as eng:
        seg_a, kv_a = segment(0, 35), make_kv(layout, 35, seed=6)
        eng.store(seg_a, kv_a)
        prompt = torch.cat([segment(500, 7), seg_a, torch.tensor([1, 2])])
        with SPTBlendRetriever(SPT, eng).new_request(prompt, torch.tensor([0, 44])) as task:
            assert task.valid_mask.tolist() == [False] * 7 + [True] * 35 + [False] * 2
            res = task.result(0)
            assert res.k.shape == (44, layout.num_kv_heads, layout.head_size)
            check_layers(task, layout, [(7, kv_a, 35)])


def test_records_spanning_several_blocks_are_read_one_layer_at_a_time(daemon_factory):
    layout = make_layout()
    # A full-chunk record is 3264 bytes: 2 blocks of 2048; layer 1 of a full chunk crosses
    # the block boundary, layers 0 and 2 do not; the 7-token chunk fits in one block.
    small = daemon_factory("--capacity", "1MiB", "--block-size", "2048")
    assert layout.record_bytes(CHUNK) > 2048 > layout.record_bytes(7)
    with CacheEngine.connect(layout, socket=small.socket, strict=True) as eng:
        seg_a, kv_a = segment(0, 39), make_kv(layout, 39, seed=7)
        assert eng.store(seg_a, kv_a) == 3
        prompt = torch.cat([segment(500, 3), seg_a])
        with SPTBlendRetriever(SPT, eng).new_request(prompt, torch.tensor([0, 42])) as task:
            assert task.valid_mask.tolist() == [False] * 3 + [True] * 39
            check_layers(task, layout, [(3, kv_a, 39)])
            assert small.pins_held() == 2 + 2 + 1


def test_no_daemon_means_nothing_retrieved(short_tmp):
    eng = CacheEngine.connect(make_layout(), socket=os.path.join(short_tmp, "nobody.sock"))
    try:
        with SPTBlendRetriever(SPT, eng).new_request(segment(0, 40), [0, 40]) as task:
            res = task.result(0)
            assert res.k is None and not res.valid_mask.any()
    finally:
        eng.close()


def test_a_task_open_across_a_daemon_restart_still_reads_its_kv(unique_name, short_tmp):
    # The engine reconnects and unmaps the old arena; the task's views keep its pages.
    path, args = os.path.join(short_tmp, "r.sock"), ("--capacity", "4MiB")
    first = start_daemon(unique_name, path, os.path.join(short_tmp, "1.log"), *args)
    second = None
    eng = CacheEngine.connect(make_layout(), socket=path, strict=True)
    try:
        seg_a, kv_a = segment(0, 40), make_kv(eng.layout, 40, seed=13)
        eng.store(seg_a, kv_a)
        task = SPTBlendRetriever(SPT, eng).new_request(seg_a, torch.tensor([0, 40]))
        old_arena = eng.link.arena
        first.stop()
        second = start_daemon(unique_name, path, os.path.join(short_tmp, "2.log"), *args)
        deadline = time.monotonic() + PIN_DEADLINE_S
        while eng.link.arena in (old_arena, None) and time.monotonic() < deadline:
            eng.lookup(seg_a)  # notices the restart, reconnects after its backoff
            time.sleep(0.05)
        assert eng.link.arena not in (old_arena, None)
        check_layers(task, eng.layout, [(0, kv_a, 40)])
        task.release()  # its session ended with the old daemon: nothing to send
        assert second.pins_held() == 0
    finally:
        eng.close()
        first.stop()
        if second is not None:
            second.stop()


# ------------------------------------------------------------ pins and copies
def test_blocks_stay_pinned_until_release_and_results_need_them(engine, daemon):
    seg_a, seg_b = segment(0, 40), segment(100, 20)
    engine.store(seg_a, make_kv(engine.layout, 40, seed=8))
    engine.store(seg_b, make_kv(engine.layout, 20, seed=9))
    prompt = torch.cat([seg_a, seg_b])
    task = SPTBlendRetriever(SPT, engine).new_request(prompt, torch.tensor([0, 60]))
    assert daemon.pins_held() == 3 + 2
    task.result(0)
    assert daemon.pins_held() == 5  # reading a layer unpins nothing
    task.release()
    task.release()  # idempotent
    assert wait_for_pins(daemon, 0) == 0
    with pytest.raises(RuntimeError, match="released"):
        task.result(0)
    with SPTBlendRetriever(SPT, engine).new_request(prompt, torch.tensor([0, 60])) as task:
        with pytest.raises(IndexError, match="out of range"):
            task.result(engine.layout.num_layers)
        with pytest.raises(IndexError, match="out of range"):
            task.result(-1)
    assert wait_for_pins(daemon, 0) == 0


def test_a_task_dropped_unreleased_is_released_when_collected(engine, daemon):
    engine.store(segment(0, 40), make_kv(engine.layout, 40, seed=10))
    task = SPTBlendRetriever(SPT, engine).new_request(segment(0, 40), torch.tensor([0, 40]))
    assert daemon.pins_held() == 3
    del task
    gc.collect()
    assert wait_for_pins(daemon, 0) == 0


def test_no_daemon_request_and_no_copy_until_result_then_one_copy_per_chunk(
        engine, daemon, monkeypatch):
    layout = engine.layout
    seg_a, seg_b = segment(0, 40), segment(100, 20)
    engine.store(seg_a, make_kv(layout, 40, seed=11))
    engine.store(seg_b, make_kv(layout, 20, seed=12))
    arena = engine.link.arena
    copies = []

    def spy_copy(dst, src):
        copies.append(src.data_ptr())
        copy_tensor(dst, src)

    monkeypatch.setattr(retriever_module, "copy_tensor", spy_copy)
    prompt = torch.cat([seg_a, seg_b, torch.arange(300, 310)])
    with SPTBlendRetriever(SPT, engine).new_request(prompt, torch.tensor([0, 70])) as task:
        requests_before = daemon.info()["requests"]
        assert copies == []  # new_request pins; it copies nothing
        for layer in range(layout.num_layers):
            task.result(layer)
        requests = daemon.info()["requests"] - requests_before
        assert requests == 1  # the INFO itself: not one request per layer
    # K and V of each of the 5 chunks, once per layer, read in place from the arena
    assert len(copies) == layout.num_layers * 5 * 2
    assert all(arena.base_ptr <= ptr < arena.base_ptr + arena.capacity_bytes for ptr in copies)
