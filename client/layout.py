"""What a KV chunk is, and how one chunk record lies in the arena.

Why this file exists: every process that shares a cached chunk must agree on its bytes.
`KVLayout` names the model and the tensor geometry (it is the namespace of the hashes:
two processes share chunks only when their layouts are equal) and says how one chunk's
record lies in its arena block(s); client/records.py reads and writes records.

Record of one chunk of `t` tokens (t <= chunk_size), layer-major so that one layer of
a chunk is a zero-copy slice (layer-wise loading, CacheBlend)::

    offset 0                64                    kv_offset
    | header (64 bytes)    | token ids           | KV: [num_layers, 2, t, num_kv_heads, head_size]  (vllm)
    | identity (32):       | int64[chunk_size]   |  or [num_layers, 2, num_kv_heads, t, head_size]  (huggingface)
    |  magic, t, layout fp,| (first t used)      |  dtype = layout.dtype
    |  chunk hash          |                     |
    | integrity (16):      |                     |
    |  checksum kind,      |                     |
    |  reserved, checksum  |                     |
    | zero (16)            |                     |

The header and token ids let a reader check that a block really holds the chunk it asked
for (a hash collision or a corrupted index becomes a counted miss, never another
prompt's KV): no peer cache does this. The optional payload checksum (kind
CHECKSUM_XXH3_64) is xxh3-64 of identity || token ids || KV, written by a writer that has
checksums on before COMMIT; a reader with `verify="checksum"` recomputes it, so a record
whose KV bytes were changed after COMMIT (memory corruption, a stray or hostile write that
does not recompute it) becomes a counted miss too. Kind CHECKSUM_NONE means "not written".

The magic is the record format's version: a record of another format (e.g. "LMKV",
before the integrity fields existed, whose bytes 32-64 were left over from the block's
previous record) fails the identity check and is a miss, never misread.
"""

import dataclasses

import msgspec
import numpy as np
import torch
import xxhash

from lmcached.wire.protocol import Layout
from lmcached.wire.record_format import (  # noqa: F401 (re-exported for the client)
    CHECKSUM_NONE,
    CHECKSUM_XXH3_64,
    RECORD_CHECKSUM,
    RECORD_HEADER,
    RECORD_HEADER_BYTES,
    RECORD_MAGIC,
)

FORMATS = ("vllm", "huggingface")
_ALIGN = 64

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}
# Integer dtype of the same width: numpy has no bfloat16/fp8, so copies go through these.
_NUMPY_ALIAS = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The KV geometry and identity of one model worker (the cache namespace).

    Args:
        model_name: model identifier (e.g. "meta-llama/Llama-3.1-8B").
        num_layers: transformer layers, >= 1.
        num_kv_heads: KV heads of this worker (after tensor-parallel split), >= 1.
        head_size: elements per head, >= 1.
        dtype: KV dtype, a torch dtype or its name ("bfloat16", "float16", "float32",
            "float8_e4m3fn", "float8_e5m2", "uint8").
        chunk_size: tokens per chunk, >= 1 (default 256, as LMCache).
        fmt: "vllm" (`[num_layers, 2, num_tokens, num_kv_heads, head_size]`) or
            "huggingface" (`[num_layers, 2, num_kv_heads, num_tokens, head_size]`).
        world_size: tensor/pipeline-parallel world size, >= 1.
        worker_id: this worker's rank, 0 <= worker_id < world_size.

    Raises:
        ValueError: a field is out of range (the message names it).
    """

    model_name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str | torch.dtype = "bfloat16"
    chunk_size: int = 256
    fmt: str = "vllm"
    world_size: int = 1
    worker_id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.fmt not in FORMATS:
            raise ValueError(f"KVLayout.fmt must be one of {FORMATS}, got {self.fmt!r}")
        # Every range is the wire schema's (protocol.Layout): checked by msgspec, once.
        try:
            msgspec.convert(msgspec.structs.asdict(self.to_wire()), Layout)
        except msgspec.ValidationError as exc:
            raise ValueError(f"KVLayout: {exc}") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        """The KV dtype as a torch dtype."""
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per KV element."""
        return self.torch_dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token over all layers, K and V (Llama-3-8B bf16: 128 KiB)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * self.itemsize

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of `num_tokens` tokens of KV in this layout's format (a blob)."""
        if self.fmt == "vllm":
            return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_size)
        return (self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_size)

    @property
    def token_dim(self) -> int:
        """Index of the token dimension in a blob of this format (2 vllm, 3 huggingface)."""
        return 2 if self.fmt == "vllm" else 3

    @property
    def kv_offset(self) -> int:
        """Offset of the KV bytes in a chunk record (header + token ids, 64-aligned)."""
        return RECORD_HEADER_BYTES + _round_up(self.chunk_size * 8, _ALIGN)

    def record_bytes(self, num_tokens: int) -> int:
        """Bytes of the record of a chunk of `num_tokens` tokens."""
        return self.kv_offset + num_tokens * self.token_bytes

    @property
    def fingerprint(self) -> int:
        """64-bit identity of the layout, written into every record header."""
        return xxhash.xxh3_64_intdigest(repr(self.to_wire()).encode())

    def to_wire(self) -> Layout:
        """The layout as sent in HELLO (the daemon's namespace key)."""
        return Layout(
            model_name=self.model_name,
            world_size=self.world_size,
            worker_id=self.worker_id,
            fmt=self.fmt,
            dtype=self.dtype,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            chunk_size=self.chunk_size,
            record_bytes=self.record_bytes(self.chunk_size),
        )

    def numpy_alias(self) -> tuple[torch.dtype, type]:
        """(torch int dtype, numpy dtype) of the same width, for numpy copies."""
        return _NUMPY_ALIAS[self.itemsize]
