"""CacheEngine semantics against a real daemon (seed: LMCache's LMCacheEngine tests)."""

import os

import numpy as np
import pytest
import torch

from lmcached.client import CacheEngine, CacheEngineBuilder, KVLayout, hash_request_tokens
from lmcached.client.chain import chunks_per_request
from lmcached.client.layout import RECORD_HEADER_BYTES
from lmcached.wire.protocol import MAX_CHUNKS_PER_REQUEST

CHUNK = 16


def make_layout(fmt="vllm", dtype="bfloat16", **kw) -> KVLayout:
    return KVLayout("tiny-llama", num_layers=3, num_kv_heads=2, head_size=8, dtype=dtype,
                    chunk_size=CHUNK, fmt=fmt, **kw)


def make_kv(layout: KVLayout, num_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = layout.chunk_shape(num_tokens)
    return torch.randn(shape, generator=gen).to(layout.torch_dtype)


@pytest.fixture
def engine(daemon):
    eng = CacheEngine.connect(make_layout(), socket=daemon.socket, strict=True)
    yield eng
    eng.close()


@pytest.mark.parametrize("num_tokens, num_chunks", [(32, 2), (40, 3), (5, 1)])
def test_store_writes_full_and_partial_chunks(engine, num_tokens, num_chunks):
    tokens = torch.arange(num_tokens)
    assert engine.store(tokens, make_kv(engine.layout, num_tokens)) == num_chunks
    assert engine.lookup(tokens) == num_tokens
    assert engine.store(tokens, make_kv(engine.layout, num_tokens)) == 0  # all existing


def test_partial_last_chunk_is_keyed_by_its_own_tokens(engine):
    tokens = torch.arange(40)
    kv = make_kv(engine.layout, 40)
    engine.store(tokens, kv)
    longer = torch.cat([tokens, torch.tensor([999] * 5)])
    assert engine.lookup(longer) == 32  # the 8-token partial chunk is not a prefix of 13
    got, ret_mask = engine.retrieve(longer, return_tuple=False)
    assert torch.equal(got, kv[:, :, :32]) and ret_mask.tolist() == [True] * 32 + [False] * 13


def test_store_of_an_extended_prompt_writes_only_new_chunks(engine):
    kv = make_kv(engine.layout, 64)
    tokens = torch.arange(64)
    assert engine.store(tokens[:32], kv[:, :, :32]) == 2
    assert engine.store(tokens, kv) == 2
    got, _ = engine.retrieve(tokens, return_tuple=False)
    assert torch.equal(got, kv)


@pytest.mark.parametrize("fmt", ["vllm", "huggingface"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("return_tuple", [True, False])
def test_formats_round_trip_bit_exactly(daemon, fmt, dtype, return_tuple):
    layout = make_layout(fmt=fmt, dtype=dtype)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as eng:
        kv = make_kv(layout, 50, seed=3)
        tokens = np.arange(100, 150)
        assert eng.store(tokens, kv) == 4
        got, ret_mask = eng.retrieve(tokens, return_tuple=return_tuple)
        assert bool(ret_mask.all())
        if return_tuple:
            assert len(got) == layout.num_layers
            for layer, (k, v) in enumerate(got):
                assert torch.equal(k, kv[layer, 0]) and torch.equal(v, kv[layer, 1])
        else:
            assert got.dtype == layout.torch_dtype and torch.equal(got, kv)


def test_tuple_input_round_trips(engine):
    kv = make_kv(engine.layout, 40, seed=5)
    as_tuple = tuple((kv[i, 0].clone(), kv[i, 1].clone()) for i in range(3))
    tokens = list(range(40))
    assert engine.store(tokens, as_tuple) == 3
    got, _ = engine.retrieve(tokens, return_tuple=False)
    assert torch.equal(got, kv)


def test_dynamic_cache_in_and_out(daemon):
    from transformers import DynamicCache

    layout = make_layout(fmt="huggingface")
    kv = make_kv(layout, 40, seed=9)  # [layers, 2, heads, tokens, head_size]
    cache = DynamicCache()
    for layer in range(layout.num_layers):
        cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as eng:
        assert eng.store(torch.arange(40), cache) == 3
        got, _ = eng.retrieve(torch.arange(40))
    restored = DynamicCache()
    for layer, (k, v) in enumerate(got):
        restored.update(k.unsqueeze(0), v.unsqueeze(0), layer)
    assert restored.get_seq_length() == 40
    for layer in range(layout.num_layers):
        assert torch.equal(restored.layers[layer].keys, cache.layers[layer].keys)
        assert torch.equal(restored.layers[layer].values, cache.layers[layer].values)


def test_dynamic_cache_is_transposed_for_a_vllm_layout(engine):
    from transformers import DynamicCache

    kv = make_kv(engine.layout, 20, seed=2)  # vllm: [layers, 2, tokens, heads, head_size]
    cache = DynamicCache()
    for layer in range(3):
        cache.update(kv[layer, 0].transpose(0, 1).unsqueeze(0),
                     kv[layer, 1].transpose(0, 1).unsqueeze(0), layer)
    engine.store(torch.arange(20), cache)
    got, _ = engine.retrieve(torch.arange(20), return_tuple=False)
    assert torch.equal(got, kv)


def test_suffix_mask_store_and_retrieve(engine):
    tokens = torch.arange(48)
    kv = make_kv(engine.layout, 48)
    mask = torch.ones(48, dtype=torch.bool)
    mask[:16] = False
    # KV of only the masked-in tokens, as the seed passes it.
    assert engine.store(tokens, kv[:, :, 16:], mask=mask) == 2
    assert engine.lookup(tokens) == 0  # chunk 0 was not stored: no cached prefix
    got, ret_mask = engine.retrieve(tokens, mask=mask, return_tuple=False)
    assert torch.equal(got, kv[:, :, 16:])
    assert ret_mask.tolist() == [False] * 16 + [True] * 32
    engine.store(tokens, kv)  # KV for all tokens: fills chunk 0
    assert engine.lookup(tokens) == 48


@pytest.mark.parametrize(
    "mask, message",
    [
        ([True] * 16 + [False] * 16, "suffix mask"),
        ([True] * 31, "shape"),
    ],
)
def test_bad_masks_raise(engine, mask, message):
    with pytest.raises(ValueError, match=message):
        engine.store(torch.arange(32), make_kv(engine.layout, 32), mask=torch.tensor(mask))
    with pytest.raises(ValueError, match=message):
        engine.retrieve(torch.arange(32), mask=torch.tensor(mask))
    with pytest.raises(ValueError, match=message):
        engine.retrieve_views(torch.arange(32), mask=torch.tensor(mask))


def test_store_mask_must_skip_whole_chunks_as_the_seed_asserts(engine, daemon):
    mask = torch.tensor([False] * 8 + [True] * 24)
    with pytest.raises(ValueError, match="not a multiple of chunk_size"):
        engine.store(torch.arange(32), make_kv(engine.layout, 32), mask=mask)
    assert daemon.info()["cached_blocks"] == 0


def suffix_mask(num_tokens: int, skip: int) -> torch.Tensor:
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[:skip] = False
    return mask


@pytest.mark.parametrize("fmt", ["vllm", "huggingface"])
@pytest.mark.parametrize("skip", [1, 20, 31, 47])
def test_retrieve_mask_drops_the_masked_tokens_of_the_first_chunk(daemon, fmt, skip):
    """Seed (LMCacheEngine.retrieve): any suffix mask; the chunks from the one holding
    the first masked-in token are fetched and its masked tokens are dropped."""
    layout = make_layout(fmt=fmt)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as eng:
        tokens, kv = torch.arange(48), make_kv(layout, 48)
        eng.store(tokens, kv)
        expected = kv.narrow(layout.token_dim, skip, 48 - skip)
        mask = suffix_mask(48, skip)
        got, ret_mask = eng.retrieve(tokens, mask=mask, return_tuple=False)
        assert torch.equal(got, expected)
        assert ret_mask.tolist() == [False] * skip + [True] * (48 - skip)
        got, _ = eng.retrieve(tokens, mask=mask)
        assert all(torch.equal(k, expected[i, 0]) and torch.equal(v, expected[i, 1])
                   for i, (k, v) in enumerate(got))
        out_layers = tuple((torch.empty(expected[0, 0].shape, dtype=layout.torch_dtype),
                            torch.empty(expected[0, 1].shape, dtype=layout.torch_dtype))
                           for _ in range(layout.num_layers))
        got, _ = eng.retrieve(tokens, mask=mask, out=out_layers)
        assert all(torch.equal(k, expected[i, 0]) for i, (k, _) in enumerate(got))
        with eng.retrieve_views(tokens, mask=mask) as views:
            assert (views.start_token, views.num_tokens) == (skip, 48 - skip)
            assert sum(c.shape[layout.token_dim] for c in views.chunks) == 48 - skip
            out = torch.empty(layout.chunk_shape(48), dtype=layout.torch_dtype)
            assert torch.equal(views.copy_to(out), expected)
        assert (eng.hit_tokens, eng.miss_tokens) == (4 * (48 - skip), 0)


def test_retrieve_with_a_mask_reads_from_the_chunk_of_the_first_kept_token(engine):
    tokens, kv = torch.arange(48), make_kv(engine.layout, 48)
    engine.store(tokens, kv[:, :, 16:], mask=suffix_mask(48, 16))  # chunk 0 not stored
    assert engine.retrieve(tokens)[0] == ()
    got, ret_mask = engine.retrieve(tokens, mask=suffix_mask(48, 21), return_tuple=False)
    assert torch.equal(got, kv[:, :, 21:]) and int(ret_mask.sum()) == 27
    got, ret_mask = engine.retrieve(tokens, mask=suffix_mask(48, 48), return_tuple=False)
    assert got == () and not ret_mask.any()


@pytest.mark.parametrize("return_tuple", [True, False])
def test_a_miss_returns_an_empty_tuple_whatever_return_tuple_is(engine, return_tuple):
    """Seed (LMCacheEngine.retrieve): "an empty tuple if no kv cache is retrieved (no
    matter return_tuple is True or not)"."""
    kv, ret_mask = engine.retrieve(torch.arange(40), return_tuple=return_tuple)
    assert kv == () and isinstance(kv, tuple) and ret_mask.tolist() == [False] * 40


def test_skip_existing_false_never_rewrites_a_cached_chunk(engine):
    tokens = torch.arange(32)
    kv = make_kv(engine.layout, 32)
    assert engine.store(tokens, kv) == 2
    assert engine.store(tokens, make_kv(engine.layout, 32, seed=9), skip_existing=False) == 0
    got, _ = engine.retrieve(tokens, return_tuple=False)
    assert torch.equal(got, kv)  # content-addressed: the first bytes stay


def test_a_request_is_split_into_requests_of_chunks_per_request(engine, daemon, monkeypatch):
    monkeypatch.setattr("lmcached.client.chain.frames.MAX_CHUNKS_PER_REQUEST", 2)
    sent = []
    request = engine.link.request
    monkeypatch.setattr(engine.link, "request",
                        lambda msg, *a: sent.append(type(msg).__name__) or request(msg, *a))
    tokens, kv = torch.arange(100), make_kv(engine.layout, 100)  # 7 chunks, the last partial
    assert engine.store(tokens[:48], kv[:, :, :48]) == 3
    assert sent == ["Alloc", "Alloc", "Commit", "Commit"]  # no COMMIT before the last ALLOC
    sent.clear()
    assert engine.lookup(tokens) == 48
    assert sent == ["Lookup", "Lookup"]  # the second finds 1 of 2: no third
    sent.clear()
    got, ret_mask = engine.retrieve(tokens, mask=suffix_mask(100, 20), return_tuple=False)
    assert torch.equal(got, kv[:, :, 20:48]) and int(ret_mask.sum()) == 28
    assert sent == ["Acquire", "Acquire", "Release"]  # from chunk 1: [1, 2], then [3, 4] none
    assert engine.store(tokens, kv) == 4
    sent.clear()
    got, _ = engine.retrieve(tokens, return_tuple=False)
    assert torch.equal(got, kv)
    assert sent == ["Acquire"] * 4 + ["Release"]  # one RELEASE frame carries every lease
    with engine.retrieve_views(tokens) as views:
        assert views.num_tokens == 100 and len(views.block_ids) == 7
        assert daemon.info()["pinned_blocks"] == 7
    assert daemon.info()["pinned_blocks"] == 0


@pytest.mark.parametrize("max_chunks, allocs", [(None, 1), (4, 2)],
                         ids=["one-request", "requests-of-4-chunks"])
def test_store_when_full_stores_what_fits_and_stops_at_the_first_refusal(
        daemon_factory, monkeypatch, max_chunks, allocs):
    if max_chunks is not None:
        monkeypatch.setattr("lmcached.client.chain.frames.MAX_CHUNKS_PER_REQUEST", max_chunks)
    layout = make_layout()
    # 15 blocks, all of which this engine, the daemon's only client, may hold.
    daemon = daemon_factory("--capacity", "64KiB", "--block-size", "4KiB",
                            "--max-session-share", "100")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as eng:
        assert eng.store(torch.arange(160), make_kv(layout, 160)) == 10  # 1 or 3 requests
        kv = make_kv(layout, 160, seed=1)
        with eng.retrieve_views(torch.arange(160)) as pinned:  # pins all 10: 5 blocks free
            assert pinned.num_tokens == 160
            sent = spy_requests(monkeypatch, eng.link)
            assert eng.store(torch.arange(500, 660), kv) == 5
        # Requests of 4: the first ALLOC gets 4, the second 1 of 4 (3 refused), and the
        # last 2 chunks are never asked for.
        assert sent.count("Alloc") == allocs
        assert eng.num_nospace_chunks == 5
        assert eng.lookup(torch.arange(500, 660)) == 80
        got, ret_mask = eng.retrieve(torch.arange(500, 660), return_tuple=False)
        assert int(ret_mask.sum()) == 80 and torch.equal(got, kv[:, :, :80])


@pytest.mark.slow
def test_requests_beyond_one_frame_are_split(daemon_factory):
    """More chunks than MAX_CHUNKS_PER_REQUEST (and than one frame carries) still work."""
    layout = KVLayout("one-token-chunks", num_layers=1, num_kv_heads=1, head_size=8,
                      dtype="float16", chunk_size=1)
    num_tokens = MAX_CHUNKS_PER_REQUEST + 4000
    block_bytes = -(-layout.record_bytes(1) // 64) * 64
    assert chunks_per_request(layout, block_bytes) < num_tokens  # split in two
    daemon = daemon_factory("--capacity", str((num_tokens + 64) * block_bytes + (1 << 20)),
                            "--block-size", str(block_bytes), "--max-session-share", "100")
    # A request of ~40k chunks can take the daemon longer than the default data timeout.
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True, data_timeout_s=60) as eng:
        tokens = torch.arange(num_tokens)
        kv = make_kv(layout, num_tokens)
        assert eng.store(tokens, kv) == num_tokens
        assert eng.lookup(tokens) == num_tokens
        got, ret_mask = eng.retrieve(tokens, mask=suffix_mask(num_tokens, 3), return_tuple=False)
        assert torch.equal(got, kv[:, :, 3:]) and int(ret_mask.sum()) == num_tokens - 3
        with eng.retrieve_views(tokens) as views:
            assert views.num_tokens == num_tokens
            assert daemon.info()["pinned_blocks"] == num_tokens
        assert daemon.info()["pinned_blocks"] == 0
        assert eng.num_nospace_chunks == 0 and eng.link.num_reconnects == 0


def test_bad_kv_inputs_raise_and_store_nothing(engine, daemon):
    tokens = torch.arange(32)
    with pytest.raises(ValueError, match=r"does not match the vllm layout"):
        engine.store(tokens, torch.zeros(3, 2, 32, 2, 9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        engine.store(tokens, torch.zeros(3, 2, 32, 2, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match="KV covers 30 tokens"):
        engine.store(tokens, make_kv(engine.layout, 30))
    with pytest.raises(ValueError, match="the layout has 3"):
        engine.store(tokens, [(torch.zeros(32, 2, 8),) * 2])
    with pytest.raises(TypeError, match="integers"):
        engine.store(torch.zeros(32), make_kv(engine.layout, 32))
    with pytest.raises(TypeError, match="kv must be"):
        engine.store(tokens, "kv")
    assert daemon.info()["cached_blocks"] == 0


def test_hit_counters_and_hit_rate(engine):
    tokens = torch.arange(64)
    engine.store(tokens[:32], make_kv(engine.layout, 32))
    engine.retrieve(tokens)  # 32 hit, 32 miss
    engine.retrieve(torch.arange(1000, 1016))  # 16 miss
    assert (engine.hit_tokens, engine.miss_tokens) == (32, 48)
    assert engine.hit_rate == pytest.approx(32 / 80)


def test_retrieve_into_out_buffers_allocates_nothing(engine):
    kv = make_kv(engine.layout, 40)
    engine.store(torch.arange(40), kv)
    out = torch.empty(engine.layout.chunk_shape(64), dtype=torch.bfloat16)
    got, _ = engine.retrieve(torch.arange(40), return_tuple=False, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, kv)
    out_layers = tuple((torch.empty(64, 2, 8, dtype=torch.bfloat16),
                        torch.empty(64, 2, 8, dtype=torch.bfloat16)) for _ in range(3))
    got, _ = engine.retrieve(torch.arange(40), out=out_layers)
    assert got[2][1].data_ptr() == out_layers[2][1].data_ptr()
    assert torch.equal(got[2][1], kv[2, 1])
    with pytest.raises(ValueError, match="holds 16 tokens"):
        engine.retrieve(torch.arange(40), return_tuple=False,
                        out=torch.empty(engine.layout.chunk_shape(16), dtype=torch.bfloat16))


def test_retrieve_views_are_zero_copy_and_pinned_until_exit(engine, daemon):
    kv = make_kv(engine.layout, 40)
    engine.store(torch.arange(40), kv)
    arena = engine.link.arena
    with engine.retrieve_views(torch.arange(40)) as views:
        assert views.num_tokens == 40 and len(views.chunks) == 3
        assert daemon.info()["pinned_blocks"] == 3
        for i, (chunk, block_id) in enumerate(zip(views.chunks, views.block_ids)):
            expected_ptr = (arena.block_view(block_id).data_ptr()
                            + engine.layout.kv_offset)
            assert chunk.data_ptr() == expected_ptr
            assert torch.equal(chunk, kv[:, :, 16 * i : 16 * (i + 1)])
        assert torch.equal(views.layer(1)[0], kv[1, :, :16])
    assert daemon.info()["pinned_blocks"] == 0
    with pytest.raises(RuntimeError, match="released"):
        views.chunks


def test_a_corrupted_record_is_a_counted_miss_never_wrong_kv(engine, daemon):
    tokens = torch.arange(48)
    engine.store(tokens, make_kv(engine.layout, 48))
    with engine.retrieve_views(tokens) as views:
        second_block = views.block_ids[1]
    # Overwrite one token id in the second chunk's record, as a stray writer would.
    arena = engine.link.arena
    token_ids = arena.view(second_block, torch.int64, (CHUNK,), offset_bytes=RECORD_HEADER_BYTES)
    token_ids[3] += 1
    got, ret_mask = engine.retrieve(tokens, return_tuple=False)
    assert got.shape[2] == 16 and int(ret_mask.sum()) == 16
    assert engine.num_verify_failures == 1
    assert daemon.info()["pinned_blocks"] == 0


def test_nonblocking_store_then_flush(engine):
    kv = make_kv(engine.layout, 64)
    assert engine.store(torch.arange(64), kv, blocking=False) == 0
    assert engine.flush() == 4
    assert engine.lookup(torch.arange(64)) == 64


def test_records_spanning_several_blocks(daemon_factory):
    layout = KVLayout("wide", num_layers=4, num_kv_heads=4, head_size=32, chunk_size=64)
    assert layout.record_bytes(64) > 3 * 4096
    daemon = daemon_factory("--capacity", "4MiB", "--block-size", "4KiB")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as eng:
        kv = make_kv(layout, 100)
        assert eng.store(torch.arange(100), kv) == 2
        got, _ = eng.retrieve(torch.arange(100), return_tuple=False)
        assert torch.equal(got, kv)
        with eng.retrieve_views(torch.arange(100)) as views:  # test_spanned_views.py
            assert torch.equal(torch.cat(views.chunks, dim=layout.token_dim), kv)


def test_no_daemon_means_misses_not_exceptions(short_tmp):
    layout = make_layout()
    path = os.path.join(short_tmp, "nobody.sock")
    with pytest.raises(OSError):
        CacheEngine.connect(layout, socket=path, strict=True)
    eng = CacheEngine.connect(layout, socket=path)
    assert eng.store(torch.arange(32), make_kv(layout, 32)) == 0
    assert eng.lookup(torch.arange(32)) == 0
    for return_tuple in (True, False):
        kv, ret_mask = eng.retrieve(torch.arange(32), return_tuple=return_tuple)
        assert kv == () and not ret_mask.any()
    with eng.retrieve_views(torch.arange(32)) as views:
        assert views.num_tokens == 0
    eng.close()


def test_builder_returns_one_engine_per_id_and_refuses_another_layout(daemon):
    try:
        a = CacheEngineBuilder.get_or_create("w0", make_layout(), socket=daemon.socket)
        assert CacheEngineBuilder.get_or_create("w0", make_layout(), socket=daemon.socket) is a
        assert CacheEngineBuilder.get("w0") is a
        with pytest.raises(ValueError, match="exists with layout"):
            CacheEngineBuilder.get_or_create("w0", make_layout(fmt="huggingface"))
    finally:
        CacheEngineBuilder.destroy("w0")
    assert CacheEngineBuilder.get("w0") is None


def test_layout_validation_names_the_field():
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout("m", num_layers=0, num_kv_heads=1, head_size=1)
    with pytest.raises(ValueError, match="worker_id"):
        KVLayout("m", 1, 1, 1, world_size=2, worker_id=2)
    with pytest.raises(ValueError, match="fmt"):
        KVLayout("m", 1, 1, 1, fmt="onnx")
    with pytest.raises(ValueError, match="dtype"):
        KVLayout("m", 1, 1, 1, dtype="int7")
    assert KVLayout("m", 1, 1, 1, dtype=torch.float16).dtype == "float16"


# ------------------------------------------------------------------ protocol v2
def spy_requests(monkeypatch, link) -> list[str]:
    """Names of the requests `link` sends from now on, in order (RELEASE included)."""
    sent = []
    request = link.request
    monkeypatch.setattr(link, "request",
                        lambda msg, *a: sent.append(type(msg).__name__) or request(msg, *a))
    return sent


def test_a_retrieve_waits_for_one_round_trip(engine, daemon, monkeypatch):
    tokens, kv = torch.arange(64), make_kv(engine.layout, 64)
    engine.store(tokens, kv)
    requests_before = daemon.info()["requests"]
    sent = spy_requests(monkeypatch, engine.link)
    got, _ = engine.retrieve(tokens, return_tuple=False)
    assert torch.equal(got, kv)
    # ACQUIRE (answered) and one RELEASE the engine does not wait for
    assert sent == ["Acquire", "Release"]
    info = daemon.info()  # INFO itself is one more request, answered after the RELEASE
    assert info["requests"] - requests_before == 3 and info["pinned_blocks"] == 0


def test_a_pinned_lookup_is_reused_by_the_retrieve_of_the_same_tokens(engine, daemon,
                                                                      monkeypatch):
    tokens, kv = torch.arange(64), make_kv(engine.layout, 64)
    engine.store(tokens[:48], kv[:, :, :48])
    hashed = []
    real_hash = hash_request_tokens
    for module in ("lmcached.client.engine", "lmcached.client.engine_retrieve"):
        monkeypatch.setattr(f"{module}.hash_request_tokens",
                            lambda *a: hashed.append(1) or real_hash(*a))
    sent = spy_requests(monkeypatch, engine.link)
    assert engine.lookup(tokens, pin=True) == 48
    assert daemon.info()["pinned_blocks"] == 3  # held between lookup and retrieve
    got, ret_mask = engine.retrieve(tokens, mask=suffix_mask(64, 20), return_tuple=False)
    assert torch.equal(got, kv[:, :, 20:48]) and int(ret_mask.sum()) == 28
    assert sent == ["Acquire", "Release"] and len(hashed) == 1  # no second hash, no ACQUIRE
    assert daemon.info()["pinned_blocks"] == 0
    # consumed: the next retrieve of the same tokens asks the daemon again
    sent.clear()
    with engine.retrieve_views(tokens) as views:
        assert views.num_tokens == 48
    assert sent == ["Acquire", "Release"]


def test_pinned_lookups_of_other_tokens_or_never_retrieved_are_unpinned(engine, daemon,
                                                                        monkeypatch):
    tokens, kv = torch.arange(64), make_kv(engine.layout, 64)
    engine.store(tokens, kv)
    assert engine.lookup(tokens, pin=True) == 64
    # a retrieve of other tokens does not use (nor release) it
    assert engine.retrieve(tokens[:32], return_tuple=False)[1].sum() == 32
    assert daemon.info()["pinned_blocks"] == 4
    assert engine.lookup_unpin(tokens) == 1 and engine.lookup_unpin(tokens) == 0
    assert daemon.info()["pinned_blocks"] == 0
    # a caller that pins and never retrieves cannot hold the arena: the oldest go
    monkeypatch.setattr("lmcached.client.retrieve.MAX_PINNED_LOOKUPS", 2)
    for _ in range(5):
        engine.lookup(tokens, pin=True)
    assert daemon.pins_held() == 2 * 4  # two leases on the same 4 blocks
    engine.close()
    assert daemon.pins_held() == 0 and daemon.info()["pinned_blocks"] == 0


def test_a_refused_request_releases_the_leases_of_its_call(engine, daemon, monkeypatch):
    tokens, kv = torch.arange(64), make_kv(engine.layout, 64)
    engine.store(tokens, kv)
    monkeypatch.setattr("lmcached.client.chain.frames.MAX_CHUNKS_PER_REQUEST", 2)
    real_request = engine.link.request
    calls = []

    def refuse_the_second_acquire(msg, *args):
        calls.append(type(msg).__name__)
        if calls.count("Acquire") == 2 and type(msg).__name__ == "Acquire":
            msg = type(msg)([999], msg.hashes)  # a namespace not ours: refused
        return real_request(msg, *args)

    monkeypatch.setattr(engine.link, "request", refuse_the_second_acquire)
    kv_got, ret_mask = engine.retrieve(tokens)
    assert kv_got == () and not ret_mask.any()  # a refusal is a miss
    assert calls == ["Acquire", "Acquire", "Release"]  # the first ACQUIRE's lease released
    assert daemon.info()["pinned_blocks"] == 0
