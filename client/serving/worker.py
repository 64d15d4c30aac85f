"""The worker side of the vLLM connector: copy whole vLLM blocks between the paged KV
cache and arena records.

Why this file exists: each vLLM worker (one per TP rank) loads the chunks the scheduler
planned into its paged KV cache before the forward pass, and stores new full chunks after
it. The paged cache's format differs between vLLM's CPU backend and its GPU backends, so
blocks are copied as opaque bytes (`PagedBlocks`) and the physical format is folded into
each record's fingerprint. vllm-free: the connector passes what it reads from vLLM.
Split from the connector after vLLM's NixlConnectorWorker / LMCache's worker adapter.
"""

from typing import Callable

import numpy as np
import torch
import xxhash

from lmcached.client.cuda import register_arena, synchronize_if_cuda, unregister_arena
from lmcached.client.chain import Chain, chunk_ranges
from lmcached.client.daemon_link import DaemonLink
from lmcached.client.records import RecordIO
from lmcached.client.serving.specs import ConnectorSettings, LoadSpec, SaveSpec
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


class PagedBlocks:
    """A worker's paged KV cache as raw bytes per (layer, vLLM block).

    Args:
        kv_caches: layer name -> that layer's cache, any shape whose dim 0 is the block
            index and whose other dims are one dense slab per block (true for every
            layout vLLM 0.32 builds: CPU `[num_blocks, num_kv_heads, block_size,
            2*head_size]` contiguous, GPU LBNHC views with permuted strides, ...).
        layer_names: the layers in record order.
        backend_names: layer name -> attention backend name (for the fingerprint).

    Attributes:
        page_bytes: bytes of one block of one layer.
        description: shapes, strides, dtype and backend (the physical format).

    Raises:
        ValueError: a layer is missing, or its blocks are not dense slabs of equal size.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], layer_names: list[str],
                 backend_names: dict[str, str]) -> None:
        self.layers: list[torch.Tensor] = []  # per layer: [num_blocks, page_bytes] uint8
        parts = []
        self.page_bytes = None
        for name in layer_names:
            if name not in kv_caches:
                raise ValueError(f"layer {name} has no registered KV cache")
            tensor = kv_caches[name]
            page_elems = _dense_slab_elems(tensor)
            if page_elems is None:
                raise ValueError(
                    f"layer {name}: blocks of shape {tuple(tensor.shape)} stride "
                    f"{tensor.stride()} are not dense slabs"
                )
            page_bytes = page_elems * tensor.element_size()
            if self.page_bytes not in (None, page_bytes):
                raise ValueError(f"layer {name}: {page_bytes}-byte pages, others {self.page_bytes}")
            self.page_bytes = page_bytes
            raw = torch.as_strided(tensor, (tensor.shape[0], page_elems), (tensor.stride(0), 1),
                                   tensor.storage_offset())
            self.layers.append(raw.view(torch.uint8))
            parts.append(f"{backend_names.get(name, '?')}:{tensor.dtype}:"
                         f"{tuple(tensor.shape[1:])}:{tensor.stride()[1:]}")
        self.device = self.layers[0].device
        # numpy views of the CPU cache: per-block np.copyto runs at ~18 GB/s here, against
        # ~2 GB/s for torch.index_select and 0.2 GB/s for index_copy_ (32 KiB-512 KiB pages).
        self._numpy = ([layer.numpy() for layer in self.layers]
                       if self.device.type == "cpu" else None)
        self.description = ";".join(parts)

    def gather(self, block_ids: list[int], dst: torch.Tensor) -> None:
        """Copy blocks into a record's KV bytes `dst` (cpu, any dtype, contiguous).

        On a GPU the copies are only queued: call wait() before the bytes are used."""
        record = dst.view(torch.uint8).view(len(self.layers), len(block_ids), self.page_bytes)
        if self._numpy is not None:
            out = record.numpy()  # [num_layers, blocks_per_chunk, page_bytes] uint8 (arena)
            for layer, blocks in zip(out, self._numpy):
                for j, block_id in enumerate(block_ids):
                    np.copyto(layer[j], blocks[block_id])
            return
        # GPU: one index_select per layer into a device staging buffer, then one copy of
        # the whole record (DMA when the arena is page-locked), instead of one small
        # copy per (layer, block). Queued only: wait() before the record is committed.
        staging = torch.empty(record.shape, dtype=torch.uint8, device=self.device)
        index = self._device_index(block_ids)
        for layer, blocks in zip(staging, self.layers):
            torch.index_select(blocks, 0, index, out=layer)
        record.copy_(staging, non_blocking=True)

    def scatter(self, src: torch.Tensor, offsets: list[int], block_ids: list[int]) -> None:
        """Copy a record's blocks at `offsets` into vLLM blocks `block_ids`.

        On a GPU the copies are only queued: call wait() before `src` may change."""
        record = src.view(torch.uint8).view(len(self.layers), -1, self.page_bytes)
        if self._numpy is not None:
            rec = record.numpy()  # [num_layers, blocks_per_chunk, page_bytes] uint8 (arena)
            for layer, blocks in zip(rec, self._numpy):
                for offset, block_id in zip(offsets, block_ids):
                    np.copyto(blocks[block_id], layer[offset])
            return
        # GPU: the record to the device in one copy, then one index_copy_ per layer.
        # Queued only: wait() before the record's pins are released.
        staging = record.to(self.device, non_blocking=True)
        if list(offsets) != list(range(staging.shape[1])):
            staging = staging[:, self._device_index(offsets)]
        index = self._device_index(block_ids)
        for layer, blocks in zip(staging, self.layers):
            blocks.index_copy_(0, index, layer)

    def _device_index(self, ids: list[int]) -> torch.Tensor:
        """int64 `[len(ids)]` on the cache's device, copied without a stream sync (a copy
        from pageable memory would wait for every queued copy first)."""
        return torch.tensor(ids, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)

    def wait(self) -> None:
        """Wait for the queued GPU copies of gather/scatter (no-op on CPU: they are done)."""
        synchronize_if_cuda(self.layers[0])


def _dense_slab_elems(tensor: torch.Tensor) -> int | None:
    """Elements of one block (tensor[i]) if it is a dense slab in some dim order, else None."""
    if tensor.dim() < 2 or any(s <= 0 for s in tensor.stride()):
        return None
    expected = 1
    for size, stride in sorted(zip(tensor.shape[1:], tensor.stride()[1:]), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return None
        expected *= size
    return expected


class LMCachedConnectorWorker:
    """Worker-side state of LMCachedConnector for one TP rank.

    Args:
        settings: the connector's settings.
        rank: this worker's TP rank (its namespace is settings.layouts[rank]).

    Attributes:
        num_loaded_tokens / num_saved_chunks / num_load_errors: counters of loads
            (tokens copied into vLLM blocks), stores (chunks committed) and failed loads
            (chunks reported to vLLM for recompute).
        num_recheck_failures: loads whose records changed while they were copied (their
            pins were lost: the changed chunks became load errors).
        chain: this rank's chunk chains (`Chain`: saves, record checks and their
            counters), None until `register`.
    """

    def __init__(self, settings: ConnectorSettings, rank: int) -> None:
        self.settings = settings
        self.rank = rank
        self.num_loaded_tokens = 0
        self.num_saved_chunks = 0
        self.num_load_errors = 0
        self.num_recheck_failures = 0
        self._link: DaemonLink | None = None
        self._paged: PagedBlocks | None = None
        self.chain: Chain | None = None
        self._load_errors: set[int] = set()
        self._failed_chunks: dict[str, int] = {}  # this step's failed loads
        self._failed_epochs: dict[str, int] = {}  # req_id -> epoch whose load failed

    def register(self, kv_caches: dict[str, torch.Tensor], layer_names: list[str],
                 backend_names: dict[str, str], spec_page_bytes: int) -> None:
        """Map the paged KV cache (shapes and strides as registered) and attach (the
        daemon session is opened once: a register after `unregister`, vLLM's wake-up
        from sleep mode, only maps the new tensors).

        Raises:
            ValueError: the caches are not dense per-block slabs of `spec_page_bytes`
                (the connector then idles).
        """
        layout = self.settings.layouts[self.rank]
        paged = PagedBlocks(kv_caches, layer_names, backend_names)
        if paged.page_bytes != spec_page_bytes:
            raise ValueError(f"registered pages of {paged.page_bytes} bytes, the spec says "
                             f"{spec_page_bytes}")
        self._paged = paged
        if self._link is not None:
            return
        fingerprint = xxhash.xxh3_64_intdigest(f"{layout.fingerprint}|{paged.description}".encode())
        # GPU blocks: page-lock the arena so copies run at pinned-memory speed (the
        # engine's cuda_register path); CPU blocks need nothing.
        hooks = (register_arena, unregister_arena) if paged.device.type == "cuda" else ()
        self._link = self.settings.open_link([self.rank], f"vllm-worker(rank {self.rank})",
                                             *hooks)
        self.chain = Chain(self._link, layout, self.settings.verify, fingerprint=fingerprint)
        logger.info("lmcached connector: rank %d/%d, %d layers, %d-byte pages, chunk %d tokens",
                    self.rank, self.settings.world_size, layout.num_layers, paged.page_bytes,
                    self.settings.chunk_size)

    @property
    def registered(self) -> bool:
        """Whether the worker maps vLLM's KV tensors now (False before `register` and
        between `unregister` and the next `register`)."""
        return self._paged is not None

    def unregister(self) -> None:
        """Drop every reference to vLLM's KV tensors (vLLM 0.33's sleep mode frees or
        unmaps them; vLLM's `unregister_kv_caches`). Idempotent.

        Copies queued on the device are waited for first, so none lands in freed memory.
        Until the next `register`, loads fail as load errors (vLLM recomputes them) and
        saves are skipped (a future miss): nothing reads or writes the freed memory. The
        daemon session and the arena's page-locking stay (they are lmcached's memory, not
        vLLM's).
        """
        if self._paged is not None:
            self._paged.wait()
            self._paged = None
            logger.info("lmcached connector: rank %d let go of vLLM's KV cache (sleep mode)",
                        self.rank)

    # ------------------------------------------------------------------ loads
    def load(self, loads: list[LoadSpec],
             agree: Callable[[list[int]], list[int]] | None = None) -> None:
        """Copy this step's planned chunks into their vLLM blocks (before the forward).

        Every chunk's record header (hash, token ids, fingerprint) and, with
        verify="checksum", its payload checksum are checked before it is copied
        (`Chain.check`), and the headers again once every copy is done: the scheduler's pins hold only
        while its daemon session does, and a writer given a block after they were lost
        writes the record's header first, so a record read while it was being replaced
        fails the second check. A chunk that fails, and every later chunk of its
        request, become load errors (vLLM recomputes them).

        Args:
            loads: the step's loads.
            agree: maps this rank's first failed chunk per load (-1: none) to the first
                failed on any rank (a TP collective); None with a single rank.
        """
        loaded = [self._load(load) for load in loads]
        if self._paged is not None:
            self._paged.wait()  # every scatter done before the scheduler releases the pins
        failed = [self._recheck(load, first_failed, records)
                  for load, (first_failed, records) in zip(loads, loaded)]
        if agree is not None:
            failed = agree(failed)
        for load, first_failed in zip(loads, failed):
            if first_failed < 0:
                continue
            for block_ids in load.block_ids[first_failed:]:
                self._load_errors.update(block_ids)
            self.num_load_errors += len(load.hashes) - first_failed
            self._failed_chunks[load.req_id] = load.first_chunk + first_failed
            self._failed_epochs[load.req_id] = load.epoch

    def _load(self, load: LoadSpec) -> tuple[int, RecordIO | None]:
        """Load one request's chunks: (index of the first that failed, or -1; the reader
        of the records copied, None when nothing was)."""
        snapshot = self._link.snapshot() if self._paged is not None else None
        if snapshot is None:
            return 0, None
        records = self.chain.records(snapshot)
        if load.generations[self.rank] != snapshot.generation:
            return 0, None  # pinned in another arena generation: those ids mean nothing now
        chunk = self.settings.chunk_size
        spans = load.spans[self.rank][: len(load.hashes)]
        num_ok = self.chain.check(records, spans, load.hashes[: len(spans)], load.tokens,
                                  chunk_ranges(len(load.tokens), chunk, 0, len(spans)), None)
        for i in range(num_ok):
            self._paged.scatter(records.read_kv(spans[i], chunk), load.block_offsets[i],
                                load.block_ids[i])
            self.num_loaded_tokens += len(load.block_ids[i]) * self.settings.block_size
        return (-1 if num_ok == len(load.hashes) else num_ok), records

    def _recheck(self, load: LoadSpec, first_failed: int, records: RecordIO | None) -> int:
        """The first failed chunk of `load` once the records it copied are checked again
        after the copies (see `load`), or -1."""
        num_copied = len(load.hashes) if first_failed < 0 else first_failed
        if records is None or not num_copied:
            return first_failed
        chunk = self.settings.chunk_size
        num_ok = records.verify_prefix(load.spans[self.rank][:num_copied],
                                       load.hashes[:num_copied], load.tokens,
                                       chunk_ranges(len(load.tokens), chunk, 0, num_copied),
                                       records.fingerprint)
        if num_ok == num_copied:
            return first_failed
        self.num_recheck_failures += 1
        return num_ok

    def take_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_chunks(self) -> dict[str, int]:
        """req_id -> first failed chunk of this step's loads (reported to the scheduler)."""
        failed, self._failed_chunks = self._failed_chunks, {}
        return failed

    # ------------------------------------------------------------------ saves
    def save(self, saves: list[SaveSpec]) -> None:
        """Store this step's new full chunks as one chain store (`Chain.store`): one ALLOC
        and one COMMIT for the step, more only where one frame cannot carry them all, and
        then earlier requests stay WRITING until every chunk is filled, so a split save
        never evicts its own beginning. With verify="checksum" every record is sealed.

        Chunks the daemon already holds are skipped (EXISTS), as are chunks of a
        request whose load failed in this epoch (their KV attended to bad blocks).
        """
        if self._paged is None:
            return
        chunk, bpc = self.settings.chunk_size, self.settings.blocks_per_chunk
        entries, seen = [], set()
        for save in saves:
            if self._failed_epochs.get(save.req_id, -1) >= save.epoch:
                continue
            for i, chunk_hash in enumerate(save.hashes):
                if chunk_hash not in seen:
                    seen.add(chunk_hash)
                    entries.append((chunk_hash, save.tokens[i * chunk : (i + 1) * chunk],
                                    save.block_ids[i * bpc : (i + 1) * bpc]))
        if not entries:
            return
        paged = self._paged

        def gather_into(dst: torch.Tensor, ids: list[int], span: list[int]) -> None:
            paged.gather(ids, dst)
            if len(span) > 1:  # dst is a temporary buffer, copied into the blocks next
                paged.wait()

        def write(records: RecordIO, span: list[int], i: int) -> None:
            chunk_hash, tokens, block_ids = entries[i]
            records.write_with(span, chunk_hash, tokens,
                               lambda dst: gather_into(dst, block_ids, span))

        # paged.wait: every record's bytes are in the arena before the seals and COMMIT
        self.num_saved_chunks += self.chain.store([h for h, _, _ in entries],
                                                  [chunk] * len(entries), write, paged.wait)

    def request_finished(self, req_ids: set[str]) -> None:
        """Forget finished requests' failure epochs."""
        for req_id in req_ids:
            self._failed_epochs.pop(req_id, None)

    def shutdown(self) -> None:
        """Close the session (the daemon aborts anything it still had allocated)."""
        if self._link is not None:
            self._link.close()
        if self.chain is not None:
            self.chain.forget()
