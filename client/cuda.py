"""Page-locking the arena for CUDA: device<->arena copies by DMA, without staging.

Why this file exists: a GPU worker copies KV between device memory and arena blocks.
From pageable host memory CUDA stages every transfer through a pinned bounce buffer;
registering the arena mapping with `cudaHostRegister` lets the copy engines read and
write it directly (and lets copies run asynchronously). Registration pins the pages, so
the process needs a large enough RLIMIT_MEMLOCK (the systemd units set
LimitMEMLOCK=infinity; workers need the same).
"""

import ctypes
import functools
import os

import torch

from lmcached.wire.logger import init_logger
from lmcached.shm.arena import HEADER_BYTES, Arena

logger = init_logger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process

# Registered host addresses -> the device whose context registered them (unregistered in
# the same one). Only what registered here is unregistered.
_registered: dict[int, int] = {}


def register_arena(arena: Arena, device: torch.device | int | str | None = None) -> bool:
    """Page-lock `arena`'s blocks for CUDA (cudaHostRegister): the mapping after its
    header, which a client maps read-only (shm/arena.py) and never copies.

    Args:
        arena: the mapped arena.
        device: the CUDA device whose context registers it (the worker's; the
            registration is portable, usable from every device): None or "cuda" for
            torch's current device. Registering creates that device's context if it has
            none, so name the device the process works on.

    Returns:
        True when registered (or already); False (with a warning) when CUDA is unavailable
        or the registration failed (e.g. RLIMIT_MEMLOCK too small): copies still work,
        staged. A failure leaves no CUDA error behind for a later, unrelated call to report.
    """
    if not torch.cuda.is_available():
        logger.warning("cuda_register=True but CUDA is not available: arena not registered")
        return False
    ptr = arena.base_ptr + HEADER_BYTES
    if ptr in _registered:
        return True
    index = _device_index(device)
    cudart = torch.cuda.cudart()
    with _device_current(index):
        status = cudart.cudaHostRegister(ptr, arena.capacity_bytes - HEADER_BYTES,
                                         _CUDA_HOST_REGISTER_PORTABLE)
    if int(status) != 0:
        _clear_last_error()
        logger.warning(
            "cudaHostRegister of the %d-byte arena failed (%s): copies stay staged; raise "
            "RLIMIT_MEMLOCK (LimitMEMLOCK=infinity) to page-lock it", arena.capacity_bytes,
            _error_text(cudart, status))
        return False
    _registered[ptr] = index
    return True


def unregister_arena(arena: Arena) -> None:
    """Undo `register_arena` (before the mapping goes away): nothing when it did not
    register this arena (it failed, or CUDA is unavailable)."""
    ptr = arena.base_ptr + HEADER_BYTES
    index = _registered.pop(ptr, None)
    if index is None:
        return
    cudart = torch.cuda.cudart()
    with _device_current(index):
        status = cudart.cudaHostUnregister(ptr)
    if int(status) != 0:
        _clear_last_error()
        logger.warning("cudaHostUnregister of the arena failed (%s)", _error_text(cudart, status))


def _device_index(device: torch.device | int | str | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"register_arena needs a CUDA device, not {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def _device_current(index: int):
    """A context manager under which runtime calls run in device `index`'s primary
    context. Torch's device guard only records a device that has no context yet (so as
    not to create one), and a runtime call would then create a context on whatever device
    the runtime has current: one small allocation on `index` creates its context first."""
    torch.empty(1, device=f"cuda:{index}")
    return torch.cuda.device(index)


def _error_text(cudart, status) -> str:
    try:
        return f"{cudart.cudaGetErrorString(status)}, {int(status)}"
    except Exception:
        return str(int(status))


def _clear_last_error() -> None:
    """Reset the CUDA runtime's last error. Torch's cudart bindings return a failed
    call's status but leave it as the runtime's last error, which the next kernel launch
    check (cudaGetLastError) would report as its own; torch binds no cudaGetLastError, so
    it is called in every libcudart this process has loaded."""
    for library in _runtime_libraries():
        library.cudaGetLastError()


@functools.cache
def _runtime_libraries() -> tuple:
    """The CUDA runtime libraries mapped in this process (torch's), opened without
    loading anything new."""
    paths = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/libcudart" in path:
                    paths.add(path)
    except OSError:
        return ()
    libraries = []
    for path in sorted(paths):
        try:
            libraries.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        except OSError:
            continue
    if not libraries:
        logger.debug("no libcudart mapped: a failed CUDA call's error is not cleared")
    return tuple(libraries)


def synchronize_if_cuda(*tensors: torch.Tensor | None) -> None:
    """Wait for queued copies when any of `tensors` lives on a CUDA device."""
    for tensor in tensors:
        if tensor is not None and tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)
            return


def synchronize_devices(tensors) -> None:
    """Wait for the work queued on every CUDA device among `tensors` (each device once).

    A copy between device memory and host memory has landed only when its device has run
    it, whichever side is on the host: a device-to-host copy into a pinned buffer returns
    before the bytes are there.
    """
    seen = set()
    for tensor in tensors:
        if tensor is not None and tensor.device.type == "cuda" and tensor.device not in seen:
            seen.add(tensor.device)
            torch.cuda.synchronize(tensor.device)
