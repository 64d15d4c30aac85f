"""The read side of the engine: pinned lookups, and copies out of records.

Why this file exists: `CacheEngine.retrieve`, `retrieve_views` and `lookup(pin=True)`
share one object, a run of verified chunk records pinned under daemon leases
(`PinnedChunks`, client/chain/). A pinned lookup keeps its run (`PinnedLookups`) so that the retrieve of
the same tokens that follows reuses its prefix hashes and its pins instead of hashing and
asking the daemon again: lookup then retrieve costs one synchronous round trip, as a
retrieve alone does (protocol v2: ACQUIRE answers a lease, RELEASE is sent without
waiting). After LMCache's `LMCacheEngine.lookup(..., pin=True)` / `lookup_unpin`.
"""

import functools
import threading

import numpy as np
import torch

from lmcached.client.chain import PinnedChunks
from lmcached.client.cuda import synchronize_if_cuda
from lmcached.client.kv_io import (
    ChunkCopier,
    check_out_blob,
    check_out_layers,
    copy_tensor,
    new_kv_buffer,
)
from lmcached.client.records import RecordIO
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

MAX_PINNED_LOOKUPS = 256  # pinned lookups kept per engine; the oldest is unpinned beyond


class PinnedLookups:
    """Pinned runs left by `lookup(tokens, pin=True)`, waiting for a retrieve of the same
    tokens (thread-safe).

    At most MAX_PINNED_LOOKUPS are kept: beyond, the oldest is unpinned (warned once), so
    a caller that pins and never retrieves cannot hold the arena forever.
    """

    def __init__(self) -> None:
        self._runs: dict[int, PinnedChunks] = {}  # insertion order = age
        self._next = 0
        self._lock = threading.Lock()
        self._warned = False

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, run: PinnedChunks) -> None:
        """Keep `run` until `take` or `drop` (unpinning the oldest beyond the bound)."""
        with self._lock:
            self._runs[self._next] = run
            self._next += 1
            oldest = None
            if len(self._runs) > MAX_PINNED_LOOKUPS:
                oldest = self._runs.pop(next(iter(self._runs)))
        if oldest is not None:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "more than %d pinned lookups were never retrieved: unpinning the oldest "
                    "(call lookup_unpin() for lookups you will not retrieve)", MAX_PINNED_LOOKUPS,
                )
            oldest.release()

    def take(self, tokens: np.ndarray, salt: str | None = None) -> PinnedChunks | None:
        """Remove and return the oldest pinned run of exactly these tokens and cache salt
        (a run pinned under another salt is another tenant's), if any."""
        with self._lock:
            for key, run in self._runs.items():
                if run.holds(tokens, salt):
                    del self._runs[key]
                    return run
        return None

    def drop(self, tokens: np.ndarray | None = None, salt: str | None = None) -> int:
        """Unpin the runs of `tokens` under cache salt `salt` (every run if `tokens` is
        None). Returns how many."""
        with self._lock:
            if tokens is None:
                dropped = list(self._runs.values())
                self._runs.clear()
            else:
                keys = [key for key, run in self._runs.items() if run.holds(tokens, salt)]
                dropped = [self._runs.pop(key) for key in keys]
        for run in dropped:
            run.release()
        return len(dropped)


def copy_records_out(records: RecordIO, copier: ChunkCopier, spans: list[list[int]],
                     chunks: list[tuple[int, int]], skip: int, num_hit: int,
                     return_tuple: bool, out):
    """Copy tokens `[skip, skip + num_hit)` of a request out of the records of its chunks.

    One copy per chunk (on the copier's threads) straight from the arena into the
    destination; the first chunk may start before `skip`: its leading tokens are
    dropped.

    Args:
        records: reader of the arena the spans are in.
        copier: threads that copy chunks in parallel.
        spans, chunks: block ids and `[start, end)` token range of each chunk.
        skip: the first token to return.
        num_hit: tokens to return (chunks[-1][1] - skip).
        return_tuple: return per-layer (K, V) views instead of one blob.
        out: None (allocate), a blob with token dim >= num_hit, or a tuple of per-layer
            (K, V) buffers.

    Returns:
        A blob `layout.chunk_shape(num_hit)`, or a tuple of per-layer (K, V) (views of
        `out` when given).

    Raises:
        ValueError: `out` too small, or of the wrong shape or dtype.
    """
    layout = records.layout
    token_dim = layout.token_dim
    if isinstance(out, (tuple, list)):
        layer_token_dim = token_dim - 2
        check_out_layers(out, layout, num_hit)

        def copy_to_layers(span, start, end):
            first = max(start, skip)
            # a one-block record (any tier) is one view; a longer one is read per layer
            whole = records.kv_view(span[0], end - start) if len(span) == 1 else None
            for layer, (k_out, v_out) in enumerate(out):
                kv = whole[layer] if whole is not None else \
                    records.layer_view(span, end - start, layer)
                # chunk_shape(end - first)[1:]: the layer without the tokens before `skip`
                kv = kv.narrow(layer_token_dim + 1, first - start, end - first)
                for dst, src in ((k_out, kv[0]), (v_out, kv[1])):
                    copy_tensor(dst.narrow(layer_token_dim, first - skip, end - first), src)

        copier.run([functools.partial(copy_to_layers, span, start, end)
                    for span, (start, end) in zip(spans, chunks)])
        synchronize_if_cuda(out[0][0])  # host-to-device copies done before RELEASE
        return tuple(
            (k.narrow(layer_token_dim, 0, num_hit), v.narrow(layer_token_dim, 0, num_hit))
            for k, v in out
        )
    if out is None:
        blob = new_kv_buffer(layout.chunk_shape(num_hit), layout.torch_dtype)
    else:
        check_out_blob(out, layout, num_hit)
        blob = out.narrow(token_dim, 0, num_hit)
    tasks = []
    for span, (start, end) in zip(spans, chunks):
        first = max(start, skip)
        dst = blob.narrow(token_dim, first - skip, end - first)
        tasks.append(functools.partial(copy_record, dst, records, span, end - start,
                                       first - start))
    copier.run(tasks)
    synchronize_if_cuda(blob)  # host-to-device copies done before RELEASE
    if return_tuple:
        return tuple((blob[layer, 0], blob[layer, 1]) for layer in range(layout.num_layers))
    return blob


def copy_record(dst: torch.Tensor, records: RecordIO, span: list[int], num_tokens: int,
                first: int) -> None:
    """dst = tokens [first, first + dst's token count) of the record of a `num_tokens` chunk.

    A one-block record is copied from its view; a record spanning several blocks layer
    by layer from `records.layer_view` (views, but for the layers that cross a block
    boundary), not gathered whole first: one copy of its bytes, not two.

    Args:
        dst: `layout.chunk_shape(n)`, any device.
        records: the reader of the record's arena.
        span: block ids of the record.
        num_tokens: tokens of the record.
        first: the record's first token to copy.
    """
    token_dim = records.layout.token_dim
    n = dst.shape[token_dim]
    if len(span) == 1:
        copy_tensor(dst, records.kv_view(span[0], num_tokens).narrow(token_dim, first, n))
        return
    for layer in range(records.layout.num_layers):
        copy_tensor(dst[layer],
                    records.layer_view(span, num_tokens, layer).narrow(token_dim - 1, first, n))
