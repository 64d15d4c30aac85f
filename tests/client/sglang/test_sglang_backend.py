"""lmcached as SGLang's HiCache storage backend, against SGLang 0.5.23's real modules.

The backend is built by SGLang's dynamic factory from the documented extra config, over
stand-in host pools whose `get_page_buffer_meta` is SGLang's own code (sglang_pools.py):
pages set by one process are found and read bit-exact by another, in both layouts and
for MLA (one copy for every TP rank); salts separate pages; a page evicted between
`batch_exists` and `batch_get_v1`, or whose record holds another key, is a miss; a daemon
killed mid-batch is a miss, never an exception; a restarted daemon serves the pages from
its disk tier. Skipped where SGLang is not installed (`make test-sglang` installs it).
"""

import ast
import inspect
import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: E402

from conftest import start_daemon  # noqa: E402
from test_limits import wait_for  # noqa: E402
from lmcached.client.sglang import LmcachedStorage, page_io, pages  # noqa: E402
from lmcached.wire.connection import Connection  # noqa: E402
from lmcached.wire.protocol import Clear  # noqa: E402
from sglang_pools import fill_pages, page_indices, read_runs, sglang_method  # noqa: E402
from sglang_worker import build, page_keys  # noqa: E402

pytestmark = pytest.mark.sglang

WORKER = os.path.join(os.path.dirname(__file__), "sglang_worker.py")
NUM_PAGES = 8
ENV = {**os.environ, "LMCACHED_DATA_TIMEOUT_MS": "10000",
       "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                      os.path.join(os.path.dirname(__file__), os.pardir,
                                                   os.pardir)])}


def run_worker(socket: str, *args) -> dict:
    out = subprocess.run([sys.executable, WORKER, socket, *map(str, args)], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ conformance
def _params(sig: inspect.Signature) -> list[tuple]:
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty)
            for p in sig.parameters.values()]


def test_every_abstract_method_is_implemented_with_sglangs_signature():
    assert not getattr(LmcachedStorage, "__abstractmethods__", None)
    ours = {name for name in vars(LmcachedStorage) if not name.startswith("_")}
    for name in sorted(HiCacheStorage.__abstractmethods__):
        assert name in ours, f"HiCacheStorage.{name} is abstract and not implemented"
    implemented = ours & {n for n in vars(HiCacheStorage) if not n.startswith("_")}
    assert {"batch_exists", "batch_get_v1", "batch_set_v1", "register_mem_pool_host",
            "clear", "get_stats"} <= implemented
    for name in sorted(implemented):
        base = _params(inspect.signature(getattr(HiCacheStorage, name)))
        mine = _params(inspect.signature(getattr(LmcachedStorage, name)))
        assert mine[: len(base)] == base, f"{name}: {mine} differs from SGLang's {base}"
        assert all(has_default for _, _, has_default in mine[len(base):]), name


def test_the_stand_in_pools_use_sglangs_get_page_buffer_meta_signature():
    """The backend calls `get_page_buffer_meta(indices)` and reads page_size, layout and
    dtype: SGLang's host pools take exactly `(self, indices)`."""
    for module, cls in (("mha", "MHATokenToKVPoolHost"), ("mla", "MLATokenToKVPoolHost")):
        _, node = sglang_method(module, cls, "get_page_buffer_meta")
        assert [a.arg for a in node.args.args] == ["self", "indices"], (module, ast.dump(node.args))


def test_the_dynamic_factory_builds_the_backend_from_the_documented_extra_config(daemon):
    backend, pool = build(daemon.socket, "mha", "page_first", 0, 1)
    try:
        assert isinstance(backend, LmcachedStorage)
        assert backend.namespace.startswith("sglang/test/model/page_first/bfloat16/p4/")
        assert daemon.info()["namespaces_sglang"] == 1
    finally:
        backend.close()


def test_an_unknown_extra_config_key_is_refused_with_its_name():
    from sglang_worker import HiCacheStorageConfig

    config = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, False, "m",
                                  extra_config={"sockt": "/x", "interface_v1": 1})
    with pytest.raises(ValueError, match="unknown extra_config keys \\['sockt'\\]"):
        LmcachedStorage(config, {})


def test_an_extra_config_without_interface_v1_is_refused_with_the_fix():
    """Without it SGLang's controller calls batch_get / batch_set with flat pages."""
    from sglang_worker import HiCacheStorageConfig

    config = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, False, "m", extra_config={
        "backend_name": "lmcached", "module_path": "lmcached.client.sglang",
        "class_name": "LmcachedStorage"})
    with pytest.raises(ValueError, match='add "interface_v1": 1 to --hicache-storage-backend'):
        LmcachedStorage(config, {})


# ------------------------------------------------------------ two processes
@pytest.mark.slow
@pytest.mark.parametrize("kind,layout,ranks", [
    ("mha", "layer_first", (0, 0)),
    ("mha", "page_first", (0, 0)),
    ("mla", "page_first", (0, 1)),  # MLA: rank 1 reads what rank 0 wrote
])
def test_pages_set_by_one_process_are_read_bit_exact_by_another(daemon, kind, layout, ranks):
    a = run_worker(daemon.socket, "set", kind, layout, ranks[0], 2, NUM_PAGES, 7)
    assert a["stored"] == NUM_PAGES
    b = run_worker(daemon.socket, "get", kind, layout, ranks[1], 2, NUM_PAGES, 7)
    assert (b["hit"], b["read"], b["bit_exact"]) == (NUM_PAGES, NUM_PAGES, True)
    assert b["stats"]["verify_failures"] == 0
    info = daemon.info()
    assert info["pinned_blocks"] == 0 and info["namespaces_sglang"] >= 1


def test_mha_ranks_and_layouts_do_not_share_pages(daemon):
    a, pool = build(daemon.socket, "mha", "page_first", 0, 2)
    others = [build(daemon.socket, "mha", "page_first", 1, 2),
              build(daemon.socket, "mha", "layer_first", 0, 2)]
    try:
        keys = page_keys(NUM_PAGES, "")
        src = page_indices(list(range(NUM_PAGES)), pool.page_size)
        fill_pages(pool, src, 1)
        assert all(a.batch_set_v1(keys, src))
        assert a.batch_exists(keys) == NUM_PAGES
        assert [b.batch_exists(keys) for b, _ in others] == [0, 0]
    finally:
        for b in [a] + [b for b, _ in others]:
            b.close()


def test_a_salt_in_the_keys_separates_pages(daemon):
    backend, pool = build(daemon.socket, "mha", "layer_first", 0, 1)
    try:
        src = page_indices(list(range(NUM_PAGES)), pool.page_size)
        fill_pages(pool, src, 3)
        assert all(backend.batch_set_v1(page_keys(NUM_PAGES, "tenant-a"), src))
        assert backend.batch_exists(page_keys(NUM_PAGES, "tenant-a")) == NUM_PAGES
        assert backend.batch_exists(page_keys(NUM_PAGES, "tenant-b")) == 0
        assert backend.batch_get_v1(page_keys(NUM_PAGES, "tenant-b"), src) == [False] * NUM_PAGES
    finally:
        backend.close()


# ------------------------------------------------------------------- misses
def test_a_page_evicted_between_exists_and_get_is_a_miss(daemon):
    backend, pool = build(daemon.socket, "mha", "page_first", 0, 1)
    try:
        keys = page_keys(NUM_PAGES, "")
        src = page_indices(list(range(NUM_PAGES)), pool.page_size)
        fill_pages(pool, src, 5)
        assert all(backend.batch_set_v1(keys, src))
        assert backend.batch_exists(keys) == NUM_PAGES
        with Connection(daemon.socket) as conn:
            assert conn.request(Clear()).count == NUM_PAGES
        dst = page_indices(list(range(NUM_PAGES, 2 * NUM_PAGES)), pool.page_size)
        before = read_runs(pool, dst)
        assert backend.batch_get_v1(keys, dst) == [False] * NUM_PAGES
        assert read_runs(pool, dst) == before  # nothing copied
        assert daemon.info()["pinned_blocks"] == 0
    finally:
        backend.close()


def test_a_record_holding_another_keys_page_is_never_served(daemon, monkeypatch):
    """A page stored under another key's hash (a collision, a corrupted index): the
    record's key ids do not match the key asked for, so it is a miss."""
    backend, pool = build(daemon.socket, "mha", "page_first", 0, 1)
    try:
        keys = page_keys(2, "")
        src = page_indices([0], pool.page_size)
        fill_pages(pool, src, 9)
        real_hash = page_io.page_hash
        wrong = real_hash(pages.key_tokens(keys[1]))
        monkeypatch.setattr(page_io, "page_hash", lambda tokens: wrong)
        assert backend.batch_set_v1([keys[0]], src) == [True]  # stored under keys[1]'s hash
        monkeypatch.setattr(page_io, "page_hash", real_hash)
        assert backend.batch_exists([keys[1]]) == 1  # the index says so
        dst = page_indices([1], pool.page_size)
        assert backend.batch_get_v1([keys[1]], dst) == [False]
        assert read_runs(pool, dst) != read_runs(pool, src)
        assert backend.get_stats()["verify_failures"] == 1
    finally:
        backend.close()


def test_a_record_whose_key_differs_in_its_last_byte_is_a_miss(daemon, monkeypatch):
    """Page 3 stored under its own key's hash but with key ids that differ only in the
    key's last byte: the cheap batch check (header and key slots only) still stops
    there, the pages before it are served, and no pin is left."""
    backend, pool = build(daemon.socket, "mha", "page_first", 0, 1)
    try:
        keys = [f"{key}x" for key in page_keys(NUM_PAGES, "")]  # 65 bytes: a part slot
        stored = keys[:3] + [keys[3][:-1] + "y"] + keys[4:]
        real_hash = page_io.page_hash
        hash_of = {pages.key_tokens(s).tobytes(): real_hash(pages.key_tokens(k))
                   for s, k in zip(stored, keys)}
        src = page_indices(list(range(NUM_PAGES)), pool.page_size)
        fill_pages(pool, src, 4)
        monkeypatch.setattr(page_io, "page_hash", lambda tokens: hash_of[tokens.tobytes()])
        assert all(backend.batch_set_v1(stored, src))
        monkeypatch.setattr(page_io, "page_hash", real_hash)
        assert backend.batch_exists(keys) == NUM_PAGES  # the index says so
        dst = page_indices(list(range(NUM_PAGES, 2 * NUM_PAGES)), pool.page_size)
        assert backend.batch_get_v1(keys, dst) == [True] * 3 + [False] * (NUM_PAGES - 3)
        assert read_runs(pool, dst[: 3 * pool.page_size]) == read_runs(
            pool, src[: 3 * pool.page_size])
        assert backend.get_stats()["verify_failures"] == 1
        assert daemon.info()["pinned_blocks"] == 0
    finally:
        backend.close()


def test_a_hit_is_decided_by_the_batch_check_without_chain_check(daemon, monkeypatch):
    """A batch of pages that all match is checked by one vectorised comparison of their
    headers and key slots (`RecordIO.verify_leading_slots`), not `Chain.check`'s full
    per-slot comparison; the bytes are the page's."""
    backend, pool = build(daemon.socket, "mha", "page_first", 0, 1)
    try:
        keys = page_keys(NUM_PAGES, "")
        src = page_indices(list(range(NUM_PAGES)), pool.page_size)
        fill_pages(pool, src, 6)
        assert all(backend.batch_set_v1(keys, src))
        full_checks = []
        check = backend.chain.check
        monkeypatch.setattr(backend.chain, "check",
                            lambda *args: full_checks.append(1) or check(*args))
        dst = page_indices(list(range(NUM_PAGES, 2 * NUM_PAGES)), pool.page_size)
        assert backend.batch_get_v1(keys, dst) == [True] * NUM_PAGES
        assert read_runs(pool, dst) == read_runs(pool, src)
        assert full_checks == []
        assert daemon.info()["pinned_blocks"] == 0
    finally:
        backend.close()


@pytest.mark.parametrize("op", ["get", "set"])
def test_a_daemon_killed_mid_batch_is_a_miss_never_an_exception(daemon, monkeypatch, op):
    backend, pool = build(daemon.socket, "mha", "layer_first", 0, 1)
    keys = page_keys(NUM_PAGES, "")
    src = page_indices(list(range(NUM_PAGES)), pool.page_size)
    fill_pages(pool, src, 11)
    if op == "get":
        assert all(backend.batch_set_v1(keys, src))
    real_copy = page_io.copy_runs
    calls = []

    def copy_then_kill(dst, src_runs):
        if len(calls) == 2:  # mid-batch: after two pages
            os.kill(daemon.proc.pid, signal.SIGKILL)
            daemon.proc.wait(10)
        calls.append(1)
        real_copy(dst, src_runs)

    monkeypatch.setattr(page_io, "copy_runs", copy_then_kill)
    try:
        dst = page_indices(list(range(NUM_PAGES, 2 * NUM_PAGES)), pool.page_size)
        if op == "get":
            got = backend.batch_get_v1(keys, dst)
            # The pages copied before the kill are whole: the daemon's end freed nothing
            # that another process could have written meanwhile.
            num_ok = sum(got)
            assert got == [True] * num_ok + [False] * (NUM_PAGES - num_ok)
            m = len(read_runs(pool, src)) // NUM_PAGES
            assert read_runs(pool, dst)[: num_ok * m] == read_runs(pool, src)[: num_ok * m]
        else:
            assert backend.batch_set_v1(keys, src) == [False] * NUM_PAGES
        monkeypatch.setattr(page_io, "copy_runs", real_copy)
        # With no daemon: misses and skipped stores, no exception.
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, dst) == [False] * NUM_PAGES
        assert backend.batch_set_v1(keys, src) == [False] * NUM_PAGES
        assert backend.get_stats()["failures"] == 0
    finally:
        backend.close()
        # A daemon of the same name sweeps the killed one's segment and socket.
        start_daemon(daemon.name, daemon.socket, daemon.log_path + ".2").stop()


# ---------------------------------------------------------------- disk tier
@pytest.mark.slow
def test_a_restarted_daemon_serves_the_pages_from_its_disk(daemon_factory, short_tmp):
    disk = ("--capacity", "2MiB", "--block-size", "16KiB", "--disk-fetch-wait", "5",
            "--disk-path", os.path.join(short_tmp, "disk"), "--disk-capacity", "8MiB")
    daemon = daemon_factory(*disk, "--disk-policy", "write-through")
    a = run_worker(daemon.socket, "set", "mha", "page_first", 0, 1, NUM_PAGES, 13)
    assert a["stored"] == NUM_PAGES
    wait_for(lambda: (lambda i: i["disk_writes"] >= NUM_PAGES and not i["disk_queue_values"])(
        daemon.info()), what="the disk writes", timeout_s=30)
    daemon.stop()
    restarted = start_daemon(daemon.name, daemon.socket, daemon.log_path + ".2", *disk)
    try:
        assert restarted.info()["cached_values"] == 0
        b = run_worker(restarted.socket, "get", "mha", "page_first", 0, 1, NUM_PAGES, 13)
        assert (b["hit"], b["read"], b["bit_exact"]) == (NUM_PAGES, NUM_PAGES, True)
        info = restarted.info()
        assert info["disk_fetch_hit_chunks"] >= NUM_PAGES and info["disk_fetch_failures"] == 0
        assert info["pinned_blocks"] == 0
    finally:
        restarted.stop()


# ----------------------------------------------------------------------- L2
@pytest.mark.slow
def test_a_second_node_reads_the_pages_from_l2(redis_server, daemon_factory):
    args = ("--capacity", "2MiB", "--block-size", "16KiB", "--l2", redis_server.url,
            "--l2-fetch-wait", "5")
    node_a, node_b = daemon_factory(*args), daemon_factory(*args)
    a, pool_a = build(node_a.socket, "mla", "page_first", 0, 2)
    b, pool_b = build(node_b.socket, "mla", "page_first", 1, 2)
    try:
        keys = page_keys(NUM_PAGES, "salt")
        src = page_indices(list(range(NUM_PAGES)), pool_a.page_size)
        fill_pages(pool_a, src, 17)
        assert all(a.batch_set_v1(keys, src))
        wait_for(lambda: (lambda i: i["l2_writes"] >= NUM_PAGES and not i["l2_queue_values"])(
            node_a.info()), what="the L2 writes", timeout_s=30)
        assert node_b.info()["cached_values"] == 0
        assert b.batch_exists(keys) == NUM_PAGES
        dst = page_indices(list(range(NUM_PAGES, 2 * NUM_PAGES)), pool_b.page_size)
        assert b.batch_get_v1(keys, dst) == [True] * NUM_PAGES
        assert read_runs(pool_b, dst) == read_runs(pool_a, src)
        info = node_b.info()
        assert info["l2_fetch_hit_chunks"] == NUM_PAGES and info["pinned_blocks"] == 0
        assert not [k for k, v in info.items() if k.startswith("l2_fetch_verify_") and v]
    finally:
        a.close()
        b.close()


def test_a_daemon_not_up_yet_is_misses_then_the_backend_attaches(daemon_factory, short_tmp):
    socket = os.path.join(short_tmp, "0.sock")  # where daemon_factory's first daemon listens
    backend, pool = build(socket, "mha", "page_first", 0, 1)
    try:
        keys = page_keys(NUM_PAGES, "")
        src = page_indices(list(range(NUM_PAGES)), pool.page_size)
        fill_pages(pool, src, 19)
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, src) == [False] * NUM_PAGES
        assert backend.batch_get_v1(keys, src) == [False] * NUM_PAGES
        daemon = daemon_factory("--capacity", "64MiB", "--block-size", "1MiB")
        assert daemon.socket == socket
        wait_for(lambda: all(backend.batch_set_v1(keys, src)), what="a store after the start",
                 timeout_s=30)
        assert backend.batch_exists(keys) == NUM_PAGES
        assert backend.get_stats()["failures"] == 0
    finally:
        backend.close()


def test_clear_drops_nothing_unless_the_extra_config_allows_it(daemon):
    backend, pool = build(daemon.socket, "mha", "page_first", 0, 1)
    try:
        keys = page_keys(NUM_PAGES, "")
        src = page_indices(list(range(NUM_PAGES)), pool.page_size)
        assert all(backend.batch_set_v1(keys, src))
        assert backend.clear() is False
        assert backend.batch_exists(keys) == NUM_PAGES
        backend.allow_clear = True  # extra_config {"allow_clear": true}
        assert backend.clear() is True
        assert backend.batch_exists(keys) == 0 and daemon.info()["cached_values"] == 0
    finally:
        backend.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_pages_are_one_copy_for_every_tp_rank(daemon, layout):
    ranks = [build(daemon.socket, "mla", layout, rank, 4) for rank in range(4)]
    try:
        (writer, pool), readers = ranks[0], ranks[1:]
        keys = page_keys(NUM_PAGES, "")
        src = page_indices(list(range(NUM_PAGES)), pool.page_size)
        dst = page_indices(list(range(NUM_PAGES, 2 * NUM_PAGES)), pool.page_size)
        fill_pages(pool, src, 23)
        assert all(writer.batch_set_v1(keys, src))
        for reader, reader_pool in readers:
            assert reader.namespace == writer.namespace
            assert reader.batch_get_v1(keys, dst) == [True] * NUM_PAGES
            assert read_runs(reader_pool, dst) == read_runs(pool, src)
        assert daemon.info()["cached_values"] == NUM_PAGES  # one copy
    finally:
        for backend, _ in ranks:
            backend.close()
