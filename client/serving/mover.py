"""How the serving core's worker side copies KV between an engine's blocks and arena records.

Why this file exists: the worker side (client/serving/worker.py) decides what to copy and
checks every record before and after; how bytes move between a record and the engine's
own KV cache is the engine's (vLLM's paged blocks: client/vllm/worker.py's `PagedBlocks`).
`KVMover` is that seam: gather blocks into a record, scatter a record into blocks, wait for
queued copies. A record's KV bytes are opaque to the core: a mover writes what it reads
back, in its own layout, and names that layout in `description` (folded into the record
fingerprint).
"""

from typing import Protocol

import torch


class KVMover(Protocol):
    """Copies between one engine's KV blocks (one TP rank's) and arena records.

    Attributes:
        device: where the engine's blocks live; `cuda` makes the worker page-lock the
            arena so that copies run at pinned-memory speed.
        description: the blocks' physical format (shapes, strides, dtype, backend):
            records written by a mover of another description never load here.
    """

    device: torch.device
    description: str

    def gather(self, block_ids: list[int], dst: torch.Tensor) -> None:
        """Copy blocks `block_ids` (one chunk's, in token order) into a record's KV bytes
        `dst` (cpu, contiguous, exactly the record's KV bytes). May only queue the copies:
        `wait()` before `dst` is read."""
        ...

    def scatter(self, src: torch.Tensor, offsets: list[int], block_ids: list[int]) -> None:
        """Copy the blocks at `offsets` (positions within the chunk) of a record's KV bytes
        `src` into blocks `block_ids`. May only queue the copies: `wait()` before `src`
        may change (its pins are released)."""
        ...

    def wait(self) -> None:
        """Wait for every queued gather and scatter."""
        ...
