"""Zero-copy views of pinned arena blocks, released when the caller is done."""

import functools
from typing import Callable

import torch

from lmcached.client.cuda import synchronize_if_cuda
from lmcached.client.kv_io import ChunkCopier, copy_tensor
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


class PinsLost(RuntimeError):
    """The daemon session that pinned these blocks ended while they were read (a
    timeout, `--idle-timeout`, a restart): the bytes read may be another prompt's KV and
    must not be used. Recompute them, or retrieve again."""


class RetrievedViews:
    """The cached prefix of a request as views of the arena, pinned until `release()`.

    Use as a context manager. While it is open and its pins hold, its blocks are never
    evicted or reused, so the views are stable; after exit `.chunks` raises, and tensors
    taken from it earlier must not be used (the daemon may hand their blocks to a
    writer). The pins hold as long as the engine's daemon session: a caller that reads
    the views directly asks `pins_held()` after reading (`copy_to` does).

    Attributes:
        num_tokens: tokens covered by the views (0 on a miss).
        start_token: index of the first viewed token in the request (the mask's skip).
        block_ids: block ids pinned for these views.
    """

    def __init__(
        self,
        chunks: list[torch.Tensor],
        block_ids: list[int],
        start_token: int,
        num_tokens: int,
        release_fn: Callable[[], None] | None,
        token_dim: int = 2,
        copier: ChunkCopier | None = None,
        holds_fn: Callable[[], bool] | None = None,
    ) -> None:
        self._chunks = chunks
        self._token_dim = token_dim
        self._copier = copier or ChunkCopier(1)
        self.block_ids = block_ids
        self.start_token = start_token
        self.num_tokens = num_tokens
        self._release_fn = release_fn
        self._holds_fn = holds_fn
        self._released = False

    def pins_held(self) -> bool:
        """Whether the blocks are still pinned: not released, and the daemon session that
        pinned them is still open (no request is sent). True after reading the views
        means what was read was the cached KV; False means it may not have been."""
        return not self._released and (self._holds_fn is None or self._holds_fn())

    @property
    def chunks(self) -> list[torch.Tensor]:
        """One tensor per chunk, `layout.chunk_shape(chunk_tokens)`, cpu (arena memory).

        Raises:
            RuntimeError: the views were released.
        """
        if self._released:
            raise RuntimeError("these views were released: their blocks may be reused")
        return self._chunks

    def layer(self, layer: int) -> list[torch.Tensor]:
        """Zero-copy views of one layer of every chunk, each `chunk_shape(t)[1:]`."""
        return [chunk[layer] for chunk in self.chunks]

    def copy_to(self, out: torch.Tensor) -> torch.Tensor:
        """Copy every chunk into a blob `out` (token dim >= num_tokens), chunks in parallel.

        Returns:
            The first `num_tokens` tokens of `out` (a view).

        Raises:
            ValueError: `out` holds fewer tokens than the views, or another shape.
            RuntimeError: the views were released.
            PinsLost: the pins were lost while copying (`out` holds no usable KV).
        """
        chunks = self.chunks
        if out.dim() != 5 or out.shape[self._token_dim] < self.num_tokens:
            raise ValueError(f"out of shape {tuple(out.shape)} cannot hold {self.num_tokens} tokens")
        tasks, start = [], 0
        for chunk in chunks:
            n = chunk.shape[self._token_dim]
            tasks.append(functools.partial(copy_tensor, out.narrow(self._token_dim, start, n), chunk))
            start += n
        self._copier.run(tasks)
        synchronize_if_cuda(out)
        if not self.pins_held():
            raise PinsLost("the daemon session that pinned these views ended during the copy")
        return out.narrow(self._token_dim, 0, self.num_tokens)

    def release(self) -> None:
        """Unpin the blocks (idempotent)."""
        if self._released:
            return
        self._released = True
        self._chunks = []
        if self._release_fn is not None:
            self._release_fn()

    def __enter__(self) -> "RetrievedViews":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        if not self._released and self._release_fn is not None:
            logger.warning("RetrievedViews garbage-collected unreleased: use it as a context manager")
            try:
                self.release()
            except Exception:  # never raise from a finalizer
                pass
