"""CacheBlend's retriever: the cached KV of every separated segment of a prompt, by layer.

Why this file exists: a RAG prompt is a system prompt, retrieved documents and a
question, joined by a separator token that the caller inserts. Prefix caching finds
only the first segment; CacheBlend (Yao et al., EuroSys 2025) reuses every segment's KV
wherever it appears. This module splits the prompt on the separator, pins each
segment's cached chunk chain (stored from position 0, so its hash chain restarts at
h_{-1}: docs/architecture.md, "Chunk hashes") and hands the layer loop one layer of K
and V at a time, gathered straight from the pinned arena blocks. It follows LMCache's
`lmcache.blend.retriever.SPTBlendRetriever` (the version taking `spt` and
`query_start_loc`), with two differences:

- LMCache copies every segment's KV out of the cache, then concatenates all layers at
  the first `result()`. Here `new_request` only pins (one ACQUIRE per segment, all the
  daemon round trips there are), and `result(layer)` copies that layer's K and V of each
  chunk once, from the arena into the result: one copy per layer per chunk, none before
  the first `result()`, memory for one layer at a time.
- It splits on token ids the caller inserts (`spt_token_id`), never on a separator
  string re-tokenized, which LMCache's users found to tokenize differently in context
  or to keep a start-of-string token, so that nothing matched (LMCache issue #1136,
  PR #3228).

    prompt:    [ a a a a S | b b b S | c c c c c c S | q q ]     S = separator
    segments:   seg 0        seg 1     seg 2            seg 3    (each its own chain)
    cached:     a a a a S    b b b S   (miss)           (miss)
    valid:      1 1 1 1 1    1 1 1 1   0 0 0 0 0 0 0    0 0
    original:   0 1 2 3 4    0 1 2 3   0 0 0 0 0 0 0    0 0
"""

import dataclasses
import functools
import weakref
from typing import Sequence

import numpy as np
import torch

from lmcached.client.blend.interfaces import (
    BlendRetriever,
    BlendRetrieverResult,
    BlendRetrieverTask,
)
from lmcached.client.blend.segments import document_layouts
from lmcached.client.chain import PinnedChunks, release_all
from lmcached.client.cuda import synchronize_if_cuda
from lmcached.client.engine import CacheEngine
from lmcached.client.hashing import Tokens, as_token_array
from lmcached.client.kv_io import copy_tensor, new_kv_buffer
from lmcached.client.records import RecordIO
from lmcached.client.views import PinsLost
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


def _separator(spt: int | Sequence[int]) -> np.ndarray:
    """The separator as int64 `[len]` token ids (validated)."""
    if isinstance(spt, (bool, np.bool_)):
        raise TypeError("spt must be a token id (int) or a sequence of token ids, got a bool")
    if isinstance(spt, (int, np.integer)):
        return np.array([spt], dtype=np.int64)
    if isinstance(spt, torch.Tensor) and spt.dim() == 0:
        return as_token_array(spt.reshape(1))
    array = as_token_array(spt)
    if len(array) == 0:
        raise ValueError("spt is empty: pass the separator's token id(s), e.g. spt=128002")
    return array


def split_on_spt(tokens: Tokens, spt: int | Sequence[int]) -> list[tuple[int, int]]:
    """Cut `tokens` after each occurrence of the separator `spt`.

    Each segment runs up to and including its separator; what follows the last one is
    the final segment: `[x,x,x,S,y,y,S,z,z,z,z]` gives `[0, 4)`, `[4, 7)`, `[7, 11)`
    (LMCache's `SPTBlendRetriever._split_input_tokens`). A multi-token separator is
    matched left to right without overlap (LMCache's would cut twice inside `S S S`
    for the separator `S S`). No segment is empty.

    Args:
        tokens: int `[num_tokens]` token ids.
        spt: the separator: one token id, or a sequence of token ids.

    Returns:
        `[start, end)` ranges that tile `[0, num_tokens)` in order (empty for no tokens).

    Raises:
        TypeError: tokens or spt are not integers.
        ValueError: tokens not one-dimensional, or spt empty.
    """
    token_array = as_token_array(tokens)
    separator = _separator(spt)
    width = len(separator)
    if len(token_array) < width:
        candidates = np.empty(0, dtype=np.int64)
    elif width == 1:
        candidates = np.flatnonzero(token_array == separator[0])
    else:
        windows = np.lib.stride_tricks.sliding_window_view(token_array, width)
        candidates = np.flatnonzero((windows == separator).all(axis=1))
    segments, start = [], 0
    for match in candidates.tolist():
        if match >= start:  # not overlapping the separator just cut at
            segments.append((start, match + width))
            start = match + width
    if start < len(token_array):
        segments.append((start, len(token_array)))
    return segments


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """One verified, pinned chunk record and where its tokens go in the batch.

    `kv` is taken when the task is made: a view costs no copy, and it keeps the arena
    mapping alive, so that `result()` still reads these bytes after the engine has
    reconnected to a restarted daemon and unmapped the old arena.
    """

    dst_start: int  # first token of the chunk in the batch
    num_tokens: int
    span: list[int]  # block ids of the record
    records: RecordIO  # reader of the arena the blocks are in
    kv: torch.Tensor | None  # layout.chunk_shape(num_tokens), cpu (arena); None: several blocks


class SPTBlendRetrieverTask(BlendRetrieverTask):
    """The pinned, cached KV of one batch, read one layer at a time (see the module doc).

    Made by `SPTBlendRetriever.new_request`. Holds the blocks pinned (never evicted or
    rewritten) until `release()`, which a `with` block calls on exit; a task dropped
    unreleased is released when it is garbage-collected (with a warning).

    Attributes:
        valid_mask: bool `[num_tokens]`, cpu: True on each segment's retrieved prefix.
        original_positions: int64 `[num_tokens]`, cpu: index of the token in its segment
            where valid, else 0. Both are shared by every `result()`: do not modify.
        segments: `[start, end)` of every segment in the batch, in order.
        num_retrieved_tokens: tokens with retrieved KV (valid_mask.sum()).
    """

    def __init__(self, engine: CacheEngine, runs: list[PinnedChunks], chunks: list[_Chunk],
                 valid_mask: torch.Tensor, original_positions: torch.Tensor,
                 segments: list[tuple[int, int]], device: torch.device) -> None:
        self._engine = engine
        self._chunks = chunks
        self._device = device
        self.valid_mask = valid_mask
        self.original_positions = original_positions
        self.segments = segments
        self.num_retrieved_tokens = int(valid_mask.sum())
        self._runs = runs
        # The finalizer holds the runs, never the task, so that dropping the task frees it.
        self._finalizer = weakref.finalize(self, _release_runs, runs, garbage=True)

    def result(self, layer_id: int) -> BlendRetrieverResult:
        """K and V of layer `layer_id` for every input token, copied from the arena now.

        Each verified chunk's K and V of this layer are copied once, on the engine's
        copy threads, from the record in its block into the result (a record spanning
        several blocks, when the daemon's --block-size is smaller than a record, is
        viewed in place when the layer's bytes lie in one block, else gathered first:
        one layer of that chunk, never the whole record). On a CUDA device the copies are
        queued without blocking and synchronized before returning, so the result is
        ready on any stream and no copy is in flight when the pins are released.

        Args:
            layer_id: 0-based layer, < layout.num_layers; any order, any number of times.

        Returns:
            BlendRetrieverResult: k and v `[num_kv_heads, num_tokens, head_size]`
            (layout fmt huggingface, token axis 1) or `[num_tokens, num_kv_heads,
            head_size]` (fmt vllm, token axis 0), layout dtype, on the retriever's
            device, undefined where valid_mask is False; None when nothing was
            retrieved. valid_mask and original_positions as the task's attributes.

        Raises:
            TypeError: layer_id is not an int.
            IndexError: layer_id out of range.
            RuntimeError: the task was released (its blocks may hold other KV now).
            PinsLost: the daemon session that pinned the blocks ended (a timeout,
                `--idle-timeout`, a restart) before this layer was read: its bytes may be
                another prompt's KV. Make a new task (`new_request`), or recompute.
        """
        if not self._finalizer.alive:
            raise RuntimeError("this retriever task was released: its blocks may be reused; "
                               "call result() before release() or the end of the with block")
        layout = self._engine.layout
        if not isinstance(layer_id, (int, np.integer)) or isinstance(layer_id, bool):
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
        if not 0 <= layer_id < layout.num_layers:
            raise IndexError(f"layer_id {layer_id} out of range: the layout has "
                             f"{layout.num_layers} layers (0..{layout.num_layers - 1})")
        if not self._chunks:
            return BlendRetrieverResult(None, None, self.valid_mask, self.original_positions)
        num_tokens = len(self.valid_mask)
        shape = layout.chunk_shape(num_tokens)[2:]  # [H, T, D] huggingface / [T, H, D] vllm
        if self._device.type == "cpu":
            k = new_kv_buffer(shape, layout.torch_dtype)
            v = new_kv_buffer(shape, layout.torch_dtype)
        else:
            k = torch.empty(shape, dtype=layout.torch_dtype, device=self._device)
            v = torch.empty(shape, dtype=layout.torch_dtype, device=self._device)
        token_axis = layout.token_dim - 2
        self._engine.copier.run([functools.partial(_copy_layer, k, v, chunk, layer_id,
                                                   token_axis)
                                 for chunk in self._chunks])
        synchronize_if_cuda(k)
        if not all(run.holds_pins() for run in self._runs):  # blocks may have been reused
            raise PinsLost(f"the daemon session that pinned this task's blocks ended before "
                           f"layer {layer_id} was read: retrieve again or recompute")
        return BlendRetrieverResult(k, v, self.valid_mask, self.original_positions)

    def release(self) -> None:
        """Unpin every block of the task: one RELEASE frame, not waited for (idempotent)."""
        if self._finalizer.detach() is not None:
            _release_runs(self._runs, garbage=False)

    def __enter__(self) -> "SPTBlendRetrieverTask":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _num_hit(run: PinnedChunks) -> int:
    """Tokens of the verified prefix of a pinned run."""
    return run.chunks[-1][1] if run.chunks else 0


def _release_runs(runs: list[PinnedChunks], garbage: bool) -> None:
    """RELEASE the leases of `runs`, one frame per daemon session (never raises)."""
    if garbage:
        logger.warning("SPTBlendRetrieverTask garbage-collected unreleased: call release() "
                       "or use it as a context manager")
    release_all([run.pins for run in runs])


def _copy_layer(k: torch.Tensor, v: torch.Tensor, chunk: _Chunk, layer: int,
                token_axis: int) -> None:
    """Copy layer `layer` of one chunk's record into its token range (along `token_axis`)
    of `k` and `v`, moving the token axis where the record's format differs (a document
    found in the model's other namespace)."""
    kv = _layer_in_record(chunk, layer)  # [2, T, H, D] vllm / [2, H, T, D] huggingface
    if chunk.records.layout.token_dim - 2 != token_axis:
        kv = kv.transpose(1, 2)  # [2, *k.shape with num_tokens tokens], strided
    copy_tensor(k.narrow(token_axis, chunk.dst_start, chunk.num_tokens), kv[0])
    copy_tensor(v.narrow(token_axis, chunk.dst_start, chunk.num_tokens), kv[1])


def _layer_in_record(chunk: _Chunk, layer: int) -> torch.Tensor:
    """K and V of one layer of a chunk's record: `layout.chunk_shape(t)[1:]`, layout dtype, cpu.

    A view of the arena when the layer's bytes lie in one block (always, for a record in
    one block); otherwise gathered into a temporary buffer (`RecordIO.layer_view`).
    """
    if chunk.kv is not None:
        return chunk.kv[layer]
    return chunk.records.layer_view(chunk.span, chunk.num_tokens, layer)


class SPTBlendRetriever(BlendRetriever):
    """Finds the cached KV of every separated segment of a batch; LMCache's `SPTBlendRetriever`.

    The caller joins the segments of a prompt with a separator token (`spt`) that it
    inserts itself, and stores each segment's KV on its own, from position 0
    (`CacheEngine.store(segment_tokens, kv)`, or `store_segments`, or vLLM's blend
    worker). Each segment is looked up as its own chunk chain, so a document is found
    wherever it appears in a prompt, in either namespace that may hold the model's
    documents (client/blend/segments.py, "Where documents live"): the engine's own,
    then, for a segment it does not hold whole, the other one (a `sibling` session,
    opened on the first such segment).

    Args:
        spt: the separator: one token id (e.g. a reserved special token's id) or a
            sequence of token ids, as it appears in `input_tokens`.
        cache_engine: an engine of the model (made by `CacheEngine.connect`): its
            layout gives the results' format, its daemon holds the segments.
        device: where `result()` puts K and V (default cpu).

    Raises:
        TypeError / ValueError: spt is not a token id or a non-empty sequence of them.
    """

    def __init__(self, spt: int | Sequence[int], cache_engine: CacheEngine,
                 device: torch.device | str | None = None) -> None:
        self.spt = _separator(spt)
        self.cache_engine = cache_engine
        self.device = torch.device("cpu" if device is None else device)
        self._other_layout = document_layouts(cache_engine.layout)[1]

    def _acquire(self, tokens: np.ndarray, cache_salt: str | None) -> PinnedChunks | None:
        """Pin the longest cached chain of one segment: the engine's own namespace, then,
        unless it holds the whole segment, the model's other document namespace (the
        shorter run is released). None: the daemon is unavailable."""
        run = self.cache_engine.acquire(tokens, cache_salt=cache_salt)
        if run is None or _num_hit(run) >= len(tokens):
            return run
        try:
            try:
                other = self.cache_engine.sibling(self._other_layout)
            except ValueError as exc:  # an engine not made by CacheEngine.connect
                raise ValueError(
                    f"SPTBlendRetriever needs an engine made by CacheEngine.connect, to look "
                    f"for documents in {self._other_layout.model_name!r} "
                    f"({self._other_layout.fmt}) too: {exc}") from None
            found = other.acquire(tokens, cache_salt=cache_salt)
        except BaseException:
            release_all([run.pins])
            raise
        if found is None or _num_hit(found) <= _num_hit(run):
            if found is not None:
                release_all([found.pins])
            return run
        release_all([run.pins])
        return found

    def new_request(self, input_tokens: Tokens,
                    query_start_loc: torch.Tensor | Sequence[int],
                    cache_salt: str | None = None) -> SPTBlendRetrieverTask:
        """Pin and verify the cached chunks of every segment of a batch; copy nothing yet.

        Every request of the batch (query_start_loc boundaries always cut) is split with
        `split_on_spt`; each segment is ACQUIREd as its own chain from position 0
        (`CacheEngine.acquire`), in the engine's namespace, then, where that does not
        hold it whole, in the model's other document namespace: N segments are N to 2N
        synchronous round trips, all here, none in `result()` (protocol v2 ACQUIRE pins
        one chain per request). A segment is valid on its cached, verified chunks, a
        prefix of it (the longer of the two namespaces'). A daemon that is down or
        restarting retrieves nothing (no exception).

        Args:
            input_tokens: int `[num_tokens]` token ids of the whole batch.
            query_start_loc: int `[batch + 1]`: start of each request, then num_tokens
                (e.g. `torch.tensor([0, num_tokens])` for one request).
            cache_salt: the tenant's cache salt (vLLM's `cache_salt`): every segment is
                looked up under it, so that documents stored under one salt are never
                reused under another (`CacheEngine.lookup`); None: unsalted.

        Returns:
            The task; call `release()` (or use `with`) once every layer is read.

        Raises:
            TypeError: tokens or query_start_loc are not integers.
            ValueError: tokens not 1-D; query_start_loc not 1-D, not starting at 0, not
                ending at num_tokens, or decreasing; an engine not made by
                `CacheEngine.connect` missing a segment (the other namespace needs a
                `sibling` session).
        """
        tokens = as_token_array(input_tokens)
        starts = as_token_array(query_start_loc)
        num_tokens = len(tokens)
        if (len(starts) < 2 or starts[0] != 0 or starts[-1] != num_tokens
                or (np.diff(starts) < 0).any()):
            raise ValueError(
                f"query_start_loc must be [0, ..., {num_tokens}] (batch + 1 non-decreasing "
                f"request starts, ending at the number of tokens), got {starts.tolist()}"
            )
        segments = []
        for begin, end in zip(starts[:-1].tolist(), starts[1:].tolist()):
            segments += [(begin + start, begin + stop)
                         for start, stop in split_on_spt(tokens[begin:end], self.spt)]
        valid_mask = torch.zeros(num_tokens, dtype=torch.bool)
        original_positions = torch.zeros(num_tokens, dtype=torch.int64)
        runs: list[PinnedChunks] = []
        chunks: list[_Chunk] = []
        try:
            for begin, end in segments:
                run = self._acquire(tokens[begin:end], cache_salt)
                if run is None:
                    continue
                runs.append(run)
                for span, (start, stop) in zip(run.spans, run.chunks):
                    kv = run.records.kv_view(span[0], stop - start) if len(span) == 1 else None
                    chunks.append(_Chunk(begin + start, stop - start, span, run.records, kv))
                num_hit = _num_hit(run)
                valid_mask[begin : begin + num_hit] = True
                original_positions[begin : begin + num_hit] = torch.arange(num_hit)
        except BaseException:
            _release_runs(runs, garbage=False)
            raise
        return SPTBlendRetrieverTask(self.cache_engine, runs, chunks, valid_mask,
                                     original_positions, segments, self.device)

    def empty_request(self, num_tokens: int) -> SPTBlendRetrieverTask:
        """A task of one request of `num_tokens` tokens that reuses nothing (every token
        is recomputed; nothing is pinned): the fall-back when pinned KV was lost.

        Args:
            num_tokens: the request's length, >= 1.
        """
        return SPTBlendRetrieverTask(
            self.cache_engine, [], [], torch.zeros(num_tokens, dtype=torch.bool),
            torch.zeros(num_tokens, dtype=torch.int64), [(0, num_tokens)], self.device)
