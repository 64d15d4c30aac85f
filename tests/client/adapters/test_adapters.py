"""Seed adapters over the daemon: StorageBackend, KVStoreBuffer, KVLookupBuffer."""

import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from lmcached.client.adapters.backend import CacheEngineKey, DaemonBackend, StorageBackend
from lmcached.client.adapters.buffers import (
    KVCacheBufferBase,
    KVLookupBuffer,
    KVLookupBufferBase,
    KVStoreBuffer,
    KVStoreBufferBase,
)


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("vllm", "tiny-llama", 1, 0, f"{i:032x}")


def test_cache_engine_key_round_trips_as_string():
    k = CacheEngineKey("huggingface", "m", 4, 3, "ab12")
    assert k.to_string() == "huggingface@m@4@3@ab12"
    assert CacheEngineKey.from_string(k.to_string()) == k
    with pytest.raises(ValueError, match="fmt@model"):
        CacheEngineKey.from_string("a@b")


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(2, 2, 16, 4, 8).to(torch.bfloat16),
        torch.arange(10, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.zeros(0, 3),
        torch.tensor(3.5, dtype=torch.float64),
    ],
    ids=["bf16-kv", "int64", "bool", "empty", "scalar"],
)
def test_daemon_backend_put_get_contains(daemon, tensor, monkeypatch):
    # Round trips, not latency: a loaded CI machine may stall the daemon past the 200 ms
    # serving-path timeout, which would turn a put into a counted drop.
    monkeypatch.setenv("LMCACHED_DATA_TIMEOUT_MS", "10000")
    backend = DaemonBackend(socket=daemon.socket)
    assert isinstance(backend, StorageBackend)
    assert not backend.contains(key(1)) and backend.get(key(1)) is None
    backend.put(key(1), tensor)
    assert backend.contains(key(1))
    got = backend.get(key(1))
    assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)
    backend.close()


def test_daemon_backend_batched_and_background_puts_across_blocks(daemon_factory):
    daemon = daemon_factory("--capacity", "8MiB", "--block-size", "4KiB")
    backend = DaemonBackend(socket=daemon.socket, value_bytes_hint=4096)
    chunks = [torch.full((3000,), i, dtype=torch.int32) for i in range(5)]  # 12 KB: 4 blocks
    assert backend.batched_put([(key(i), c) for i, c in enumerate(chunks)], blocking=False) == 5
    assert backend.flush() == 5
    got = list(backend.batched_get([key(i) for i in range(6)]))
    assert [torch.equal(g, c) for g, c in zip(got[:5], chunks)] == [True] * 5
    assert got[5] is None
    backend.close()


def test_batched_get_is_lazy_as_the_seeds_generator(daemon):
    """Seed (LMCBackendInterface.batched_get): a generator, so the engine's prefix
    retrieve, which stops at the first None, reads no key after it."""
    backend = DaemonBackend(socket=daemon.socket)
    backend.put(key(0), torch.ones(4))
    asked = []

    def keys():
        for i in range(3):
            asked.append(i)
            yield key(i)

    chunks = backend.batched_get(keys())
    assert asked == []
    assert torch.equal(next(chunks), torch.ones(4)) and asked == [0]
    assert next(chunks) is None and asked == [0, 1]
    backend.close()


def test_puts_report_chunks_dropped_for_lack_of_space(daemon_factory):
    """Seed: a chunk that does not fit is dropped, not an error; batched_put returns
    "the number of chunks stored"."""
    daemon = daemon_factory("--capacity", "64KiB", "--block-size", "4KiB")  # 15 blocks
    backend = DaemonBackend(socket=daemon.socket, value_bytes_hint=4096)
    small, huge = torch.zeros(1000, dtype=torch.int32), torch.zeros(1 << 16, dtype=torch.int32)
    assert backend.put(key(0), small) is True
    assert backend.put(key(1), huge) is False  # 256 KiB > the arena
    assert backend.batched_put([(key(2), small), (key(3), huge), (key(4), small)]) == 2
    assert backend.put(key(5), huge, blocking=False) is True  # queued
    assert backend.flush() == 0
    assert backend.num_dropped == 3
    assert [backend.contains(key(i)) for i in range(6)] == [True, False, True, False, True, False]
    backend.close()


def test_a_size_hint_larger_than_the_arena_degrades_to_no_hint(daemon_factory, caplog):
    daemon = daemon_factory("--capacity", "4MiB")
    with caplog.at_level(logging.WARNING):
        backend = DaemonBackend(socket=daemon.socket, value_bytes_hint=64 << 20)
    assert "cannot hold" in caplog.text
    assert backend.put(key(1), torch.arange(10))
    assert torch.equal(backend.get(key(1)), torch.arange(10))
    other = DaemonBackend(socket=daemon.socket, value_bytes_hint=0)  # the same namespace
    assert torch.equal(other.get(key(1)), torch.arange(10))
    other.close()
    backend.close()


# Seed: vLLM's kv_lookup_buffer/base.py. The abstract methods each base declares there.
SEED_ABSTRACT_METHODS = {
    KVCacheBufferBase: ("close",),
    KVLookupBufferBase: ("insert", "drop_select", "close"),
    KVStoreBufferBase: ("put", "get", "close"),
}


def buffer_with(base: type, methods) -> type:
    """A subclass of `base` that implements exactly `methods` (each does nothing)."""
    return type("Partial", (base,), {name: lambda self, *args: None for name in methods})


@pytest.mark.parametrize(
    ("base", "missing"),
    [(base, name) for base, names in SEED_ABSTRACT_METHODS.items() for name in names],
    ids=lambda v: v.__name__ if isinstance(v, type) else v,
)
def test_a_buffer_without_one_method_of_the_seeds_base_cannot_be_made(base, missing):
    # e.g. [KVStoreBufferBase-get]: a store buffer with put and close but no get.
    others = [name for name in SEED_ABSTRACT_METHODS[base] if name != missing]
    with pytest.raises(TypeError, match=rf"abstract method.*\b{missing}\b"):
        buffer_with(base, others)()
    buffer_with(base, SEED_ABSTRACT_METHODS[base])()  # all of them: nothing else is required


def test_our_buffers_are_instances_of_the_seeds_bases(daemon):
    store = KVStoreBuffer(socket=daemon.socket)
    lookup = KVLookupBuffer(socket=daemon.socket)
    try:
        assert isinstance(store, KVStoreBufferBase) and isinstance(store, KVCacheBufferBase)
        assert isinstance(lookup, KVLookupBufferBase) and isinstance(lookup, KVCacheBufferBase)
    finally:
        store.close()
        lookup.close()


def test_kv_store_buffer_shared_between_processes(daemon):
    producer = textwrap.dedent(
        f"""
        import torch
        from lmcached.client.adapters.buffers import KVStoreBuffer
        buf = KVStoreBuffer(socket={daemon.socket!r})
        buf.put("layer0", torch.arange(12, dtype=torch.float16).reshape(3, 4))
        buf.put("gone", torch.ones(2))
        buf.put("gone", None)
        buf.close()
        """
    )
    subprocess.run([sys.executable, "-c", producer], check=True, timeout=120)
    buf = KVStoreBuffer(socket=daemon.socket)
    assert torch.equal(buf.get("layer0"), torch.arange(12, dtype=torch.float16).reshape(3, 4))
    assert buf.get("gone") is None
    buf.close()


def test_lookup_buffer_matches_by_tokens_and_removes_the_entry(daemon):
    buf = KVLookupBuffer(socket=daemon.socket)
    tokens = torch.arange(20)
    roi = torch.ones(20, dtype=torch.bool)
    kv_key, kv_value, hidden = torch.randn(2, 20, 4), torch.randn(2, 20, 4), torch.randn(20, 8)
    assert buf.insert(tokens, roi, kv_key, kv_value, hidden)
    assert buf.drop_select(torch.arange(1, 21), roi) == [None] * 5  # other tokens
    got = buf.drop_select(tokens, roi)
    for a, b in zip(got, [tokens, roi, kv_key, kv_value, hidden]):
        assert torch.equal(a, b)
    assert buf.drop_select(tokens, roi) == [None] * 5  # dropped
    buf.close()


def test_lookup_buffer_drop_select_none_pops_any_entry(daemon):
    buf = KVLookupBuffer(socket=daemon.socket)
    buf.insert(torch.arange(4), None, torch.ones(1), torch.ones(1), None)
    got = buf.drop_select(None, None)
    assert torch.equal(got[0], torch.arange(4)) and got[1] is None and got[4] is None
    assert buf.drop_select(None, None) == [None] * 5
    buf.close()


CONSUMER = """
import json, sys, time
import torch
from lmcached.client.adapters.buffers import KVLookupBuffer
buf = KVLookupBuffer(socket=sys.argv[1])
got, deadline = [], time.monotonic() + 30
while time.monotonic() < deadline:
    entry = buf.drop_select(None, None)
    if entry[0] is None:
        if len(got) and time.monotonic() > deadline - 28:
            break
        time.sleep(0.01)
        continue
    got.append(int(entry[3].item()))
print(json.dumps(got))
"""


@pytest.mark.slow
def test_two_consumers_never_receive_the_same_entry(daemon_factory):
    daemon = daemon_factory("--capacity", "16MiB", "--block-size", "4KiB")  # no eviction
    buf = KVLookupBuffer(socket=daemon.socket)
    for i in range(40):
        assert buf.insert(torch.arange(8) + 100 * i, None, None, torch.tensor(i), None)
    consumers = [subprocess.Popen([sys.executable, "-c", CONSUMER, daemon.socket],
                                  stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for proc in consumers:
        out, _ = proc.communicate(timeout=120)
        results.extend(json.loads(out))
    assert sorted(results) == list(range(40))  # every entry exactly once
    buf.close()


def test_a_put_whose_copy_fails_is_aborted_and_a_get_leaves_no_pin(daemon, monkeypatch):
    from lmcached.client.adapters import tensor_store
    from lmcached.client.adapters.tensor_store import TensorStore, kv_namespace

    store = TensorStore(kv_namespace("abort-test", 4096), socket=daemon.socket)
    try:
        assert store.put("kept", torch.arange(10))

        def failing_scatter(*args):
            raise OSError("copy failed half-way")

        monkeypatch.setattr(tensor_store, "scatter", failing_scatter)
        with pytest.raises(OSError, match="half-way"):
            store.put("torn", torch.arange(10))
        info = daemon.info()
        assert info["writing_blocks"] == 0  # ABORTed at once, not at the session's end
        monkeypatch.undo()
        assert store.get("torn") is None and torch.equal(store.get("kept"), torch.arange(10))
        assert store.contains("kept") and daemon.pins_held() == 0
    finally:
        store.close()


def test_stores_of_one_name_share_keys_whatever_their_size_hint(daemon):
    from lmcached.client.adapters.tensor_store import TensorStore, kv_namespace

    hinted = TensorStore(kv_namespace("shared", 1 << 16), socket=daemon.socket)
    plain = TensorStore(kv_namespace("shared", 0), socket=daemon.socket)
    other = TensorStore(kv_namespace("another", 1 << 16), socket=daemon.socket)
    try:
        assert hinted.put("k", torch.arange(4))
        assert torch.equal(plain.get("k"), torch.arange(4))  # the hint only sizes blocks
        assert other.get("k") is None  # another name never meets it
    finally:
        for store in (hinted, plain, other):
            store.close()
