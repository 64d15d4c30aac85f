"""Cache salts through the engine: a tenant's chunks are found under its salt only
(client/hashing.py `root_hash`; docs/architecture.md, "Keys and hashing"), and INFO
counts salted hits and misses apart, per tenant fingerprint (INFO `tenants`, the
metrics' `tenant` label)."""

import socket
import time
import urllib.request

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lmcached.client import CacheEngine, KVLayout, hash_request_tokens
from lmcached.client.hashing import root_hash, tenant_fingerprint
from lmcached.daemon.metrics import SNAPSHOT_MAX_AGE_S
from lmcached.wire.connection import DaemonError
from lmcached.wire.protocol import Acquire, Lookup

CHUNK = 16


def make_layout() -> KVLayout:
    return KVLayout("salt-llama", num_layers=2, num_kv_heads=2, head_size=8,
                    dtype="bfloat16", chunk_size=CHUNK)


def make_kv(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.chunk_shape(num_tokens), generator=gen).to(layout.torch_dtype)


@pytest.fixture
def engines(daemon):
    """Two engines (two sessions) on one daemon: a writer and a reader."""
    writer = CacheEngine.connect(make_layout(), socket=daemon.socket, strict=True)
    reader = CacheEngine.connect(make_layout(), socket=daemon.socket, strict=True)
    yield writer, reader
    writer.close()
    reader.close()


def test_same_salt_hits_another_salt_and_no_salt_miss(engines, daemon):
    writer, reader = engines
    tokens = np.arange(40)
    kv_a = make_kv(writer.layout, 40, seed=1)
    assert writer.store(tokens, kv_a, cache_salt="tenant-a") == 3
    got, mask = reader.retrieve(tokens, return_tuple=False, cache_salt="tenant-a")
    assert bool(mask.all()) and torch.equal(got, kv_a)
    assert reader.lookup(tokens, cache_salt="tenant-a") == 40
    assert reader.lookup(tokens, cache_salt="tenant-b") == 0
    assert reader.lookup(tokens) == 0
    got, mask = reader.retrieve(tokens, cache_salt="tenant-b")
    assert got == () and not bool(mask.any())
    got, mask = reader.retrieve(tokens)
    assert got == () and not bool(mask.any())
    # An unsalted store of the same prompt is a second entry, found by no salt.
    kv_plain = make_kv(writer.layout, 40, seed=2)
    assert writer.store(tokens, kv_plain) == 3
    got, _ = reader.retrieve(tokens, return_tuple=False)
    assert torch.equal(got, kv_plain)
    got, _ = reader.retrieve(tokens, return_tuple=False, cache_salt="tenant-a")
    assert torch.equal(got, kv_a)
    fields = daemon.info()
    # salted ACQUIREs: tenant-a (3 hits), tenant-b (3 misses), tenant-a again (3 hits);
    # the unsalted ones (3 misses, 3 hits) count in hits / misses only.
    assert (fields["salted_hits"], fields["salted_misses"]) == (6, 3)
    assert (fields["hits"], fields["misses"]) == (9, 6)
    assert daemon.pins_held() == 0


def test_a_pinned_lookup_serves_only_its_own_salt(engines):
    writer, reader = engines
    tokens = np.arange(32)
    kv_a, kv_b = make_kv(writer.layout, 32, seed=3), make_kv(writer.layout, 32, seed=4)
    writer.store(tokens, kv_a, cache_salt="a")
    writer.store(tokens, kv_b, cache_salt="b")
    assert reader.lookup(tokens, pin=True, cache_salt="a") == 32
    got, _ = reader.retrieve(tokens, return_tuple=False, cache_salt="b")
    assert torch.equal(got, kv_b)  # not the run pinned for salt "a"
    got, _ = reader.retrieve(tokens, return_tuple=False, cache_salt="a")
    assert torch.equal(got, kv_a)
    assert reader.lookup(tokens, pin=True, cache_salt="a") == 32
    assert reader.lookup_unpin(tokens) == 0  # the unsalted lookup pinned nothing
    assert reader.lookup_unpin(tokens, cache_salt="a") == 1


def test_views_of_a_salted_prefix_read_its_bytes(engines):
    writer, reader = engines
    tokens = np.arange(48)
    kv = make_kv(writer.layout, 48, seed=5)
    writer.store(tokens, kv, cache_salt="tenant-a")
    with reader.retrieve_views(tokens, cache_salt="tenant-a") as views:
        assert views.num_tokens == 48
        assert torch.equal(torch.cat(views.chunks, dim=writer.layout.token_dim), kv)
    with reader.retrieve_views(tokens, cache_salt="tenant-c") as views:
        assert views.num_tokens == 0


@pytest.mark.parametrize("salt, error", [("", ValueError), (b"a", TypeError)])
def test_a_bad_salt_is_refused_before_anything_is_stored(engines, daemon, salt, error):
    writer, _ = engines
    with pytest.raises(error):
        writer.store(np.arange(16), make_kv(writer.layout, 16, seed=6), cache_salt=salt)
    assert daemon.info()["stores"] == 0


@pytest.mark.parametrize("request_type", [Lookup, Acquire])
def test_a_parent_hash_of_the_wrong_size_is_refused_and_the_daemon_goes_on(engines, daemon,
                                                                           request_type):
    writer, reader = engines
    link = reader.link
    hashes = b"".join(hash_request_tokens(CHUNK, np.arange(32)))
    with pytest.raises(DaemonError) as refused:
        link.request(request_type(link.hello_reply.namespaces, hashes, b"x" * 5),
                     link.hello_reply.generation)
    assert refused.value.code == "bad_request" and "parent is 5 bytes" in str(refused.value)
    assert writer.store(np.arange(32), make_kv(writer.layout, 32, seed=7)) == 2
    assert daemon.info()["errors_bad_request"] == 1


def scrape_tenants(port: int) -> dict[tuple[str, str], float]:
    """{(lmcached_tenant_* sample name, tenant label): value} of a fresh scrape."""
    time.sleep(SNAPSHOT_MAX_AGE_S)  # past the snapshot a scrape may reuse
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {(sample.name, sample.labels["tenant"]): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("lmcached_tenant_")}


def test_info_and_metrics_count_two_salts_and_unsalted_per_tenant(daemon_factory):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = daemon_factory("--capacity", "64MiB", "--block-size", "1MiB",
                            "--metrics-port", str(port))
    writer = CacheEngine.connect(make_layout(), socket=daemon.socket, strict=True)
    reader = CacheEngine.connect(make_layout(), socket=daemon.socket, strict=True)
    try:
        tokens = np.arange(48)  # 3 chunks
        writer.store(tokens, make_kv(writer.layout, 48, seed=8), cache_salt="tenant-a")
        writer.store(tokens[:16], make_kv(writer.layout, 16, seed=9))
        assert reader.retrieve(tokens, cache_salt="tenant-a")[1].all()  # 3 hits
        assert not reader.retrieve(tokens, cache_salt="tenant-b")[1].any()  # 3 misses
        assert reader.lookup(tokens, cache_salt="tenant-b") == 0  # 1 LOOKUP
        assert reader.lookup(tokens[32:], cache_salt="tenant-a") == 0  # another chain
        assert reader.retrieve(tokens)[1].sum() == 16  # unsalted: 1 hit, 2 misses
        fields = daemon.info()
    finally:
        writer.close()
        reader.close()
    a, b = (tenant_fingerprint(salt) for salt in ("tenant-a", "tenant-b"))
    assert a == root_hash("tenant-a")[:8] and len({a, b}) == 2
    per_tenant = {name: (fields[f"tenant_{name}_hits"], fields[f"tenant_{name}_misses"],
                         fields[f"tenant_{name}_lookups"])
                  for name in ("unsalted", "other", a.hex(), b.hex())}
    assert per_tenant == {"unsalted": (1, 2, 0), "other": (0, 0, 0), a.hex(): (3, 0, 1),
                          b.hex(): (0, 3, 1)}
    assert fields["tenants_tracked"] == 2
    assert (fields["salted_hits"], fields["salted_misses"]) == (3, 3)
    assert not any("tenant-a" in name or "tenant-b" in name for name in fields)
    samples = scrape_tenants(port)
    for name, (hits, misses, lookups) in per_tenant.items():
        assert samples[("lmcached_tenant_hit_chunks_total", name)] == hits
        assert samples[("lmcached_tenant_miss_chunks_total", name)] == misses
        assert samples[("lmcached_tenant_lookups_total", name)] == lookups
    assert len(samples) == 3 * 4
    assert daemon.pins_held() == 0
