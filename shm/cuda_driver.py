"""The daemon's only use of the CUDA driver API: a device tier's memory, allocated with
CUDA VMM and exported as a POSIX file descriptor.

Why this file exists: the daemon stays torch-free and imports NVIDIA's cuda-bindings
only with `--gpu-capacity` (shm/device_memory.py imports this module then). The
sequence follows the CUDA programming guide's "Virtual Memory Management" chapter and
NVIDIA's memMapIPCDrv sample: cuMemCreate with POSIX file descriptor handles,
cuMemAddressReserve + cuMemMap + cuMemSetAccess to use it here (demotion copies), and
cuMemExportToShareableHandle for the descriptor that clients import (client/tier_map.py).
Every call is checked; a failure raises `CudaError` naming the call and its CUresult.
What has run on a GPU and what has not: docs/operator.md, "What has run on a GPU".
"""

import os

import numpy as np
from cuda.bindings import driver as cu

from lmcached.wire.units import format_bytes


class CudaError(Exception):
    """A CUDA driver call failed, or what it reported cannot be used.

    Args:
        call: the driver call (or the check) that failed, e.g. "cuMemCreate".
        result: the call's CUresult (the message is its name, e.g. CUDA_ERROR_OUT_OF_MEMORY),
            or a message that says what is wrong and what to do.

    Attributes:
        call: as given.
        code: the CUresult's name, or None for a message.
    """

    def __init__(self, call: str, result) -> None:
        self.call = call
        if isinstance(result, str):
            self.code = None
            super().__init__(f"{call}: {result}")
        else:
            self.code = _result_name(result)
            super().__init__(f"{call} failed: {self.code}")


def _result_name(result) -> str:
    """A CUresult's name (CUDA_ERROR_...), or its text where the driver has none."""
    try:
        err, name = cu.cuGetErrorName(result)
    except (TypeError, ValueError):
        return str(result)
    return name.decode() if err == cu.CUresult.CUDA_SUCCESS else str(result)


def check(call: str, result: tuple):
    """The values of a cuda-bindings call's `(CUresult, *values)` result.

    Raises:
        CudaError: the CUresult is not CUDA_SUCCESS.
    """
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(call, result[0])
    values = result[1:]
    return values[0] if len(values) == 1 else values


def device_uuid(device) -> str:
    """The device's UUID as nvidia-smi and torch print it: `GPU-xxxxxxxx-xxxx-...`."""
    raw = bytes(check("cuDeviceGetUuid", cu.cuDeviceGetUuid(device)).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaVmmMemory:
    """`size_bytes` of device memory on CUDA device `ordinal` (rounded down to the VMM
    granularity), mapped in the daemon and exported as a POSIX file descriptor.

    Args:
        ordinal: the device, as numbered inside the daemon's CUDA_VISIBLE_DEVICES.
        size_bytes: bytes wanted.

    Raises:
        CudaError: the device does not exist, lacks VMM or POSIX-fd handle support, has
            too little free memory, or a VMM call fails (what was made is released).
    """

    kind = "cuda"

    def __init__(self, ordinal: int, size_bytes: int) -> None:
        self._undo: list = []
        try:
            self._create(ordinal, size_bytes)
        except BaseException:
            self.close()
            raise

    def _create(self, ordinal: int, size_bytes: int) -> None:
        try:
            result = cu.cuInit(0)
        except RuntimeError as exc:  # cuda-bindings' loader: no libcuda.so (no driver)
            raise CudaError("cuInit", f"the NVIDIA driver cannot be loaded ({exc}): run where "
                            "the driver is installed, or start without --gpu-capacity") from None
        check("cuInit", result)
        self._device = check("cuDeviceGet", cu.cuDeviceGet(ordinal))
        self.device = device_uuid(self._device)
        attr = cu.CUdevice_attribute
        for name in ("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                     "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
            if not check("cuDeviceGetAttribute",
                         cu.cuDeviceGetAttribute(getattr(attr, name), self._device)):
                raise CudaError(f"{name} on device {ordinal}", "not supported")
        self._ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._device))
        self._undo.append(lambda: cu.cuDevicePrimaryCtxRelease(self._device))
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = \
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.granularity = check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        size = size_bytes // self.granularity * self.granularity
        if size == 0:
            raise CudaError("cuMemCreate", f"{format_bytes(size_bytes)} is less than the "
                            "device's CUDA VMM allocation granularity "
                            f"({format_bytes(self.granularity)}): use --gpu-capacity "
                            f"{-(-self.granularity // (1 << 20))}MiB or more")
        free, _ = check("cuMemGetInfo", cu.cuMemGetInfo())
        if size > free:
            raise CudaError("cuMemGetInfo", f"device {ordinal} has {format_bytes(free)} free, "
                            f"{format_bytes(size)} asked: lower --gpu-capacity, or free the "
                            "device (a dead daemon generation may still be mapped by "
                            "clients; nvidia-smi shows who holds memory)")
        self.size_bytes = size
        self._handle = check("cuMemCreate", cu.cuMemCreate(size, prop, 0))
        self._undo.append(lambda: cu.cuMemRelease(self._handle))
        self.ptr = check("cuMemAddressReserve",
                         cu.cuMemAddressReserve(size, self.granularity, 0, 0))
        self._undo.append(lambda: cu.cuMemAddressFree(self.ptr, size))
        check("cuMemMap", cu.cuMemMap(self.ptr, size, 0, self._handle, 0))
        self._undo.append(lambda: cu.cuMemUnmap(self.ptr, size))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check("cuMemSetAccess", cu.cuMemSetAccess(self.ptr, size, [access], 1))
        self._fd = int(check("cuMemExportToShareableHandle", cu.cuMemExportToShareableHandle(
            self._handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0)))
        self._undo.append(lambda: os.close(self._fd))
        self._stream = check("cuStreamCreate",
                             cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self._undo.append(lambda: cu.cuStreamDestroy(self._stream))
        self.block_bytes = 0
        self.num_blocks = 0

    def set_block_bytes(self, block_bytes: int) -> None:
        """Cut the memory into blocks of `block_bytes` from offset 0.

        Raises:
            ValueError: not even one block fits.
        """
        if block_bytes <= 0 or block_bytes > self.size_bytes:
            raise ValueError(f"a block of {block_bytes} bytes does not fit in the GPU tier "
                             f"({self.size_bytes} bytes)")
        self.block_bytes = block_bytes
        self.num_blocks = self.size_bytes // block_bytes

    def export_fd(self) -> int:
        """The allocation's POSIX file descriptor (the daemon keeps it)."""
        return self._fd

    def copy_to_host(self, block_id: int, nbytes: int, dst: np.ndarray) -> None:
        """Copy the first `nbytes` of block `block_id` into host memory `dst` (uint8
        `[nbytes]`) on the tier's own stream, and wait for it (demotion thread; the
        bindings release the GIL while the driver works)."""
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
        src = int(self.ptr) + block_id * self.block_bytes
        check("cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync(dst.ctypes.data, src, nbytes,
                                                        self._stream))
        check("cuStreamSynchronize", cu.cuStreamSynchronize(self._stream))

    def register_host(self, host: np.ndarray) -> None:
        """Page-lock host memory `host` (uint8, contiguous: the host arena's blocks) for
        every CUDA context of the process (cuMemHostRegister, PORTABLE), so that
        `copy_to_host` into it is one DMA at pinned speed instead of a copy staged through
        the driver's pinned buffer. Undo with `unregister_host` before `host` is unmapped.

        Raises:
            CudaError: the registration failed (usually CUDA_ERROR_OUT_OF_MEMORY: the
                daemon's RLIMIT_MEMLOCK is below the arena's size); nothing is registered.
        """
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
        check("cuMemHostRegister", cu.cuMemHostRegister(
            host.ctypes.data, host.nbytes, cu.CU_MEMHOSTREGISTER_PORTABLE))

    def unregister_host(self, host: np.ndarray) -> None:
        """Undo `register_host(host)` (cuMemHostUnregister).

        Raises:
            CudaError: the driver refused (the memory was not registered).
        """
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
        check("cuMemHostUnregister", cu.cuMemHostUnregister(host.ctypes.data))

    def close(self) -> None:
        """Release everything in reverse order (the memory itself lives on while a
        client still maps it). Safe to call twice."""
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:  # best effort at shutdown
                pass
