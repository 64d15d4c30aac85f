"""`HostPageRuns`: a batch's page runs from the host pool's affine model equal the pool's
own `get_page_buffer_meta` answer, and a pool the model does not fit (not affine, or
whose buffers moved after registration) is asked instead. Skipped where SGLang is not
installed (`make test-sglang` installs it)."""

import logging

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402

from lmcached.client.sglang.host_runs import HostPageRuns  # noqa: E402
from tests.client.sglang.sglang_pools import make_pool, page_indices  # noqa: E402

pytestmark = pytest.mark.sglang

POOLS = [("mha", "layer_first"), ("mha", "page_first"), ("mla", "layer_first"),
         ("mla", "page_first")]


def own_runs(pool, host_indices: torch.Tensor, num_pages: int) -> list:
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    m = len(ptrs) // num_pages
    return [list(zip(ptrs[i * m:(i + 1) * m], sizes[i * m:(i + 1) * m]))
            for i in range(num_pages)]


@pytest.mark.parametrize("kind,layout", POOLS)
def test_the_model_gives_the_pools_own_runs_for_pages_in_any_order(kind, layout):
    pool = make_pool(kind, layout, size=64, page_size=4)
    runs = HostPageRuns.learn(pool)
    assert runs.base is not None  # SGLang's pools are affine
    pages = [13, 0, 15, 2, 7, 7, 1]
    indices = page_indices(pages, 4)
    assert runs.runs(indices, len(pages)) == own_runs(pool, indices, len(pages))
    assert runs.page_bytes == sum(n for _, n in own_runs(pool, indices[:4], 1)[0])


class Shuffled:
    """A pool whose pages lie in its buffer in a shuffled order (not affine)."""

    def __init__(self, inner, order: list[int]):
        self.inner, self.order = inner, order
        self.size, self.page_size = inner.size, inner.page_size

    def get_page_buffer_meta(self, indices):
        ps = self.page_size
        moved = torch.tensor([self.order[int(i) // ps] * ps + int(i) % ps for i in indices])
        return self.inner.get_page_buffer_meta(moved)


def test_a_pool_that_is_not_affine_is_asked_for_every_batch():
    inner = make_pool("mha", "page_first", size=64, page_size=4)
    pool = Shuffled(inner, [0, 1] + list(range(15, 1, -1)))  # pages 0 and 1 in place
    runs = HostPageRuns.learn(pool)
    assert runs.base is None
    indices = page_indices([5, 0, 9], 4)
    assert runs.runs(indices, 3) == own_runs(pool, indices, 3)


def test_a_pool_whose_buffer_moved_is_asked_from_then_on(caplog):
    pool = make_pool("mha", "layer_first", size=64, page_size=4)
    runs = HostPageRuns.learn(pool)
    pool.kv_buffer = torch.zeros_like(pool.kv_buffer)  # a new allocation
    indices = page_indices([3, 4, 5], 4)
    with caplog.at_level(logging.WARNING):
        assert runs.runs(indices, 3) == own_runs(pool, indices, 3)
    assert runs.base is None
    assert "buffers moved" in caplog.text


def test_indices_outside_the_pool_are_asked_of_the_pool():
    pool = make_pool("mha", "page_first", size=64, page_size=4)
    runs = HostPageRuns.learn(pool)
    indices = page_indices([1, 40, 2], 4)  # page 40 of a 16-page pool
    assert runs.runs(indices, 3) == own_runs(pool, indices, 3)
    assert runs.base is None


def test_a_pool_without_a_size_is_asked_for_every_batch():
    pool = make_pool("mla", "page_first", size=64, page_size=4)
    del pool.size
    runs = HostPageRuns.learn(pool)
    assert runs.base is None
    indices = page_indices([6, 2], 4)
    assert runs.runs(indices, 2) == own_runs(pool, indices, 2)


def test_a_large_pool_is_learnt_from_pages_spread_over_it(monkeypatch):
    """Past LEARN_PAGES pages, the model is checked against a spread of them, its first
    two and its last among them: a pool shuffled from its third page on is caught."""
    import lmcached.client.sglang.host_runs as host_runs

    monkeypatch.setattr(host_runs, "LEARN_PAGES", 4)
    pool = make_pool("mha", "page_first", size=64, page_size=4)
    runs = HostPageRuns.learn(pool)
    assert runs.base is not None and runs.limit == 64
    indices = page_indices([11, 3], 4)
    assert runs.runs(indices, 2) == own_runs(pool, indices, 2)
    asked = []
    shuffled = Shuffled(make_pool("mha", "page_first", size=64, page_size=4),
                        [0, 1] + list(range(15, 1, -1)))
    real = shuffled.get_page_buffer_meta
    shuffled.get_page_buffer_meta = lambda indices: asked.append(len(indices)) or real(indices)
    assert HostPageRuns.learn(shuffled).base is None
    assert max(asked) <= (4 + 1) * 4  # pages 0, 1, 5, 10 and 15 of 4 tokens, not all 16


def test_a_pool_that_refuses_some_of_its_pages_is_asked_for_every_batch():
    """SGLang's MLA pool with decode context parallelism raises for pages outside its
    logical size: registration must not fail for that."""
    pool = make_pool("mha", "page_first", size=64, page_size=4)
    real = pool.get_page_buffer_meta

    def refusing(indices):
        if len(indices) > 4 * 4:
            raise IndexError("DCP L3 page is outside the host pool.")
        return real(indices)

    pool.get_page_buffer_meta = refusing
    runs = HostPageRuns.learn(pool)
    assert runs.base is None
    indices = page_indices([2, 1], 4)
    assert runs.runs(indices, 2) == own_runs(pool, indices, 2)
