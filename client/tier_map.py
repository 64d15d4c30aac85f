"""A CUDA device tier of the daemon, mapped into this process, and its chunk records.

Why this file exists: a worker on a GPU reads and writes the daemon's GPU tier in place,
as it does the host arena, so that a hit on its own device costs device-to-device
copies (or none: `retrieve_views` returns views of the tier). The daemon sends the
tier's CUDA VMM allocation as a POSIX file descriptor (OPEN_TIER); this module imports
it with the sequence of the CUDA programming guide's "Virtual Memory Management /
Sharing" and NVIDIA's memMapIPCDrv sample (cuMemImportFromShareableHandle,
cuMemAddressReserve, cuMemMap, cuMemRelease, cuMemSetAccess), and wraps the mapping in
a torch tensor through `__cuda_array_interface__`. The mapping is undone when the last
tensor viewing it is gone, so a daemon restart never pulls memory from under a view.

The only client module that imports cuda-bindings (lazily, when a CUDA tier is mapped).
What has run on a GPU and what has not: docs/operator.md, "What has run on a GPU".
"""

import functools

import numpy as np
import torch

from lmcached.client.layout import RECORD_HEADER_BYTES, KVLayout
from lmcached.client.records import check_headers
from lmcached.wire.record_format import write_header
from lmcached.wire.protocol import TierHandle, TierInfo


def local_device(uuid: str) -> int:
    """This process's CUDA ordinal of the device with `uuid` ("GPU-xxxxxxxx-..."), as
    vLLM and SGLang match devices across CUDA_VISIBLE_DEVICES.

    Raises:
        ValueError: no visible device has that UUID.
    """
    wanted = uuid.lower().removeprefix("gpu-").replace("-", "")
    for ordinal in range(torch.cuda.device_count()):
        have = str(torch.cuda.get_device_properties(ordinal).uuid).lower()
        if have.removeprefix("gpu-").replace("-", "") == wanted:
            return ordinal
    raise ValueError(f"device {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES)")


class _Mapping:
    """Owner of one imported VMM mapping: `__cuda_array_interface__` for torch, and the
    unmap when the last tensor over it is freed.

    Args:
        ptr, size: the mapped address range (bytes).
        ordinal: the CUDA device it is mapped on (this process's numbering).
        device, context: that device's CUdevice and primary context, retained for the
            mapping's life (released after the unmap).
    """

    def __init__(self, ptr: int, size: int, ordinal: int, device, context) -> None:
        self.ptr = ptr
        self.size = size
        self.ordinal = ordinal
        self.device = device
        self.context = context
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2, "strides": None}

    def __del__(self) -> None:
        from cuda.bindings import driver as cu

        # Work queued on any stream may still read or write the mapping (a copy from a
        # view whose tensor is already gone): wait for the device before unmapping.
        try:
            torch.cuda.synchronize(self.ordinal)
        except Exception:  # interpreter shutdown: the process's work has ended anyway
            pass
        cu.cuCtxPushCurrent(self.context)
        try:
            cu.cuMemUnmap(self.ptr, self.size)
            cu.cuMemAddressFree(self.ptr, self.size)
        finally:
            cu.cuCtxPopCurrent()
            cu.cuDevicePrimaryCtxRelease(self.device)


class CudaTierMap:
    """A CUDA tier of the daemon mapped read-write on its device.

    Args:
        info: the tier as HELLO announced it (device UUID, block size, blocks).
        handle: OPEN_TIER's reply (generation, size).
        fd: the allocation's POSIX file descriptor (the caller closes it after).

    Attributes:
        u8: uint8 `[capacity_bytes]` on `cuda:<ordinal>`, a view of the tier's memory.
        generation, capacity_bytes, block_bytes, num_blocks: as announced.

    Raises:
        ImportError: cuda-bindings is missing (`pip install 'lmcached[gpu]'`).
        ValueError: the device is not visible here.
        lmcached.shm.cuda_driver.CudaError: an import or mapping call failed (e.g.
            CUDA_ERROR_NOT_SUPPORTED from another container's device).
    """

    kind = "cuda"

    def __init__(self, info: TierInfo, handle: TierHandle, fd: int) -> None:
        from cuda.bindings import driver as cu

        from lmcached.shm.cuda_driver import check

        self.generation = handle.generation
        self.device = info.device
        self.capacity_bytes = handle.size_bytes
        self.block_bytes = info.block_bytes
        self.num_blocks = info.num_blocks
        ordinal = local_device(info.device)
        torch.cuda.init()
        # The VMM calls below act on the calling thread's current driver context. Torch's
        # device guard does not make one current (it sets the device lazily), so push the
        # device's primary context, the one torch's runtime uses, for the calls.
        check("cuInit", cu.cuInit(0))
        device = check("cuDeviceGet", cu.cuDeviceGet(ordinal))
        context = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device))
        mapped = False
        check("cuCtxPushCurrent", cu.cuCtxPushCurrent(context))
        try:
            kinds = cu.CUmemAllocationHandleType
            allocation = check("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(
                fd, kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
            try:
                prop = cu.CUmemAllocationProp()
                prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                prop.location.id = ordinal
                granularity = check("cuMemGetAllocationGranularity",
                                    cu.cuMemGetAllocationGranularity(
                                        prop, cu.CUmemAllocationGranularity_flags
                                        .CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
                size = self.capacity_bytes
                ptr = check("cuMemAddressReserve", cu.cuMemAddressReserve(size, granularity, 0, 0))
                try:
                    check("cuMemMap", cu.cuMemMap(ptr, size, 0, allocation, 0))
                    access = cu.CUmemAccessDesc()
                    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                    access.location.id = ordinal
                    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                    check("cuMemSetAccess", cu.cuMemSetAccess(ptr, size, [access], 1))
                except BaseException:
                    cu.cuMemUnmap(ptr, size)
                    cu.cuMemAddressFree(ptr, size)
                    raise
            finally:
                cu.cuMemRelease(allocation)  # the mapping keeps the memory alive
            mapping = _Mapping(int(ptr), size, ordinal, device, context)
            mapped = True
        finally:
            cu.cuCtxPopCurrent()
            if not mapped:
                cu.cuDevicePrimaryCtxRelease(device)
        self.u8 = torch.as_tensor(mapping, device=f"cuda:{ordinal}")

    def close(self) -> None:
        """Forget the mapping; it is undone when the last view of it is freed."""
        self.u8 = None


class DeviceRecordIO:
    """Chunk records in a CUDA tier, in the host arena's format (one block per record):
    headers and token ids are written with one small host-to-device copy, and checked
    after one gather and device-to-host copy of the header rows of a request.

    The opt-in payload checksum (`verify="checksum"`) and CacheBlend's per-layer
    `pieces` read records on the CPU: they are not offered on a GPU tier.

    Args:
        tier: the mapped tier.
        layout: the KV layout of the records.
    """

    def __init__(self, tier: CudaTierMap, layout: KVLayout, fingerprint: int | None = None) -> None:
        self.arena = tier
        self.layout = layout
        self.fingerprint = layout.fingerprint if fingerprint is None else fingerprint
        self._dtype = layout.torch_dtype
        self._kv_offset = layout.kv_offset
        # [num_blocks, block_bytes] uint8 on the tier's device
        self._blocks = tier.u8[: tier.num_blocks * tier.block_bytes].view(
            tier.num_blocks, tier.block_bytes)
        self._header_bytes = RECORD_HEADER_BYTES + 8 * layout.chunk_size

    def write(self, span: list[int], chunk_hash: bytes, chunk_tokens: np.ndarray, source,
              src_start: int, src_end: int) -> None:
        """As `RecordIO.write`: the KV is copied on the device of `source`'s tensors."""
        self.write_with(span, chunk_hash, chunk_tokens,
                        functools.partial(source.copy_chunk, src_start, src_end))

    def write_with(self, span: list[int], chunk_hash: bytes, chunk_tokens: np.ndarray,
                   fill) -> None:
        """As `RecordIO.write_with`; `fill(dst)` gets a CUDA view of the block's KV.

        Raises:
            ValueError: the record spans several blocks (the daemon places only
                one-block records in a device tier).
        """
        if len(span) != 1:
            raise ValueError("a device tier holds one-block records only")
        t = len(chunk_tokens)
        header = np.empty(RECORD_HEADER_BYTES + 8 * t, dtype=np.uint8)
        write_header(header, self.fingerprint, chunk_hash, chunk_tokens)
        row = self._blocks[span[0]]
        row[: len(header)].copy_(torch.from_numpy(header))
        fill(self.kv_view(span[0], t))

    def verify(self, span: list[int], chunk_hash: bytes, chunk_tokens: np.ndarray,
               fingerprint: int) -> bool:
        """As `RecordIO.verify`."""
        t = len(chunk_tokens)
        return self.verify_prefix([span], [chunk_hash], chunk_tokens, [(0, t)], fingerprint) == 1

    def verify_prefix(self, spans: list[list[int]], chunk_hashes: list[bytes],
                      token_array: np.ndarray, chunks: list[tuple[int, int]],
                      fingerprint: int) -> int:
        """As `RecordIO.verify_prefix`, from one gather of the records' header rows."""
        if not spans:
            return 0
        index = torch.tensor([span[0] for span in spans], device=self._blocks.device)
        # [len(spans), header_bytes] uint8: gather the header rows only, never whole blocks
        headers = self._blocks[:, : self._header_bytes].index_select(0, index).cpu().numpy()
        return check_headers(headers, chunk_hashes, token_array, chunks, fingerprint)

    def kv_view(self, block_id: int, num_tokens: int) -> torch.Tensor:
        """Zero-copy KV of a record: `layout.chunk_shape(num_tokens)`, on the tier's device."""
        nbytes = self.layout.record_bytes(num_tokens) - self._kv_offset
        return self._blocks[block_id, self._kv_offset : self._kv_offset + nbytes].view(
            self._dtype).view(self.layout.chunk_shape(num_tokens))

    def read_kv(self, span: list[int], num_tokens: int) -> torch.Tensor:
        """KV of a one-block record, in place."""
        return self.kv_view(span[0], num_tokens)

    def synchronize(self) -> None:
        """Wait for the copies queued on the tier's device (before its blocks are
        released)."""
        if self._blocks.device.type == "cuda":
            torch.cuda.synchronize(self._blocks.device)

    def _cpu_only(self, *args, **kwargs):
        raise NotImplementedError("payload checksums and per-layer pieces read records on "
                                  "the CPU: not on a GPU tier")

    seal = checksum_ok = pieces = _cpu_only
