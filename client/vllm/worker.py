"""The vLLM connector's worker side: vLLM's paged KV cache as the serving core's `KVMover`.

Why this file exists: the loads (check, copy, re-check, TP agreement) and saves are the
engine-neutral `ServingWorker` (client/serving/worker.py); what is vLLM's is here: how its
paged cache is copied. The paged cache's format differs between vLLM's CPU backend and its
GPU backends, so whole blocks are copied as opaque bytes (`PagedBlocks`) and the physical
format is folded into each record's fingerprint. vllm-free: the connector passes what it
reads from vLLM.
"""

import numpy as np
import torch

from lmcached.client.cuda import synchronize_if_cuda
from lmcached.client.serving.specs import ConnectorSettings
from lmcached.client.serving.worker import ServingWorker


class PagedBlocks:
    """A worker's paged KV cache as raw bytes per (layer, vLLM block): the serving core's
    `KVMover` for vLLM.

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


class LMCachedConnectorWorker(ServingWorker):
    """Worker-side state of LMCachedConnector for one TP rank: the serving core copying
    vLLM's paged blocks.

    Args:
        settings: the connector's settings.
        rank: this worker's TP rank (its namespace is settings.layouts[rank]).
    """

    def __init__(self, settings: ConnectorSettings, rank: int) -> None:
        super().__init__(settings, rank, "vllm-worker")

    def register(self, kv_caches: dict[str, torch.Tensor], layer_names: list[str],
                 backend_names: dict[str, str], spec_page_bytes: int) -> None:
        """Map the paged KV cache (shapes and strides as registered) and attach (the
        daemon session is opened once: a register after `unregister`, vLLM's wake-up
        from sleep mode, only maps the new tensors).

        Raises:
            ValueError: the caches are not dense per-block slabs of `spec_page_bytes`
                (the connector then idles).
        """
        paged = PagedBlocks(kv_caches, layer_names, backend_names)
        if paged.page_bytes != spec_page_bytes:
            raise ValueError(f"registered pages of {paged.page_bytes} bytes, the spec says "
                             f"{spec_page_bytes}")
        self.register_mover(paged)
