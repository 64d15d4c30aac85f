"""Zero-copy views of pinned arena blocks, released when the caller is done.

A chunk whose record lies in one block is one view. A record larger than the daemon's
block (`--block-size` below the chunk record, or an arena too small to hold 16 whole
records) spans several blocks that the free queue hands out in any order, so no single
tensor can view it: it is a `SpannedRecord`, read layer by layer, each layer a view of
the arena unless it crosses a block boundary (then gathered). Placing such a record in
adjacent blocks instead would need a contiguous allocator beside vLLM's LRU free queue,
whose order is the eviction order: it would fragment, and evict out of LRU order to make
room.
"""

import dataclasses
import functools
from typing import Callable

import torch

from lmcached.client.cuda import synchronize_devices
from lmcached.client.kv_io import ChunkCopier, copy_tensor
from lmcached.client.records import RecordIO
from lmcached.client.retrieve import copy_record
from lmcached.client.tiered_records import TieredRecords
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


class PinsLost(RuntimeError):
    """The daemon session that pinned these blocks ended while they were read (a
    timeout, `--idle-timeout`, a restart): the bytes read may be another prompt's KV and
    must not be used. Recompute them, or retrieve again."""


@dataclasses.dataclass(frozen=True)
class SpannedRecord:
    """A viewed chunk whose record spans several blocks: read one layer at a time.

    Attributes:
        records: the reader of its arena (`RecordIO`, or `TieredRecords` with device
            tiers).
        span: its block ids, in record order.
        num_tokens: tokens of the record.
        first: the first viewed token in it (the mask's skip, in a first chunk).
    """

    records: RecordIO | TieredRecords
    span: list[int]
    num_tokens: int
    first: int = 0

    def layer(self, layer: int, token_dim: int) -> torch.Tensor:
        """One layer, `chunk_shape(num_tokens - first)[1:]`: a view of the arena unless
        it crosses a block boundary (a copy then). `token_dim` is the blob's."""
        kv = self.records.layer_view(self.span, self.num_tokens, layer)
        return kv.narrow(token_dim - 1, self.first, self.num_tokens - self.first)

    def gather(self, token_dim: int) -> torch.Tensor:
        """The whole chunk, `chunk_shape(num_tokens - first)`, copied out of its blocks."""
        kv = self.records.read_kv(self.span, self.num_tokens)
        return kv.narrow(token_dim, self.first, self.num_tokens - self.first)

    def copy_to(self, dst: torch.Tensor) -> None:
        """dst = the chunk, layer by layer (only layers that cross a block boundary go
        through a temporary). `dst`: `chunk_shape(num_tokens - first)`, any device."""
        copy_record(dst, self.records, self.span, self.num_tokens, self.first)


class RetrievedViews:
    """The cached prefix of a request as views of the arena, pinned until `release()`.

    Use as a context manager. While it is open and its pins hold, its blocks are never
    evicted or reused, so the views are stable; after exit `.chunks` raises, and tensors
    taken from it earlier must not be used (the daemon may hand their blocks to a
    writer). The pins hold as long as the engine's daemon session: a caller that reads
    the views directly asks `pins_held()` after reading (`copy_to` does).

    Every record in one block (the daemon's block holds a chunk record: the derived
    default for a >= 1 GiB arena): `.chunks` and `.layer(i)` are views, no copy. A
    record spanning several blocks (`SpannedRecord`): `.layer(i)` and `copy_to` still
    view every layer that lies in one block and gather only those that cross a block
    boundary; `.chunks` gathers such a chunk whole (once).

    Attributes:
        num_tokens: tokens covered by the views (0 on a miss).
        start_token: index of the first viewed token in the request (the mask's skip).
        block_ids: block ids pinned for these views.
    """

    def __init__(
        self,
        chunks: list[torch.Tensor | SpannedRecord],
        block_ids: list[int],
        start_token: int,
        num_tokens: int,
        release_fn: Callable[[], None] | None,
        token_dim: int = 2,
        copier: ChunkCopier | None = None,
        holds_fn: Callable[[], bool] | None = None,
    ) -> None:
        self._chunks = chunks  # a view per one-block record, else a SpannedRecord
        self._gathered: list[torch.Tensor] | None = None
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

    def _entries(self) -> list[torch.Tensor | SpannedRecord]:
        if self._released:
            raise RuntimeError("these views were released: their blocks may be reused")
        return self._chunks

    @property
    def chunks(self) -> list[torch.Tensor]:
        """One tensor per chunk, `layout.chunk_shape(chunk_tokens)`, cpu (arena memory):
        a view of a one-block record, a copy (gathered on first use) of a record that
        spans several blocks.

        Raises:
            RuntimeError: the views were released.
        """
        entries = self._entries()
        if self._gathered is None:
            self._gathered = [
                entry.gather(self._token_dim) if isinstance(entry, SpannedRecord) else entry
                for entry in entries
            ]
        return self._gathered

    def layer(self, layer: int) -> list[torch.Tensor]:
        """One layer of every chunk, each `chunk_shape(t)[1:]`, cpu (arena memory): views,
        except a layer crossing a block boundary of a record spanning several (copied).

        Raises:
            RuntimeError: the views were released.
        """
        return [entry.layer(layer, self._token_dim) if isinstance(entry, SpannedRecord)
                else entry[layer] for entry in self._entries()]

    def copy_to(self, out: torch.Tensor) -> torch.Tensor:
        """Copy every chunk into a blob `out` (token dim >= num_tokens), chunks in parallel.

        Returns:
            The first `num_tokens` tokens of `out` (a view).

        Raises:
            ValueError: `out` holds fewer tokens than the views, or another shape.
            RuntimeError: the views were released.
            PinsLost: the pins were lost while copying (`out` holds no usable KV).
        """
        entries = self._entries()
        if out.dim() != 5 or out.shape[self._token_dim] < self.num_tokens:
            raise ValueError(f"out of shape {tuple(out.shape)} cannot hold {self.num_tokens} tokens")
        tasks, start = [], 0
        for entry in entries:
            if isinstance(entry, SpannedRecord):
                n = entry.num_tokens - entry.first
                dst = out.narrow(self._token_dim, start, n)
                tasks.append(functools.partial(entry.copy_to, dst))
            else:
                n = entry.shape[self._token_dim]
                dst = out.narrow(self._token_dim, start, n)
                tasks.append(functools.partial(copy_tensor, dst, entry))
            start += n
        self._copier.run(tasks)
        # Both ends: views of a GPU tier copied into host memory land when their device
        # has run the copies, not `out`'s.
        synchronize_devices([out, *(e for e in entries if isinstance(e, torch.Tensor))])
        if not self.pins_held():
            raise PinsLost("the daemon session that pinned these views ended during the copy")
        return out.narrow(self._token_dim, 0, self.num_tokens)

    def release(self) -> None:
        """Unpin the blocks (idempotent)."""
        if self._released:
            return
        self._released = True
        self._chunks = []
        self._gathered = None
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
