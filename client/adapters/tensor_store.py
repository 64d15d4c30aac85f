"""Tensors by string key in the daemon's arena (PUT / GET / DELETE / SCAN).

Why this file exists: the seed's key-value adapters (`StorageBackend`, vLLM's KV
lookup and store buffers) move whole tensors under string keys between processes. Here
a value is written straight into arena blocks and read from them; only block ids cross
the socket. A value larger than one block spans several.

Value record::

    | header (128 bytes): magic, dtype, ndim, shape[8] | raw bytes of the tensor (C order) |
"""

import struct

import msgspec
import numpy as np
import torch

from lmcached.client.chain import fill_and_commit
from lmcached.client.daemon_link import DaemonLink
from lmcached.client.records import gather, scatter
from lmcached.wire.logger import init_logger
from lmcached.wire.connection import DaemonError
from lmcached.wire.protocol import NOSPACE, Delete, Layout, Put, Scan

VALUE_MAGIC = 0x42564D4C  # "LMVB"
VALUE_HEADER_BYTES = 128
MAX_DIMS = 8
_HEADER = struct.Struct(f"<IHH{MAX_DIMS}q")
_DTYPES = [
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.float8_e4m3fn,
    torch.float8_e5m2,
]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}

logger = init_logger(__name__)


def kv_namespace(name: str, value_bytes_hint: int = 1 << 20) -> Layout:
    """The namespace of a key-value adapter (keys of different names never meet).

    Args:
        name: adapter namespace, e.g. "vllm-lookup-buffer".
        value_bytes_hint: typical value size: sizes the daemon's blocks when this is
            the first layout to attach.
    """
    return Layout(model_name=name, world_size=1, worker_id=0, fmt="kv", dtype="uint8",
                  num_layers=1, num_kv_heads=1, head_size=1, chunk_size=1,
                  record_bytes=value_bytes_hint + VALUE_HEADER_BYTES)


class TensorStore:
    """PUT / GET / DELETE of CPU tensors by string key, through the daemon's arena.

    Args:
        namespace: a `kv_namespace(...)` layout.
        socket: daemon socket path (default: that of daemon `name`).
        name: daemon name (None: $LMCACHED_NAME, else "default").
        timeout_s: request timeout in seconds.

    Every method degrades when the daemon is unavailable: `put` returns False, `get`
    None, `delete` False, `scan` [].

    The namespace's value size hint (`record_bytes`) only sizes blocks; values of any
    size span blocks. A hint larger than the daemon's arena, which the daemon refuses
    ("too_large"), is dropped with a warning: the store opens the namespace of the same
    name without a hint (`kv_namespace(name, 0)`), and values that fit are stored.
    """

    def __init__(self, namespace: Layout, socket: str | None = None, name: str | None = None,
                 timeout_s: float = 10.0) -> None:
        self.link = DaemonLink(socket, name, [namespace], timeout_s,
                               f"TensorStore({namespace.model_name})")
        try:
            self.link.try_connect(strict=True)
        except DaemonError as exc:
            no_hint = msgspec.structs.replace(namespace, record_bytes=VALUE_HEADER_BYTES)
            if exc.code != "too_large" or namespace == no_hint:
                self.link.connect_failed(exc)
                return
            logger.warning(
                "the daemon's arena cannot hold a %d-byte value (the size hint of namespace "
                "%r): using the namespace without a hint", namespace.record_bytes,
                namespace.model_name,
            )
            self.link.layouts = (no_hint,)
            self.link.try_connect()
        except Exception as exc:  # no daemon now: misses, and reconnects with back-off
            self.link.connect_failed(exc)

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Store `tensor` under `key`, replacing any value (readers keep the old one).

        Args:
            key: non-empty string.
            tensor: any shape up to 8 dims; copied from its device.

        Returns:
            False when not stored (arena full of pinned data, or no daemon).

        Raises:
            ValueError: unsupported dtype, more than 8 dims, or an empty key.
        """
        if tensor.dtype not in _DTYPE_CODE or tensor.dim() > MAX_DIMS:
            raise ValueError(f"cannot store a {tensor.dim()}-d {tensor.dtype} tensor")
        if not key:
            raise ValueError("the key must be a non-empty string")
        data = tensor.detach().contiguous().cpu()
        payload = data.reshape(-1).view(torch.uint8).numpy()  # [num_bytes]
        link = self.link
        allocated = link.call(
            "PUT", lambda snapshot: (snapshot.request(
                Put(snapshot.ns, key, VALUE_HEADER_BYTES + payload.size)), snapshot), None)
        if allocated is None:
            return False
        reply, snapshot = allocated
        if reply.status[0] == NOSPACE:
            return False
        header = np.zeros(VALUE_HEADER_BYTES, dtype=np.uint8)
        shape = list(data.shape) + [0] * (MAX_DIMS - data.dim())
        _HEADER.pack_into(header, 0, VALUE_MAGIC, _DTYPE_CODE[data.dtype], data.dim(), *shape)
        return fill_and_commit(
            link, reply.block_ids, snapshot.generation,
            lambda: scatter(snapshot.arena, reply.block_ids, [header, payload]))

    def _get(self, key: str, read):
        """GET `key`, `read(arena, reply)` while it is pinned, RELEASE; None on a miss."""
        def body(snapshot):
            reply = snapshot.acquire_value(key)
            if not reply.block_ids:
                return None
            try:
                return read(snapshot.arena, reply)
            finally:
                snapshot.release()
        return self.link.call("GET", body, None)

    def get(self, key: str) -> torch.Tensor | None:
        """A copy of the tensor under `key`, or None."""
        raw = self._get(key, lambda arena, reply: gather(arena, reply.block_ids,
                                                         reply.num_bytes[0]))
        if raw is None:
            return None
        magic, code, ndim, *shape = _HEADER.unpack_from(raw, 0)
        if magic != VALUE_MAGIC or code >= len(_DTYPES) or ndim > MAX_DIMS:
            return None
        body = torch.from_numpy(raw[VALUE_HEADER_BYTES:]).view(_DTYPES[code])
        return body.reshape(shape[:ndim])

    def delete(self, key: str) -> bool:
        """Remove `key`. Returns True when it existed."""
        return self.link.call(
            "DELETE", lambda snapshot: snapshot.request(Delete(snapshot.ns, key)).count == 1,
            False)

    def contains(self, key: str) -> bool:
        """True when `key` is stored (a GET and RELEASE, no copy)."""
        return self._get(key, lambda arena, reply: True) is True

    def scan(self, prefix: str = "", limit: int = 100) -> list[str]:
        """Keys starting with `prefix`, at most `limit`: the daemon's SCAN pages, cursor
        after cursor, until `limit` keys or the last page."""

        def scan_pages(snapshot) -> list[str]:
            found, cursor = [], 0
            while True:
                reply = snapshot.request(Scan(snapshot.ns, prefix, limit - len(found), cursor))
                found += reply.keys
                if not reply.cursor or len(found) >= limit:
                    return found
                cursor = reply.cursor

        return self.link.call("SCAN", scan_pages, [])

    def close(self) -> None:
        """End the session."""
        self.link.close()
