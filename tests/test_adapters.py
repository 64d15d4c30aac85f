"""Seed adapters over the daemon: StorageBackend, KVStoreBuffer, KVLookupBuffer."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from lmcached.client.backend import CacheEngineKey, DaemonBackend, StorageBackend
from lmcached.client.buffers import KVLookupBuffer, KVStoreBuffer


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
def test_daemon_backend_put_get_contains(daemon, tensor):
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
    backend.flush()
    got = backend.batched_get([key(i) for i in range(6)])
    assert [torch.equal(g, c) for g, c in zip(got[:5], chunks)] == [True] * 5
    assert got[5] is None
    backend.close()


def test_kv_store_buffer_shared_between_processes(daemon):
    producer = textwrap.dedent(
        f"""
        import torch
        from lmcached.client.buffers import KVStoreBuffer
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
from lmcached.client.buffers import KVLookupBuffer
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
