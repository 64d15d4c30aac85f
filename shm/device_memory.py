"""The memory of the daemon's device tiers: one per `--gpu-device`, owned by the daemon
and handed to clients as a file descriptor.

Why this file exists: a device tier (lmcached/daemon/memory_tiers.py) needs memory that the daemon
allocates once, that clients map without copying, and that the daemon's demotion thread
can copy to the host arena. The two kinds share that interface:

- `CudaVmmMemory`: one CUDA VMM allocation (`cuMemCreate`) exported as a POSIX file
  descriptor, after the CUDA programming guide's "Virtual Memory Management / Sharing"
  and NCCL's cuMem p2p transport (docs/architecture.md, "Tiers", says why VMM and not
  legacy CUDA IPC handles). Through shm/cuda_driver.py, imported only here and only
  with `--gpu-capacity`.
- `FakeTierMemory`: an anonymous arena (`Arena.create_memfd`) that stands in for a
  device, so that CI tests every rule of the tiers, the descriptor passing and the
  client's mapping without a GPU (`--gpu-backend fake`).

Interface (what `TierSet` and `Demoter` use): `kind`, `device`, `size_bytes`,
`block_bytes`, `num_blocks`, `set_block_bytes(n)`, `export_fd()`,
`copy_to_host(block_id, nbytes, dst)`, `close()`.
"""

import time
from typing import Protocol

import numpy as np

from lmcached.wire.extras import install_hint
from lmcached.wire.logger import init_logger
from lmcached.shm.arena import Arena
from lmcached.wire.units import format_bytes

logger = init_logger(__name__)


class DeviceTierError(RuntimeError):
    """A device tier cannot be created: the message says why and what to do (the daemon
    turns it into its one-line start-up error)."""


class FakeTierMemory:
    """A device tier's memory made of host memory: an anonymous arena (memfd) with the
    same segment header as the host arena, blocks after it.

    Args:
        name: the daemon's name.
        generation: the daemon's generation (in the header; clients check it).
        index: the tier's device index; its device UUID is `fake-<index>`.
        size_bytes: bytes of memory (header included).

    Attributes:
        copy_delay_s: seconds each `copy_to_host` sleeps first (tests: a slow device).
    """

    kind = "fake"

    def __init__(self, name: str, generation: int, index: int, size_bytes: int) -> None:
        self.device = f"fake-{index}"
        self.arena = Arena.create_memfd(f"{name}-t{index}", generation, size_bytes)
        self.size_bytes = size_bytes
        self.copy_delay_s = 0.0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (0 until `set_block_bytes`)."""
        return self.arena.block_bytes

    @property
    def num_blocks(self) -> int:
        """Blocks of the tier (0 until `set_block_bytes`)."""
        return self.arena.num_blocks

    def set_block_bytes(self, block_bytes: int) -> None:
        """Cut the memory into blocks (as `Arena.set_block_bytes`; ValueError when not even
        one block fits)."""
        self.arena.set_block_bytes(block_bytes)

    def export_fd(self) -> int:
        """The memfd sent to clients by OPEN_TIER (the daemon keeps it)."""
        return self.arena.export_fd()

    def copy_to_host(self, block_id: int, nbytes: int, dst: np.ndarray) -> None:
        """Copy the first `nbytes` of block `block_id` into `dst` (uint8 `[nbytes]`, a view
        of the host arena). numpy copies without the GIL for a plain byte copy."""
        if self.copy_delay_s:
            time.sleep(self.copy_delay_s)
        np.copyto(dst, self.arena.numpy_view(self.arena.block_offset(block_id), nbytes))

    def close(self) -> None:
        """Unmap and close the memfd (clients' mappings keep their memory alive)."""
        self.arena.close()


class DeviceTierSettings(Protocol):
    """What `open_device_tiers` reads of the daemon's configuration (its `ServerConfig`,
    lmcached/daemon/server_config.py, which this layer does not import)."""

    gpu_capacity_bytes: int  # bytes of each device's tier; 0 = no device tier
    gpu_devices: tuple[int, ...]  # CUDA device numbers, in tier order
    gpu_backend: str  # "cuda" or "fake"


def open_device_tiers(config: DeviceTierSettings, name: str, generation: int) -> list:
    """The memory of every device tier of `config`, in `gpu_devices` order.

    Args:
        config: `gpu_capacity_bytes` (per device), `gpu_devices`, `gpu_backend`.
        name, generation: the daemon's (a fake tier's header carries them).

    Returns:
        One memory object per device; [] without `--gpu-capacity`.

    Raises:
        DeviceTierError: cuda-bindings is missing, a device cannot be used, or has too
            little free memory; whatever was created before is closed.
    """
    if not config.gpu_capacity_bytes:
        return []
    memories = []
    try:
        for index, device in enumerate(config.gpu_devices):
            if config.gpu_backend == "fake":
                memory = FakeTierMemory(name, generation, device, config.gpu_capacity_bytes)
            else:
                memory = _cuda_memory(device, config.gpu_capacity_bytes)
            memories.append(memory)
            logger.info("device tier %d: %s %s, %s", index + 1, memory.kind, memory.device,
                        format_bytes(memory.size_bytes))
    except BaseException:
        for memory in memories:
            memory.close()
        raise
    return memories


def _cuda_memory(device: int, size_bytes: int):
    try:
        from lmcached.shm.cuda_driver import CudaError, CudaVmmMemory
    except ImportError as exc:
        raise DeviceTierError(
            f"--gpu-capacity needs NVIDIA's cuda-bindings ({exc}): {install_hint('gpu')}"
        ) from None
    try:
        return CudaVmmMemory(device, size_bytes)
    except CudaError as exc:
        raise DeviceTierError(f"GPU tier on CUDA device {device}: {exc}") from None
