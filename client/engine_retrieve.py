"""The read half of CacheEngine: acquire, retrieve, retrieve_views.

Why this file exists: client/engine.py grew past 500 lines; `EngineRetrieve` is a part of
`CacheEngine` with no state of its own (it reads the engine's layout, chain, copier,
pinned lookups and hit counters), as `DiskWrites` is a part of `DiskTier`. A retrieve is
one daemon round trip (ACQUIRE; its RELEASE is sent without waiting for a reply), or none
after a pinned `lookup` of the same tokens.
"""

import numpy as np
import torch

from lmcached.client.chain import PinnedChunks
from lmcached.client.hashing import Tokens, as_token_array, hash_request_tokens, root_hash
from lmcached.client.kv_io import OrderedCopier, after_caller_stream, suffix_mask_skip
from lmcached.client.tiered_records import TieredRecords
from lmcached.client.retrieve import copy_records_out
from lmcached.client.views import RetrievedViews, SpannedRecord
from lmcached.wire.logger import init_logger

logger = init_logger("lmcached.client.engine")  # CacheEngine's messages under one name


class EngineRetrieve:
    """The read methods of `CacheEngine` (a part of it, no state of its own)."""

    def _acquire(self, token_array: np.ndarray, first_chunk: int,
                 salt: str | None = None) -> PinnedChunks | None:
        """ACQUIRE and check the cached run of chunks from chunk `first_chunk` under cache
        salt `salt` (`Chain.acquire`); None when the daemon is unavailable or refused."""
        all_hashes = hash_request_tokens(self.layout.chunk_size, token_array, salt)
        hashes = all_hashes[first_chunk:]
        if not hashes:
            return None
        parent = all_hashes[first_chunk - 1] if first_chunk else root_hash(salt)
        return self.chain.acquire(token_array, first_chunk, hashes, parent, salt)

    def _pinned(self, token_array: np.ndarray, skip: int,
                salt: str | None = None) -> PinnedChunks | None:
        """The pinned run for a retrieve: a pinned lookup of these tokens, else an ACQUIRE.

        A pinned lookup is used only while its pins still hold (its session is the
        link's open one) and its records still hold its chunks; otherwise it is dropped
        (counted in `num_stale_pins`) and the chunks are ACQUIREd again: its blocks may
        have been reused for another prompt since the lookup.
        """
        run = (self._pinned_lookups.take(token_array, salt) if len(self._pinned_lookups)
               else None)
        if run is not None:
            if run.holds_pins() and run.records_match():
                return run
            self._drop_stale(run)
        return self._acquire(token_array, skip // self.layout.chunk_size, salt)

    def _drop_stale(self, run: PinnedChunks) -> None:
        """Give up a pinned run whose pins no longer hold (counted, warned once)."""
        run.release()
        self.num_stale_pins += 1
        if not self._warned_stale:
            self._warned_stale = True
            logger.warning(
                "chunks pinned in daemon session %d were released before they were read "
                "(the session ended: a timeout, --idle-timeout, or a restart): read again "
                "from the daemon; further cases are only counted", run.session_id,
            )

    def acquire(self, tokens: Tokens, cache_salt: str | None = None) -> PinnedChunks | None:
        """Pin the cached chunk chain of `tokens` (from position 0) for reading in place.

        The lower-level read under `retrieve` and `retrieve_views`, for callers that
        gather from the arena blocks themselves (CacheBlend's retriever reads one layer
        at a time). A pinned lookup of the same tokens is taken over.

        Args:
            tokens: `[num_tokens]` token ids.
            cache_salt: the request's cache salt, or None (see `lookup`).

        Returns:
            The pinned, verified run (`spans`: block ids per chunk; `chunks`: its
            `[start, end)` token ranges; `records.kv_view(block_id, n)` reads a chunk in
            place), or None when the daemon is unavailable. The caller must call
            `.release()` when done reading; until then the blocks are neither evicted
            nor rewritten.
        """
        return self._pinned(as_token_array(tokens), 0, cache_salt)

    def retrieve(self, tokens: Tokens, mask=None, return_tuple: bool = True, out=None,
                 cache_salt: str | None = None):
        """Copy out the KV of the longest cached prefix of `tokens` (after the mask).

        Seed semantics (LMCache's `LMCacheEngine.retrieve`): the mask is a suffix mask
        of any length; the chunks from the one holding the first masked-in token are
        looked up, and the masked tokens of that first chunk are dropped from the result.

        Args:
            tokens: `[num_tokens]` token ids.
            mask: optional bool suffix mask `[num_tokens]`: False for the leading
                `skip` tokens not to retrieve, then True. `skip` need not be a
                multiple of chunk_size.
            return_tuple: True: a tuple of per-layer (K, V), each `[n, num_kv_heads,
                head_size]` (vllm) or `[num_kv_heads, n, head_size]` (huggingface);
                False: one blob `layout.chunk_shape(n)`.
            out: optional destination with room for every retrieved token: a blob
                (token dim >= n) or a tuple of per-layer (K, V) buffers; results are
                views of it (no allocation). A CUDA `out` is written after the work
                queued on the caller's current stream (`kv_io.after_caller_stream`).
            cache_salt: the request's cache salt, or None (see `lookup`).

        Returns:
            (kv, ret_mask): kv holds the n tokens `tokens[skip : skip + n]`, or is the
            empty tuple `()` when nothing was found (whatever return_tuple is, as in the
            seed); ret_mask is a bool tensor `[num_tokens]`, True for those n tokens.

        Raises:
            ValueError: a mask that is not a suffix mask of `[num_tokens]`, or `out` too
                small / of the wrong shape or dtype.
        """
        token_array = as_token_array(tokens)
        num_tokens = len(token_array)
        skip = suffix_mask_skip(mask, num_tokens)
        ret_mask = torch.zeros(num_tokens, dtype=torch.bool)
        run = self._pinned(token_array, skip, cache_salt) if num_tokens > skip else None
        if run is None:
            self.miss_tokens += num_tokens - skip
            return (), ret_mask
        try:
            spans, chunks = run.from_chunk(skip // self.layout.chunk_size)
            num_hit = chunks[-1][1] - skip if chunks else 0
            copier = self.copier if out is None else OrderedCopier(
                self.copier, after_caller_stream(out[0][0] if isinstance(out, (tuple, list))
                                                 else out))
            kv = copy_records_out(run.records, copier, spans, chunks, skip, num_hit,
                                  return_tuple, out) if num_hit else ()
            run.records.synchronize()  # copies out of a GPU tier end before its RELEASE
            if num_hit and not run.holds_pins():  # the blocks may have been reused meanwhile
                self._drop_stale(run)
                kv, num_hit = (), 0
        finally:
            run.release()
        self.hit_tokens += num_hit
        self.miss_tokens += num_tokens - skip - num_hit
        ret_mask[skip : skip + num_hit] = True
        return kv, ret_mask

    def retrieve_views(self, tokens: Tokens, mask=None,
                       cache_salt: str | None = None) -> RetrievedViews:
        """Pin the cached prefix and return zero-copy views of its arena blocks.

        Use as a context manager; the blocks stay pinned (never evicted or reused)
        until exit. `.chunks` raises after exit; tensors taken from it before then
        must not be used afterwards (their bytes may be reused). With
        verify="checksum" the payloads are checked once, here; the views then read the
        arena in place.

        The mask has `retrieve`'s semantics: a suffix mask of any length; the first
        view starts at the first masked-in token (a narrowed view of its chunk).
        `cache_salt`: the request's cache salt, or None (see `lookup`).

        Returns:
            RetrievedViews with `.chunks` (one tensor per chunk,
            `layout.chunk_shape(chunk_tokens)`, layout.dtype, cpu (arena); the first
            one without the masked tokens of its chunk), `.layer(i)`, `.num_tokens`,
            `.start_token` (the mask's skip), `.block_ids`. A chunk whose record spans
            several blocks (the daemon's block is smaller than its record) is read
            layer by layer (`SpannedRecord`): only layers crossing a block boundary,
            and `.chunks`, copy.

        Raises:
            ValueError: bad mask.
        """
        layout = self.layout
        token_array = as_token_array(tokens)
        skip = suffix_mask_skip(mask, len(token_array))
        run = self._pinned(token_array, skip, cache_salt) if len(token_array) > skip else None
        if run is None:
            self.miss_tokens += len(token_array) - skip
            return RetrievedViews([], [], skip, 0, None)
        spans, chunks = run.from_chunk(skip // layout.chunk_size)
        records = run.records
        views = []
        for span, (start, end) in zip(spans, chunks):
            first = max(skip - start, 0)  # masked tokens of the first chunk
            if len(span) > 1:
                views.append(SpannedRecord(records, span, end - start, first))
            else:
                view = records.kv_view(span[0], end - start)
                views.append(view.narrow(layout.token_dim, first, end - start - first)
                             if first else view)
        num_hit = chunks[-1][1] - skip if chunks else 0
        self.hit_tokens += num_hit
        self.miss_tokens += len(token_array) - skip - num_hit
        if isinstance(records, TieredRecords):  # views of a GPU tier: queued reads first
            def release() -> None:
                records.synchronize()
                run.release()
        else:
            release = run.release
        return RetrievedViews(views, [b for span in spans for b in span], skip, num_hit,
                              release, layout.token_dim, self.copier, run.holds_pins)
