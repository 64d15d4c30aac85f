"""Where a batch's pages lie in SGLang's host pool: per page, its (address, bytes) runs.

Why this file exists: SGLang's host pools answer `get_page_buffer_meta(indices)` with a
Python loop over the pages (about 0.7 us a page on the 2-core CI machine, some 50 us
for a 64-page batch), and a batch's copies cannot start before its runs are known. In
every host pool SGLang ships (MHA and MLA, layer-first and page-first), a run's address
is affine in the token index of its page's first token: `address_j(index) = base_j +
index * stride_j`. `HostPageRuns.learn` asks the pool for the runs of all its pages
once, keeps the model only when it reproduces every one of them exactly, and then
computes a batch's runs with one numpy product. Each batch also asks the pool for the
runs of its first and last page, so that a pool whose buffers moved since (or one not
affine after all) falls back to the pool's own answer: a wrong address would copy
another page's bytes.
"""

import numpy as np
import torch

from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

# Pages of a pool `HostPageRuns.learn` checks its model against, at most: SGLang's loop
# costs ~0.7 us a run (a layer-first page of 32 layers has 64 runs), so at most about
# 0.2 s at registration.
LEARN_PAGES = 4096


class HostPageRuns:
    """The runs of a host pool's pages (`get_page_buffer_meta`), computed from an affine
    model of the pool's own answers when that model holds, else asked of the pool.

    Attributes:
        pool: the host pool (SGLang's `HostKVCache`, or anything with `page_size` and
            `get_page_buffer_meta(indices) -> (addresses, sizes)`).
        page_size: tokens per page.
        sizes: bytes of each run of one page, `runs_per_page` ints (the same for
            every page).
        base / stride: int64 `[runs_per_page]`, the model (`address_j(index) =
            base[j] + index * stride[j]`, index a page's first token index); None
            when the pool is not affine (every batch asks the pool).
        limit: token indices the model covers, `[0, limit)` (the pool's pages).
    """

    def __init__(self, pool, page_size: int, sizes: list[int],
                 base: np.ndarray | None = None, stride: np.ndarray | None = None,
                 limit: int = 0):
        self.pool, self.page_size, self.sizes = pool, page_size, sizes
        self.base, self.stride, self.limit = base, stride, limit

    @property
    def runs_per_page(self) -> int:
        """Runs per page: 2 for MHA page-first (K and V), 2 * layers layer-first."""
        return len(self.sizes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (the sum of its runs)."""
        return sum(self.sizes)

    @classmethod
    def learn(cls, pool) -> "HostPageRuns":
        """Ask `pool` for the runs of its pages (`pool.size` tokens; one call) and keep
        the affine model when it gives exactly those runs.

        A pool of more than LEARN_PAGES pages (SGLang's page size may be 1 token) is
        asked for LEARN_PAGES of them spread over the pool (its first and last among
        them) and for its second page. Without a `size` attribute, with fewer than two
        pages, when the pool refuses one of those pages, or with runs whose sizes differ
        from page to page or whose addresses are not affine, every batch asks the pool
        (logged here, at debug level).
        """
        page_size = int(pool.page_size)
        _, first_sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        sizes = [int(n) for n in first_sizes]
        m = len(sizes)
        num_pages = int(getattr(pool, "size", 0)) // page_size
        model = None
        if num_pages >= 2:
            pages = np.unique(np.concatenate([[0, 1], np.linspace(
                0, num_pages - 1, min(num_pages, LEARN_PAGES), dtype=np.int64)]))
            starts = pages * page_size
            indices = torch.from_numpy(
                (starts[:, None] + np.arange(page_size, dtype=np.int64)).reshape(-1))
            try:
                addresses, all_sizes = pool.get_page_buffer_meta(indices)
            except Exception as exc:  # a pool that refuses some of its own pages
                logger.debug("host pool %s: get_page_buffer_meta of %d pages failed (%s)",
                             type(pool).__name__, len(pages), exc)
                addresses = all_sizes = []
            if (addresses and len(addresses) == len(all_sizes) == len(pages) * m
                    and all(int(n) == sizes[i % m] for i, n in enumerate(all_sizes))):
                table = np.asarray(addresses, dtype=np.int64).reshape(len(pages), m)
                base, step = table[0], table[1] - table[0]
                if not (step % page_size).any():
                    stride = step // page_size
                    if np.array_equal(base + starts[:, None] * stride, table):
                        model = (base.copy(), stride, num_pages * page_size)
        if model is None:
            logger.debug("host pool %s: page runs are asked of the pool for every batch "
                         "(no affine model of its %d pages)", type(pool).__name__, num_pages)
            return cls(pool, page_size, sizes)
        return cls(pool, page_size, sizes, *model)

    def runs(self, host_indices: torch.Tensor, num_pages: int) -> list[list[tuple[int, int]]]:
        """Per page of the batch, its (address, bytes) runs in the pool.

        Args:
            host_indices: int64 `[num_pages * page_size]` host pool token indices (the
                caller checked the length).
            num_pages: pages in the batch, >= 1.

        Returns:
            `num_pages` lists of `runs_per_page` (address, bytes) tuples, in
            `get_page_buffer_meta` order.
        """
        m = self.runs_per_page
        if self.base is not None:
            starts = np.asarray(host_indices[:: self.page_size].tolist(), dtype=np.int64)
            if (not (starts % self.page_size).any() and 0 <= starts.min()
                    and starts.max() < self.limit
                    and self._agrees(host_indices, num_pages, starts)):
                table = (self.base + starts[:, None] * self.stride).tolist()
                sizes = self.sizes
                return [list(zip(row, sizes)) for row in table]
            logger.warning("host pool %s: a batch's page runs are not those it gave at "
                           "registration (its buffers moved, or indices outside its pages"
                           "); asking the pool for every batch from now on",
                           type(self.pool).__name__)
            self.base = self.stride = None
        addresses, sizes = self.pool.get_page_buffer_meta(host_indices)
        return [list(zip(addresses[i * m:(i + 1) * m], sizes[i * m:(i + 1) * m]))
                for i in range(num_pages)]

    def _agrees(self, host_indices: torch.Tensor, num_pages: int, starts: np.ndarray) -> bool:
        """Whether the pool's own runs of the batch's first and last page are the
        model's."""
        ps = self.page_size
        for page in {0, num_pages - 1}:
            page_indices = host_indices[page * ps:(page + 1) * ps]
            addresses, _ = self.pool.get_page_buffer_meta(page_indices)
            if list(addresses) != (self.base + starts[page] * self.stride).tolist():
                return False
        return True
