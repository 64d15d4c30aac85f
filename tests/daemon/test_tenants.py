"""Hits, misses and LOOKUPs per tenant (wire `tenant`, a cache salt's fingerprint): a
bounded table in INFO's `tenants` section and the metrics' `tenant` label, whatever
fingerprints a client sends, of which one session fills at most MAX_TENANTS_PER_SESSION
rows; a session outside the daemon's uid reads its own rows only; requests of clients
of before the field still decode and count (lmcached/daemon/stats.py `TenantStats`)."""

import os
import socket
import time
import tracemalloc
import urllib.request

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from lmcached.daemon.info import info_sections
from lmcached.daemon.metrics import SNAPSHOT_MAX_AGE_S, metric_families, take_snapshot
from lmcached.daemon.stats import MAX_TENANTS, MAX_TENANTS_PER_SESSION
from lmcached.wire.connection import Connection, hello
from lmcached.wire.frames import request_decoder
from lmcached.wire.protocol import Acquire, Info, Lookup, LookupReply, Release
from test_service import (  # noqa: F401 (make_service and service are fixtures)
    LAYOUT,
    assert_everything_returned,
    chunk_hashes,
    error_code,
    greeted,
    make_service,
    service,
    store,
)

TENANT_A, TENANT_B = bytes.fromhex("0123456789abcdef"), bytes.fromhex("fedcba9876543210")


def tenant_samples(service) -> dict[str, dict[str, float]]:
    """{family name: {tenant label: value}} of the lmcached_tenant_* families."""
    families = metric_families(take_snapshot(service))
    return {f.name: {s.labels["tenant"]: s.value for s in f.samples}
            for f in families if f.name.startswith("lmcached_tenant_")}


def acquire(service, session, ids, tenant: bytes = b"", salted: bool = False) -> int:
    """ACQUIRE chunks `ids` under `tenant`, release the lease; the chunks found."""
    reply = service.handle(session, Acquire([1], chunk_hashes(ids), b"", salted, tenant))
    if reply.lease:
        service.handle(session, Release([reply.lease]))
    return len(reply.block_ids)


def test_hits_misses_and_lookups_are_counted_per_tenant(service):
    session = greeted(service, LAYOUT)
    store(service, session, 1, [0, 1])
    assert acquire(service, session, [0, 1, 2], TENANT_A, salted=True) == 2
    assert acquire(service, session, [0, 5], TENANT_B, salted=True) == 1
    assert acquire(service, session, [0, 1], TENANT_A, salted=True) == 2
    assert acquire(service, session, [7]) == 0  # unsalted
    assert service.handle(session, Lookup([1], chunk_hashes([0]), b"", TENANT_B)) == \
        LookupReply(1)
    tenants = service.handle(session, Info("tenants")).sections["tenants"]
    assert tenants == {
        "tenants_tracked": 2, "tenants_max": MAX_TENANTS,
        "tenant_unsalted_hits": 0, "tenant_unsalted_misses": 1, "tenant_unsalted_lookups": 0,
        "tenant_other_hits": 0, "tenant_other_misses": 0, "tenant_other_lookups": 0,
        "tenant_0123456789abcdef_hits": 4, "tenant_0123456789abcdef_misses": 1,
        "tenant_0123456789abcdef_lookups": 0,
        "tenant_fedcba9876543210_hits": 1, "tenant_fedcba9876543210_misses": 1,
        "tenant_fedcba9876543210_lookups": 1}
    stats = info_sections(service)["stats"]
    assert (stats["salted_hits"], stats["salted_misses"]) == (5, 2)
    assert (stats["hits"], stats["misses"]) == (5, 3)
    samples = tenant_samples(service)
    assert samples["lmcached_tenant_hit_chunks"] == {
        "unsalted": 0, "other": 0, "0123456789abcdef": 4, "fedcba9876543210": 1}
    assert samples["lmcached_tenant_lookups"]["fedcba9876543210"] == 1
    assert_everything_returned(service)


def test_ten_thousand_fingerprints_leave_the_table_and_the_labels_bounded(service):
    """Sessions fill the MAX_TENANTS rows, MAX_TENANTS_PER_SESSION each; then a hostile
    client sends a new fingerprint with every request: each counts under "other"; memory
    and series stay put, and every chunk is counted once."""
    session = greeted(service, LAYOUT)
    store(service, session, 1, [0])
    for i in range(MAX_TENANTS):
        if i % MAX_TENANTS_PER_SESSION == 0:
            session = greeted(service, LAYOUT)
        acquire(service, session, [0, 1], i.to_bytes(8, "little"))
    session = greeted(service, LAYOUT)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(MAX_TENANTS, 10_000):
        acquire(service, session, [0, 1], i.to_bytes(8, "little"))
        service.handle(session, Lookup([1], chunk_hashes([0]), b"", i.to_bytes(8, "big")))
    grown = sum(stat.size_diff for stat in
                tracemalloc.take_snapshot().compare_to(before, "filename")
                if "lmcached" in stat.traceback[0].filename)
    tracemalloc.stop()
    assert grown < 16 << 10, f"the daemon's state grew by {grown} bytes"
    tenants = service.handle(session, Info("tenants")).sections["tenants"]
    assert tenants["tenants_tracked"] == MAX_TENANTS
    assert len(tenants) == 2 + 3 * (MAX_TENANTS + 2)
    others = 10_000 - MAX_TENANTS
    assert (tenants["tenant_other_hits"], tenants["tenant_other_misses"],
            tenants["tenant_other_lookups"]) == (others, others, others)
    for name, per_tenant in tenant_samples(service).items():
        assert len(per_tenant) == MAX_TENANTS + 2, name
    hits = tenant_samples(service)["lmcached_tenant_hit_chunks"]
    assert sum(hits.values()) == service.pool.stats.hits == 10_000
    assert_everything_returned(service)


def test_a_tenant_of_the_wrong_size_is_refused_and_counts_nothing(service):
    session = greeted(service, LAYOUT)
    for request in (Lookup([1], chunk_hashes([0]), b"", b"x" * 9),
                    Acquire([1], chunk_hashes([0]), b"", True, b"x" * 3)):
        reply = service.handle(session, request)
        assert error_code(reply) == "bad_request" and "tenant is" in reply.message
    assert service.handle(session, Info("tenants")).sections["tenants"]["tenants_tracked"] == 0
    assert service.stats.errors == {"bad_request": 2}


def test_requests_of_clients_of_before_the_tenant_field_still_decode_and_count(service):
    """A LOOKUP of two or three fields and an ACQUIRE of four (`salted`, no `tenant`), as
    clients of before fingerprints send them: unsalted, and a salted ACQUIRE under
    "other"."""
    session = greeted(service, LAYOUT)
    store(service, session, 1, [0])
    hashes = chunk_hashes([0, 1])
    for fields in (["lookup", [1], hashes], ["lookup", [1], hashes, b""]):
        legacy = request_decoder.decode(msgspec.msgpack.encode(fields))
        assert legacy == Lookup([1], hashes) and legacy.tenant == b""
        assert service.handle(session, legacy) == LookupReply(1)
    old_acquire = request_decoder.decode(msgspec.msgpack.encode(["acquire", [1], hashes,
                                                                  b"", True]))
    assert old_acquire.salted and old_acquire.tenant == b""
    reply = service.handle(session, old_acquire)
    service.handle(session, Release([reply.lease]))
    tenants = service.handle(session, Info("tenants")).sections["tenants"]
    assert (tenants["tenant_unsalted_lookups"], tenants["tenant_other_hits"],
            tenants["tenant_other_misses"], tenants["tenants_tracked"]) == (2, 1, 1, 0)
    assert info_sections(service)["stats"]["salted_hits"] == 1
    assert_everything_returned(service)


def test_a_hostile_client_of_a_real_daemon_leaves_info_and_the_scrape_bounded(daemon_factory):
    """10,000 LOOKUPs, each with a new fingerprint, on a real socket: the client fills
    MAX_TENANTS_PER_SESSION rows, INFO and a scrape show those + 2 tenants, and the
    daemon goes on serving."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = daemon_factory("--capacity", "8MiB", "--block-size", "64KiB",
                            "--metrics-port", str(port))
    with Connection(daemon.socket) as conn:
        (ns,) = hello(conn, "hostile", [LAYOUT]).namespaces
        for i in range(10_000):
            assert conn.request(Lookup([ns], chunk_hashes([i]), b"", i.to_bytes(8, "big"))) \
                == LookupReply(0)
    fields = daemon.info()
    assert (fields["tenants_tracked"], fields["tenant_other_lookups"]) == \
        (MAX_TENANTS_PER_SESSION, 10_000 - MAX_TENANTS_PER_SESSION)
    assert sum(1 for name in fields if name.startswith("tenant_")) == \
        3 * (MAX_TENANTS_PER_SESSION + 2)
    time.sleep(SNAPSHOT_MAX_AGE_S)  # past the snapshot a scrape may reuse
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    tenants = {sample.labels["tenant"] for family in text_string_to_metric_families(text)
               for sample in family.samples if "tenant" in sample.labels}
    assert len(tenants) == MAX_TENANTS_PER_SESSION + 2 and {"unsalted", "other"} <= tenants
    assert fields["lookups"] == 10_000 and daemon.pins_held() == 0


def test_one_session_fills_a_few_rows_and_a_later_tenant_still_gets_its_own(service):
    """70 made-up fingerprints from one session take MAX_TENANTS_PER_SESSION rows (its
    first ones); its other 62 LOOKUPs count under "other"; a tenant that comes later, in
    another session, is counted under its own fingerprint."""
    hostile = greeted(service, LAYOUT)
    for i in range(70):
        service.handle(hostile, Lookup([1], chunk_hashes([0]), b"", i.to_bytes(8, "big")))
    tenant = greeted(service, LAYOUT)
    service.handle(tenant, Lookup([1], chunk_hashes([0]), b"", TENANT_A))
    tenants = service.handle(hostile, Info("tenants")).sections["tenants"]
    assert tenants["tenants_tracked"] == MAX_TENANTS_PER_SESSION + 1
    assert tenants["tenant_other_lookups"] == 70 - MAX_TENANTS_PER_SESSION
    assert tenants["tenant_0123456789abcdef_lookups"] == 1
    assert tenants[f"tenant_{(7).to_bytes(8, 'big').hex()}_lookups"] == 1
    assert f"tenant_{(8).to_bytes(8, 'big').hex()}_lookups" not in tenants


def test_a_session_of_another_uid_reads_only_its_own_tenant_rows(service):
    """INFO `tenants` for a client outside the daemon's uid: its own fingerprints' rows
    and the table's size, never another tenant's counts or fingerprint (nor the unsalted
    and "other" totals, which mix every tenant's); the daemon's uid reads them all."""
    uid = os.geteuid() + 1
    alice, bob = greeted(service, LAYOUT, uid=uid), greeted(service, LAYOUT, uid=uid + 1)
    store(service, greeted(service, LAYOUT), 1, [0])
    assert acquire(service, alice, [0, 1], TENANT_A, salted=True) == 1
    assert acquire(service, bob, [0], TENANT_B, salted=True) == 1
    assert service.handle(bob, Info("tenants")).sections["tenants"] == {
        "tenants_tracked": 2, "tenants_max": MAX_TENANTS,
        "tenant_fedcba9876543210_hits": 1, "tenant_fedcba9876543210_misses": 0,
        "tenant_fedcba9876543210_lookups": 0}
    whole = service.handle(bob, Info()).sections["tenants"]  # every section: the same
    assert "tenant_0123456789abcdef_hits" not in whole and "tenant_other_hits" not in whole
    admin = service.handle(greeted(service, LAYOUT), Info("tenants")).sections["tenants"]
    assert admin["tenant_0123456789abcdef_hits"] == 1 and admin["tenant_unsalted_hits"] == 0
    assert admin["tenant_fedcba9876543210_hits"] == 1
