"""Page-locking the arena for CUDA: device<->arena copies by DMA, without staging.

Why this file exists: a GPU worker copies KV between device memory and arena blocks.
From pageable host memory CUDA stages every transfer through a pinned bounce buffer;
registering the arena mapping with `cudaHostRegister` lets the copy engines read and
write it directly (and lets copies run asynchronously). Registration pins the pages, so
the process needs a large enough RLIMIT_MEMLOCK (the systemd units set
LimitMEMLOCK=infinity; workers need the same).
"""

import torch

from lmcached.wire.logger import init_logger
from lmcached.shm.arena import HEADER_BYTES, Arena

logger = init_logger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process


def register_arena(arena: Arena) -> bool:
    """Page-lock `arena`'s blocks for CUDA (cudaHostRegister): the mapping after its
    header, which a client maps read-only (shm/arena.py) and never copies.

    Returns:
        True when registered; False (with a warning) when CUDA is unavailable or the
        registration failed (e.g. RLIMIT_MEMLOCK too small): copies still work, staged.
    """
    if not torch.cuda.is_available():
        logger.warning("cuda_register=True but CUDA is not available: arena not registered")
        return False
    status = torch.cuda.cudart().cudaHostRegister(
        arena.base_ptr + HEADER_BYTES, arena.capacity_bytes - HEADER_BYTES,
        _CUDA_HOST_REGISTER_PORTABLE,
    )
    if int(status) != 0:
        logger.warning(
            "cudaHostRegister of the %d-byte arena failed (%s): copies stay staged; raise "
            "RLIMIT_MEMLOCK (LimitMEMLOCK=infinity) to page-lock it", arena.capacity_bytes, status,
        )
        return False
    return True


def unregister_arena(arena: Arena) -> None:
    """Undo `register_arena` (before the mapping goes away)."""
    torch.cuda.cudart().cudaHostUnregister(arena.base_ptr + HEADER_BYTES)


def synchronize_if_cuda(*tensors: torch.Tensor | None) -> None:
    """Wait for queued copies when any of `tensors` lives on a CUDA device."""
    for tensor in tensors:
        if tensor is not None and tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)
            return
