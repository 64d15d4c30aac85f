"""The seed's storage-backend interface, and a backend over the daemon.

Why this file exists: code written against LMCache's `LMCBackendInterface` (put / get /
contains / batched_* of KV chunks keyed by `CacheEngineKey`) runs unchanged on lmcached
through `DaemonBackend`, with values living in the daemon's shared memory instead of a
process-local dict or a remote server.
"""

import abc
import concurrent.futures
import dataclasses
import threading
from typing import Iterable, Iterator

import torch

from lmcached.client.adapters.tensor_store import TensorStore, kv_namespace
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


@dataclasses.dataclass(frozen=True)
class CacheEngineKey:
    """Key of one KV chunk (seed: LMCache's CacheEngineKey).

    Attributes:
        fmt: "vllm" or "huggingface".
        model_name: the model.
        world_size / worker_id: tensor-parallel size and rank.
        chunk_hash: the chunk's prefix hash as a string (e.g. hex).
    """

    fmt: str
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: str

    def to_string(self) -> str:
        """`fmt@model_name@world_size@worker_id@chunk_hash`."""
        return f"{self.fmt}@{self.model_name}@{self.world_size}@{self.worker_id}@{self.chunk_hash}"

    @classmethod
    def from_string(cls, text: str) -> "CacheEngineKey":
        """Inverse of `to_string`.

        Raises:
            ValueError: not five '@'-separated fields with integer world size and rank.
        """
        parts = text.split("@")
        if len(parts) != 5:
            raise ValueError(f"{text!r} is not fmt@model@world_size@worker_id@chunk_hash")
        fmt, model_name, world_size, worker_id, chunk_hash = parts
        return cls(fmt, model_name, int(world_size), int(worker_id), chunk_hash)


class StorageBackend(abc.ABC):
    """Where KV chunks are kept (seed: LMCache's LMCBackendInterface).

    As in the seed, a chunk that does not fit is dropped, never an error; here `put`
    also says so (the seed's `put` returns None, which `batched_put` counts as stored).

    Attributes:
        dst_device: device that `get` returns tensors on.
    """

    dst_device: str = "cpu"

    @abc.abstractmethod
    def put(self, key: CacheEngineKey, kv_chunk: torch.Tensor, blocking: bool = True) -> bool:
        """Store one chunk (any shape and dtype).

        Returns:
            False when the chunk was dropped (no space, or no storage now); True when
            stored, or queued with blocking=False.
        """

    @abc.abstractmethod
    def contains(self, key: CacheEngineKey) -> bool:
        """True when the chunk is stored."""

    @abc.abstractmethod
    def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        """The chunk, or None."""

    def batched_put(
        self, keys_and_chunks: Iterable[tuple[CacheEngineKey, torch.Tensor]], blocking: bool = True
    ) -> int:
        """Store several chunks, in order.

        Returns:
            The number of chunks stored (the seed's contract): those `put` dropped are
            not counted. With blocking=False, the number queued.
        """
        count = 0
        for key, chunk in keys_and_chunks:
            count += self.put(key, chunk, blocking=blocking) is not False
        return count

    def batched_get(self, keys: Iterable[CacheEngineKey]) -> Iterator[torch.Tensor | None]:
        """`get` of each key, in order, lazily (as the seed's generator): a key is read
        only when the caller asks for its chunk, so a caller that stops at the first
        None (a prefix lookup) reads nothing after it.

        Returns:
            An iterator of chunks (None for a missing key).
        """
        for key in keys:
            yield self.get(key)

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources (and wait for background puts)."""


class DaemonBackend(StorageBackend):
    """StorageBackend whose chunks live in the lmcached daemon's shared memory.

    Every process on the node that opens a DaemonBackend with the same daemon and
    namespace sees the same chunks. Values may span several arena blocks.

    Never fails for lack of space or of a daemon, as the seed's backends: the
    constructor starts disconnected without a daemon (misses, reconnects with back-off),
    drops a size hint larger than the arena (one warning, see `TensorStore`), and a
    chunk that does not fit is dropped (`put` returns False; `num_dropped` counts).

    Args:
        socket: daemon socket path (default: that of daemon `name`).
        name: daemon name (None: $LMCACHED_NAME, else "default").
        namespace: key space shared by the backends that use it.
        value_bytes_hint: typical chunk size in bytes (sizes the daemon's blocks if this
            is the first client).
        dst_device: device for tensors returned by `get`.

    Attributes:
        num_dropped: chunks not stored (no space, or no daemon), background puts included.
    """

    def __init__(self, socket: str | None = None, name: str | None = None,
                 namespace: str = "lmcached-backend", value_bytes_hint: int = 1 << 20,
                 dst_device: str = "cpu") -> None:
        self.dst_device = dst_device
        self.num_dropped = 0
        self._dropped_lock = threading.Lock()  # the put thread counts too
        self._store = TensorStore(kv_namespace(namespace, value_bytes_hint), socket, name)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []

    def put(self, key: CacheEngineKey, kv_chunk: torch.Tensor, blocking: bool = True) -> bool:
        """Store one chunk; blocking=False copies on a background thread (`flush` waits).

        Returns:
            False when the chunk was dropped (the arena is full of pinned data, or no
            daemon); True when stored, or queued with blocking=False.

        Raises:
            ValueError: a dtype or rank the value record cannot hold (see TensorStore.put).
        """
        if blocking:
            return self._put_now(key.to_string(), kv_chunk)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcached-put")
        self._pending.append(self._executor.submit(self._put_now, key.to_string(), kv_chunk))
        return True

    def _put_now(self, key: str, kv_chunk: torch.Tensor) -> bool:
        stored = self._store.put(key, kv_chunk)
        if not stored:
            with self._dropped_lock:
                self.num_dropped += 1
        return stored

    def contains(self, key: CacheEngineKey) -> bool:
        """True when the daemon holds a value under `key`."""
        return self._store.contains(key.to_string())

    def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        """The KV chunk under `key` on `dst_device` (a copy), or None on a miss."""
        value = self._store.get(key.to_string())
        return None if value is None else value.to(self.dst_device)

    def flush(self) -> int:
        """Wait for background puts. Returns how many of them stored their chunk."""
        pending, self._pending = self._pending, []
        return sum(future.result() for future in pending)

    def close(self) -> None:
        """Wait for background puts, then stop the put thread."""
        self.flush()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._store.close()
