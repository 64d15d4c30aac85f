"""The SGLang backend's pipelined batches: a batch's requests are in flight while the
client works, and every guarantee holds across its parts.

With first parts set (FIRST_GET_PAGES, FIRST_STORE_PAGES, LAST_STORE_PAGES; 0 sends a
batch that fits one request as one), `batch_get_v1` sends the ACQUIRE of its first
pages alone and the rest together, and reads the host pool's page runs while the daemon
answers; `batch_set_v1` does the same with ALLOC, and COMMITs all parts but the last
before writing the last. Checked here, against a
real daemon: the page runs are read while a request is in flight; a miss or a record
that fails its check in a later part stops the batch there, copies nothing after it and
leaves no pin; a store of three parts is read back bit-exact; a batch that fails half-way
through its pipeline ends its session (its pins go with it) and the next batch works;
`Connection.submit` / `collect` keep replies in order and refuse a request while
replies await.
"""

import threading

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from conftest import start_daemon  # noqa: E402,F401
from test_limits import wait_for  # noqa: E402
from lmcached.client.sglang import page_io, pages  # noqa: E402
from lmcached.wire.connection import Connection  # noqa: E402
from lmcached.wire.protocol import Ok, Ping  # noqa: E402
from sglang_pools import fill_pages, page_indices, read_runs  # noqa: E402
from sglang_worker import build, page_keys  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture(autouse=True)
def parts(monkeypatch):
    """Batches in these parts (the defaults' sizes, whatever they become)."""
    monkeypatch.setattr(page_io, "FIRST_GET_PAGES", 4)
    monkeypatch.setattr(page_io, "FIRST_STORE_PAGES", 8)
    monkeypatch.setattr(page_io, "LAST_STORE_PAGES", 8)

NUM_PAGES = 12  # get: parts [0, 4) and [4, 12) (FIRST_GET_PAGES); set: [0, 8), [8, 12)


def stored(daemon, num_pages: int, skip: tuple[int, ...] = ()):
    """A backend over a pool of 2 * num_pages pages whose first num_pages were stored
    (but `skip`); (backend, pool, keys, src, dst)."""
    backend, pool = build(daemon.socket, "mha", "page_first", 0, 1, size=8 * num_pages)
    keys = page_keys(num_pages, "")
    src = page_indices(list(range(num_pages)), pool.page_size)
    fill_pages(pool, src, 3)
    keep = [i for i in range(num_pages) if i not in skip]
    assert all(backend.batch_set_v1([keys[i] for i in keep],
                                    page_indices(keep, pool.page_size)))
    dst = page_indices(list(range(num_pages, 2 * num_pages)), pool.page_size)
    return backend, pool, keys, src, dst


def runs_per_page(pool, src, num_pages: int) -> int:
    return len(read_runs(pool, src)) // num_pages


@pytest.mark.parametrize("in_parts", [True, False])
def test_the_page_runs_are_read_while_the_first_request_is_in_flight(daemon, monkeypatch,
                                                                     in_parts):
    if not in_parts:  # a batch that fits one request is one
        for name in ("FIRST_GET_PAGES", "FIRST_STORE_PAGES", "LAST_STORE_PAGES"):
            monkeypatch.setattr(page_io, name, 0)
    backend, pool, keys, src, dst = stored(daemon, NUM_PAGES)
    try:
        in_flight = []
        real = type(pool).get_page_buffer_meta

        def meta(self, indices):  # the get's session, then the store's
            in_flight.append(max(getattr(link._conn, "awaiting", 0)
                                 for link in (backend.link, backend.store_link)))
            return real(self, indices)

        monkeypatch.setattr(type(pool), "get_page_buffer_meta", meta)
        assert backend.batch_get_v1(keys, dst) == [True] * NUM_PAGES
        assert backend.batch_set_v1(page_keys(NUM_PAGES, "more"), src) == [True] * NUM_PAGES
        # every call (the batch's first and last page, `HostPageRuns._agrees`) while
        # both parts' ACQUIREs, then both parts' ALLOCs, are in flight; without parts one
        assert in_flight and set(in_flight) == ({2} if in_parts else {1})
        monkeypatch.setattr(type(pool), "get_page_buffer_meta", real)
        assert read_runs(pool, dst) == read_runs(pool, src)
    finally:
        backend.close()


@pytest.mark.parametrize("missing", [2, 6])  # in the first part, in the second
def test_a_miss_in_any_part_stops_the_batch_there_and_leaves_no_pin(daemon, missing):
    backend, pool, keys, src, dst = stored(daemon, NUM_PAGES, skip=(missing,))
    try:
        before = read_runs(pool, dst)
        got = backend.batch_get_v1(keys, dst)
        assert got == [True] * missing + [False] * (NUM_PAGES - missing)
        m = runs_per_page(pool, src, NUM_PAGES)
        after = read_runs(pool, dst)
        assert after[: missing * m] == read_runs(pool, src)[: missing * m]
        assert after[missing * m:] == before[missing * m:]  # nothing copied after it
        wait_for(lambda: daemon.pins_held() == 0)
        assert backend.get_stats()["miss_pages"] == NUM_PAGES - missing
    finally:
        backend.close()


def test_a_record_of_another_key_in_the_second_part_is_never_served(daemon, monkeypatch):
    """Page 5's record is stored under page 6's hash: the second part's check stops the
    batch at page 6, whose bytes would be page 5's."""
    backend, pool = build(daemon.socket, "mha", "page_first", 0, 1, size=8 * NUM_PAGES)
    try:
        keys = page_keys(NUM_PAGES, "")
        src = page_indices(list(range(NUM_PAGES)), pool.page_size)
        fill_pages(pool, src, 4)
        real_hash = page_io.page_hash
        five, six = pages.key_tokens(keys[5]), real_hash(pages.key_tokens(keys[6]))
        monkeypatch.setattr(page_io, "page_hash",
                            lambda t: six if (t == five).all() else real_hash(t))
        assert backend.batch_set_v1(keys[5:6], src[5 * 4 : 6 * 4]) == [True]
        monkeypatch.setattr(page_io, "page_hash", real_hash)
        backend.batch_set_v1(keys, src)  # page 6: EXISTS (the index says so)
        dst = page_indices(list(range(NUM_PAGES, 2 * NUM_PAGES)), pool.page_size)
        before = read_runs(pool, dst)
        assert backend.batch_get_v1(keys, dst) == [True] * 6 + [False] * 6
        m = runs_per_page(pool, src, NUM_PAGES)
        assert read_runs(pool, dst)[6 * m:] == before[6 * m:]
        assert backend.get_stats()["verify_failures"] == 1
        wait_for(lambda: daemon.pins_held() == 0)
    finally:
        backend.close()


def test_a_store_of_three_parts_is_read_back_bit_exact(daemon):
    num_pages = 24  # parts [0, 8), [8, 16), [16, 24): FIRST_ / LAST_STORE_PAGES are 8
    backend, pool, keys, src, dst = stored(daemon, num_pages)
    try:
        assert backend.get_stats()["stored_pages"] == num_pages
        assert backend.batch_exists(keys) == num_pages
        assert backend.batch_get_v1(keys, dst) == [True] * num_pages
        assert read_runs(pool, dst) == read_runs(pool, src)
        assert daemon.info()["writing_blocks"] == 0
    finally:
        backend.close()


@pytest.mark.parametrize("op", ["get", "set"])
def test_a_batch_failing_mid_pipeline_ends_its_session_and_the_next_batch_works(
        daemon, monkeypatch, op):
    backend, pool, keys, src, dst = stored(daemon, NUM_PAGES)
    try:
        link = backend.link if op == "get" else backend.store_link  # the op's session
        session = link.hello_reply.session_id
        real_copy = page_io.copy_runs

        def fail(dst_runs, src_runs):
            raise RuntimeError("copy failed")

        monkeypatch.setattr(page_io, "copy_runs", fail)
        more = page_keys(NUM_PAGES, "more")
        if op == "get":
            assert backend.batch_get_v1(keys, dst) == [False] * NUM_PAGES
        else:
            assert backend.batch_set_v1(more, src) == [False] * NUM_PAGES
        assert backend.get_stats()["failures"] == 1
        monkeypatch.setattr(page_io, "copy_runs", real_copy)
        wait_for(lambda: daemon.pins_held() == 0 and daemon.info()["writing_blocks"] == 0)
        assert backend.batch_get_v1(keys, dst) == [True] * NUM_PAGES  # not a miss
        if op == "set":
            assert backend.batch_set_v1(more[:1], src[:pool.page_size]) == [True]
        assert link.hello_reply.session_id != session
        assert read_runs(pool, dst) == read_runs(pool, src)
        assert backend.batch_exists(more) == (1 if op == "set" else 0)
    finally:
        backend.close()


def test_a_get_never_waits_for_a_store_being_copied(daemon, monkeypatch):
    """SGLang's prefetch thread gets while its backup thread stores: a store copying its
    pages (held here until released) does not hold up a get of other pages, and both
    land whole."""
    backend, pool, keys, src, dst = stored(daemon, NUM_PAGES)
    real_copy = page_io.copy_runs
    copying, release = threading.Event(), threading.Event()

    def held_copy(dst_runs, src_runs):
        if threading.current_thread().name == "store":
            copying.set()
            assert release.wait(60)
        real_copy(dst_runs, src_runs)

    monkeypatch.setattr(page_io, "copy_runs", held_copy)
    more = page_keys(NUM_PAGES, "more")
    stored_pages, got = [], []
    store = threading.Thread(target=lambda: stored_pages.append(backend.batch_set_v1(more, src)),
                             name="store")
    get = threading.Thread(target=lambda: got.append(backend.batch_get_v1(keys, dst)))
    try:
        store.start()
        assert copying.wait(30)
        get.start()
        get.join(30)
        assert not get.is_alive(), "the get waited for the store's copy"
        assert got == [[True] * NUM_PAGES]
        assert read_runs(pool, dst) == read_runs(pool, src)
    finally:
        release.set()
        store.join(60)
        get.join(60)
    try:
        assert stored_pages == [[True] * NUM_PAGES]
        assert backend.batch_exists(more) == NUM_PAGES
        wait_for(lambda: daemon.pins_held() == 0 and daemon.info()["writing_blocks"] == 0)
    finally:
        backend.close()


def test_submitted_replies_are_collected_in_order_and_a_request_meanwhile_is_refused(daemon):
    with Connection(daemon.socket) as conn:
        conn.submit(Ping(), Ping())
        assert conn.awaiting == 2
        assert isinstance(conn.collect(), Ok) and isinstance(conn.collect(), Ok)
        with pytest.raises(ConnectionError, match="no submitted request"):
            conn.collect()
        assert isinstance(conn.request(Ping()), Ok)  # still in step
        conn.submit(Ping())
        with pytest.raises(ConnectionError, match="not collected"):
            conn.request(Ping())
        with pytest.raises(ConnectionError, match="out of step"):
            conn.request(Ping())
