"""Reading and writing chunk records in arena blocks (layout in `client/layout.py`).

Why this file exists: the engine, the vLLM connector and CacheBlend all need the same
three things from a block id: write a chunk's record, check that a record holds the
tokens a reader asked for, and view or copy its KV. A record that fits in one block
(the normal case: the daemon sizes blocks from the first layout) is written and read in
place; a record spanning several blocks goes through a contiguous temporary buffer.
It also seals a record with its payload checksum and checks one (`seal`,
`checksum_ok`): the opt-in integrity check of the trust model (README, "Trust model").
"""

import functools
from typing import Callable

import numpy as np
import torch
import xxhash

from lmcached.client.kv_io import KVSource
from lmcached.client.layout import (
    CHECKSUM_XXH3_64,
    RECORD_CHECKSUM,
    RECORD_HEADER,
    RECORD_HEADER_BYTES,
    RECORD_MAGIC,
    KVLayout,
)
from lmcached.wire.record_format import record_matches, write_header
from lmcached.shm.arena import Arena


class RecordIO:
    """Chunk records of one layout in one arena (one per arena generation).

    Args:
        arena: the attached arena.
        layout: the KV layout of the records.
        fingerprint: the 64-bit identity written into each record header (default
            `layout.fingerprint`); a writer whose KV bytes depend on more than the
            layout (the vLLM connector's paged-block format) passes its own.
    """

    def __init__(self, arena: Arena, layout: KVLayout, fingerprint: int | None = None) -> None:
        self.arena = arena
        self.layout = layout
        self.fingerprint = layout.fingerprint if fingerprint is None else fingerprint
        self._u8 = arena.numpy_view(0, arena.capacity_bytes)  # [capacity_bytes] uint8
        self._kv_offset = layout.kv_offset
        self._dtype = layout.torch_dtype
        self._all_full_chunks: torch.Tensor | None = None
        self._headers: np.ndarray | None = None

    @classmethod
    def for_arena(cls, current: "RecordIO | None", arena: Arena, layout: KVLayout,
                  fingerprint: int | None = None) -> "RecordIO":
        """`current` when it reads `arena`, else a new reader (a restarted daemon's arena).

        Its views of every block are built once per arena generation, so callers keep one
        reader and pass it back here with each snapshot's arena.
        """
        if current is not None and current.arena is arena:
            return current
        return cls(arena, layout, fingerprint)

    # ------------------------------------------------------------------ write
    def write(
        self,
        span: list[int],
        chunk_hash: bytes,
        chunk_tokens: np.ndarray,
        source: KVSource,
        src_start: int,
        src_end: int,
    ) -> None:
        """Write one chunk's record into the blocks of `span` (WRITING blocks).

        Args:
            span: block ids of the value, from ALLOC.
            chunk_hash: the chunk's 16-byte prefix hash.
            chunk_tokens: int64 `[t]` token ids of the chunk.
            source: the request's KV.
            src_start / src_end: the chunk's token range in `source`.
        """
        self.write_with(span, chunk_hash, chunk_tokens,
                        functools.partial(source.copy_chunk, src_start, src_end))

    def write_with(
        self,
        span: list[int],
        chunk_hash: bytes,
        chunk_tokens: np.ndarray,
        fill: Callable[[torch.Tensor], None],
    ) -> None:
        """Write one chunk's record whose KV bytes come from the caller's `fill(dst)`.

        Args:
            span: block ids of the value, from ALLOC.
            chunk_hash: the chunk's 16-byte prefix hash.
            chunk_tokens: int64 `[t]` token ids of the chunk.
            fill: writes the chunk's KV into `dst`, a contiguous
                `layout.chunk_shape(t)` tensor of layout.dtype, cpu (the arena, or a
                temporary buffer when the record spans several blocks).
        """
        t = len(chunk_tokens)
        shape = self.layout.chunk_shape(t)
        if len(span) == 1:
            base = self.arena.block_offset(span[0])
            self._write_header(self._u8[base : base + self._kv_offset], chunk_hash, chunk_tokens)
            fill(self.arena.view(span[0], self._dtype, shape, offset_bytes=self._kv_offset))
            return
        record = np.empty(self.layout.record_bytes(t), dtype=np.uint8)
        self._write_header(record[: self._kv_offset], chunk_hash, chunk_tokens)
        fill(torch.from_numpy(record[self._kv_offset :]).view(self._dtype).view(shape))
        scatter(self.arena, span, [record])

    def _write_header(self, header: np.ndarray, chunk_hash: bytes, chunk_tokens: np.ndarray) -> None:
        write_header(header, self.fingerprint, chunk_hash, chunk_tokens)

    def synchronize(self) -> None:
        """Nothing to wait for: host records are written and read synchronously (the
        counterpart of `DeviceRecordIO.synchronize`)."""

    # -------------------------------------------------------------- integrity
    def seal(self, span: list[int], num_tokens: int) -> None:
        """Write the payload checksum of the record in `span` into its header.

        Call after the record's bytes are final (after `write`/`write_with`, and after
        any device-to-host copy into them completed) and before COMMIT.

        Args:
            span: block ids of the record (WRITING blocks of this session).
            num_tokens: tokens of the record's chunk.
        """
        checksum = self.checksum(span, num_tokens)
        base = self.arena.block_offset(span[0])
        RECORD_CHECKSUM.pack_into(self._u8, base + RECORD_HEADER.size,
                                  CHECKSUM_XXH3_64, 0, checksum)

    def checksum_ok(self, span: list[int], num_tokens: int) -> bool:
        """True when the record in `span` carries a payload checksum and it matches.

        Checks the bytes as they are now (the caller holds the blocks pinned, so no
        writer is handed them). A record written without a checksum is False.
        """
        base = self.arena.block_offset(span[0])
        kind, _, stored = RECORD_CHECKSUM.unpack_from(self._u8, base + RECORD_HEADER.size)
        return kind == CHECKSUM_XXH3_64 and stored == self.checksum(span, num_tokens)

    def checksum(self, span: list[int], num_tokens: int) -> int:
        """xxh3-64 of the record's identity || token ids || KV bytes, read in place.

        The identity and token ids are covered so that a checksum vouches for this
        chunk's KV only: a valid record copied under another chunk's header fails.
        xxhash releases the GIL, so records are checked in parallel on copy threads.
        """
        digest = xxhash.xxh3_64()
        for start, end in ((0, RECORD_HEADER.size),
                           (RECORD_HEADER_BYTES, RECORD_HEADER_BYTES + 8 * num_tokens),
                           (self._kv_offset, self.layout.record_bytes(num_tokens))):
            for piece in self.pieces(span, start, end):
                digest.update(piece)
        return digest.intdigest()

    def pieces(self, span: list[int], start: int, end: int) -> list[np.ndarray]:
        """Bytes [start, end) of the record in `span`, as uint8 views of the arena.

        One view per block the range touches (a record larger than a block spans
        several), in order; nothing is copied.
        """
        block_bytes = self.arena.block_bytes
        pieces = []
        while start < end:
            index, offset = divmod(start, block_bytes)
            n = min(end - start, block_bytes - offset)
            base = self.arena.block_offset(span[index]) + offset
            pieces.append(self._u8[base : base + n])
            start += n
        return pieces

    # ------------------------------------------------------------------- read
    def verify(
        self, span: list[int], chunk_hash: bytes, chunk_tokens: np.ndarray, fingerprint: int
    ) -> bool:
        """True when the record in `span` holds exactly this chunk (hash, layout, tokens).
        False too for a block this arena does not have (a device tier's reference, which
        the daemon never hands a session that did not map the tier)."""
        if not 0 <= span[0] < self.arena.num_blocks:
            return False
        t = len(chunk_tokens)
        if len(span) == 1:
            base = self.arena.block_offset(span[0])
            header = self._u8[base : base + RECORD_HEADER_BYTES + 8 * t]
        else:
            header = gather(self.arena, span, RECORD_HEADER_BYTES + 8 * t)
        return record_matches(header, chunk_hash, chunk_tokens, fingerprint)

    def verify_prefix(
        self,
        spans: list[list[int]],
        chunk_hashes: list[bytes],
        token_array: np.ndarray,
        chunks: list[tuple[int, int]],
        fingerprint: int,
    ) -> int:
        """How many leading records of `spans` hold exactly their chunk (see `verify`).

        Full one-block records are checked together with a few numpy operations
        (~1 us a chunk against ~2.5 us one by one); the rest one by one.

        Args:
            spans: block ids per chunk, as pinned by ACQUIRE.
            chunk_hashes / chunks: the request's hashes and [start, end) token ranges,
                aligned with `spans`.
            token_array: the request's int64 token ids.
            fingerprint: the expected layout fingerprint.
        """
        chunk_size = self.layout.chunk_size
        num_fast = 0
        for span, (start, end) in zip(spans, chunks):
            if len(span) != 1 or end - start != chunk_size:
                break
            num_fast += 1
        if num_fast > 1:
            try:
                headers = self._all_headers()[[span[0] for span in spans[:num_fast]]]
            except IndexError:  # a block this arena does not have: `verify` stops there
                return self._verify_from(0, spans, chunk_hashes, token_array, chunks,
                                         fingerprint)
            expected = np.frombuffer(
                b"".join(RECORD_HEADER.pack(RECORD_MAGIC, chunk_size, fingerprint, h)
                         for h in chunk_hashes[:num_fast]),
                dtype=np.uint8,
            ).reshape(num_fast, RECORD_HEADER.size)
            first = chunks[0][0]
            tokens = token_array[first : first + num_fast * chunk_size].reshape(num_fast, chunk_size)
            ok = (headers[:, : RECORD_HEADER.size] == expected).all(axis=1)
            ok &= (headers[:, RECORD_HEADER_BYTES:].view(np.int64) == tokens).all(axis=1)
            if not ok.all():
                return int(ok.argmin())
        else:
            num_fast = 0
        return self._verify_from(num_fast, spans, chunk_hashes, token_array, chunks,
                                 fingerprint)

    def verify_leading_slots(self, block_ids: list[int], chunk_hashes: list[bytes],
                             chunk_tokens: np.ndarray, num_slots: int) -> int:
        """How many leading one-block full-chunk records at `block_ids` hold this header
        (magic, token count, `self.fingerprint`, chunk hash) and these first `num_slots`
        token ids; the token ids after them are not read.

        For writers whose token ids past `num_slots` are zero padding of an identity
        held in the first ones (SGLang's page keys, `client/sglang/pages.py`): then it
        decides as `verify_prefix` on every record written as `write_header` writes
        them, comparing `num_slots` token ids instead of `chunk_size`. One gather and
        two comparisons for the whole batch.

        Args:
            block_ids: the one block of each record, as pinned by ACQUIRE.
            chunk_hashes: each record's 16-byte chunk hash, aligned.
            chunk_tokens: int64 `[len(block_ids), >= num_slots]` token ids, aligned.
            num_slots: token ids compared per record, 0 < num_slots <= chunk_size.

        Returns:
            The count; a block this arena does not have stops it, as in `verify`.

        Raises:
            ValueError: num_slots out of range.
        """
        n = len(block_ids)
        chunk_size = self.layout.chunk_size
        if not 0 < num_slots <= chunk_size:
            raise ValueError(f"num_slots={num_slots}: compare 1..{chunk_size} token ids")
        num_blocks = self.arena.num_blocks
        mapped = next((i for i, b in enumerate(block_ids) if not 0 <= b < num_blocks), n)
        if mapped < n:  # a block this arena does not have: `verify` stops there
            return self.verify_leading_slots(block_ids[:mapped], chunk_hashes[:mapped],
                                             chunk_tokens[:mapped], num_slots)
        rows = self._all_headers()[:, : RECORD_HEADER_BYTES + 8 * num_slots][block_ids]
        fixed = np.frombuffer(RECORD_HEADER.pack(RECORD_MAGIC, chunk_size, self.fingerprint,
                                                 bytes(16))[:16], dtype=np.uint8)
        hashes = np.frombuffer(b"".join(chunk_hashes), dtype=np.uint8).reshape(n, 16)
        ok = (rows[:, :16] == fixed).all(axis=1)
        ok &= (rows[:, 16 : RECORD_HEADER.size] == hashes).all(axis=1)
        ok &= (rows[:, RECORD_HEADER_BYTES:].view(np.int64)
               == chunk_tokens[:, :num_slots]).all(axis=1)
        return n if ok.all() else int(ok.argmin())

    def _verify_from(self, first: int, spans: list[list[int]], chunk_hashes: list[bytes],
                     token_array: np.ndarray, chunks: list[tuple[int, int]],
                     fingerprint: int) -> int:
        """`verify_prefix` one record at a time from record `first` on."""
        for i in range(first, len(spans)):
            start, end = chunks[i]
            if not self.verify(spans[i], chunk_hashes[i], token_array[start:end], fingerprint):
                return i
        return len(spans)

    def maps(self, block_ids: list[int]) -> bool:
        """True when every id in `block_ids` is a block of this arena (an ALLOC reply
        holding another tier's reference must not be written here)."""
        return not block_ids or max(block_ids) < self.arena.num_blocks

    def _all_headers(self) -> np.ndarray:
        """Header and token ids of every block's record: `[num_blocks, RECORD_HEADER_BYTES + 8*chunk_size]` uint8."""
        if self._headers is None:
            arena = self.arena
            start = arena.block_offset(0)
            self._headers = np.lib.stride_tricks.as_strided(
                self._u8[start:], shape=(arena.num_blocks, RECORD_HEADER_BYTES + 8 * self.layout.chunk_size),
                strides=(arena.block_bytes, 1), writeable=False,
            )
        return self._headers

    def kv_view(self, block_id: int, num_tokens: int) -> torch.Tensor:
        """Zero-copy KV of a one-block record: `layout.chunk_shape(num_tokens)`, cpu (arena)."""
        if num_tokens == self.layout.chunk_size and 0 <= block_id < self.arena.num_blocks:
            return self._full_chunk_views()[block_id]
        return self.arena.view(
            block_id, self._dtype, self.layout.chunk_shape(num_tokens), offset_bytes=self._kv_offset
        )

    def _full_chunk_views(self) -> torch.Tensor:
        """Every block's full-chunk KV as one strided tensor: indexing it is one cheap op.

        `[num_blocks, *layout.chunk_shape(chunk_size)]`, layout.dtype, cpu (arena).
        """
        if self._all_full_chunks is None:
            itemsize = self._dtype.itemsize
            arena = self.arena
            # Offsets are multiples of 64 and block_bytes of 64: exact in elements.
            flat = arena.block_view(0)[:0].view(self._dtype)  # aliases the arena's storage
            shape = self.layout.chunk_shape(self.layout.chunk_size)
            strides, step = [], 1
            for dim in reversed(shape):
                strides.append(step)
                step *= dim
            first = (arena.block_offset(0) + self._kv_offset) // itemsize
            self._all_full_chunks = torch.as_strided(
                flat, (arena.num_blocks, *shape),
                (arena.block_bytes // itemsize, *reversed(strides)),
                storage_offset=first,
            )
        return self._all_full_chunks

    def read_kv(self, span: list[int], num_tokens: int) -> torch.Tensor:
        """KV of a record: a view of the arena (one block) or a gathered copy (several)."""
        if len(span) == 1:
            return self.kv_view(span[0], num_tokens)
        record = gather(self.arena, span, self.layout.record_bytes(num_tokens))
        shape = self.layout.chunk_shape(num_tokens)
        return torch.from_numpy(record[self._kv_offset :]).view(self._dtype).view(shape)

    def layer_view(self, span: list[int], num_tokens: int, layer: int) -> torch.Tensor:
        """KV of one layer of a record: `layout.chunk_shape(num_tokens)[1:]`, cpu.

        Records are layer-major, so a layer is one run of bytes: a zero-copy view of the
        arena when that run lies in one block (always, for a one-block record), and a
        gathered copy only when it crosses a block boundary (a record larger than the
        daemon's block: at most `len(span) - 1` layers of it cross one).

        Args:
            span: block ids of the record, in order.
            num_tokens: tokens of the record's chunk.
            layer: 0 <= layer < layout.num_layers.
        """
        if len(span) == 1:
            return self.kv_view(span[0], num_tokens)[layer]
        shape = self.layout.chunk_shape(num_tokens)[1:]
        layer_bytes = self.layout.record_bytes(num_tokens) - self._kv_offset
        layer_bytes //= self.layout.num_layers
        start = self._kv_offset + layer * layer_bytes
        index, offset = divmod(start, self.arena.block_bytes)
        if offset + layer_bytes <= self.arena.block_bytes:
            return self.arena.view(span[index], self._dtype, shape, offset_bytes=offset)
        pieces = self.pieces(span, start, start + layer_bytes)
        return torch.from_numpy(np.concatenate(pieces)).view(self._dtype).view(shape)


def check_headers(headers: np.ndarray, chunk_hashes: list[bytes], token_array: np.ndarray,
                  chunks: list[tuple[int, int]], fingerprint: int) -> int:
    """How many leading records, given as header rows `[n, >= RECORD_HEADER_BYTES + 8 *
    tokens]` uint8 (gathered from a device tier), name exactly their chunk."""
    for i, (start, end) in enumerate(chunks):
        if not record_matches(headers[i], chunk_hashes[i], token_array[start:end], fingerprint):
            return i
    return len(chunks)


def scatter(arena: Arena, block_ids: list[int], parts: list[np.ndarray]) -> None:
    """Write the concatenation of uint8 `parts` across `block_ids`, in order."""
    block_bytes = arena.block_bytes
    block_index, offset = 0, 0
    for part in parts:
        pos = 0
        while pos < part.size:
            base = arena.block_offset(block_ids[block_index])
            n = min(block_bytes - offset, part.size - pos)
            arena.numpy_view(base + offset, n)[:] = part[pos : pos + n]
            pos += n
            offset += n
            if offset == block_bytes:
                block_index, offset = block_index + 1, 0


def gather(arena: Arena, block_ids: list[int], nbytes: int) -> np.ndarray:
    """Read the first `nbytes` spread over `block_ids` into a new uint8 array."""
    block_bytes = arena.block_bytes
    out = np.empty(nbytes, dtype=np.uint8)
    for i, block_id in enumerate(block_ids):
        start = i * block_bytes
        n = min(block_bytes, nbytes - start)
        if n <= 0:
            break
        out[start : start + n] = arena.numpy_view(arena.block_offset(block_id), n)
    return out
