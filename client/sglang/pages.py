"""SGLang HiCache pages as chunk records: the namespace, the key encoding and the copies.

Why this file exists: SGLang's host pool hands a storage backend each page as a few
pointer runs (`get_page_buffer_meta(indices)`: per page, one run per K/V buffer, or per
layer and K/V in the layer-first layout). A page is stored as one chunk record of an
"sglang" namespace, so that it takes part in everything chunk records do (the disk tier,
warm restart, L2, payload checksums); nothing here imports SGLang.

Record of one page (a `KVLayout` of KEY_TOKENS "tokens" of `2 * head_size` bytes)::

    offset 0        64                  kv_offset (4096)                + page_bytes
    | header (64)  | key ids           | the page's runs, in get_page_buffer_meta order | zero pad
    |  hash of key | int64[KEY_TOKENS]: |                                                | (< 1 KiB)
    |              | [length, key bytes]|                                                |

The "token ids" of the record are the page key's bytes (`key_tokens`), and the chunk hash
is `hash_block_tokens(ROOT_HASH, key_tokens(key))`: a reader that checks a record's
header and token ids (`Chain.acquire`) gets the page of exactly its key, never another
key's bytes, and the daemon's disk and L2 tiers verify a page from its key the same way
(the "sglang" format is unchained: `protocol.UNCHAINED_FORMATS`). A key longer than
KEY_BYTES_MAX bytes is represented by its SHA-256 digest.
"""

import ctypes
import dataclasses
import hashlib
import operator

import msgspec
import numpy as np

from lmcached.client.layout import KVLayout
from lmcached.wire.protocol import Layout
from lmcached.wire.record_format import ROOT_HASH, hash_block_tokens

# int64 slots of a page key in its record: its length, then its bytes. 504 puts the page
# at offset 4096 of its record (64 + 8 * 504): glibc's memcpy runs at half speed here when
# source and destination are misaligned that way (192 bytes: 9.7 GB/s, 4096: 24 GB/s).
KEY_TOKENS = 504
KEY_BYTES_MAX = 8 * (KEY_TOKENS - 1)  # 4024: SGLang's keys (64 hex digits) fit
_DIGEST_FLAG = 1 << 62  # length slot of a key kept as its SHA-256 digest
MAX_NAME_CHARS = 256  # protocol.Layout.model_name
_SIZE = operator.itemgetter(1)  # bytes of an (address, bytes) run


def key_tokens(key: str) -> np.ndarray:
    """The int64 `[KEY_TOKENS]` "token ids" of page `key` (its record's identity).

    Slot 0 holds the key's length in bytes, the others its UTF-8 bytes, zero-padded; a
    key longer than KEY_BYTES_MAX bytes holds `_DIGEST_FLAG | length` and its SHA-256.
    """
    return keys_tokens([key])[0]


def keys_tokens(keys: list[str]) -> np.ndarray:
    """The int64 `[len(keys), KEY_TOKENS]` key ids of `keys` (`key_tokens` of each), in
    one buffer: a batch's rows, and its flat token array for the record checks."""
    row = 8 * KEY_TOKENS
    raws = [key.encode() for key in keys]
    length = len(raws[0]) if raws else 0
    if raws and length <= KEY_BYTES_MAX and all(len(raw) == length for raw in raws):
        rows = np.zeros((len(keys), row), dtype=np.uint8)  # keys of one length: one copy
        rows[:, :8] = np.frombuffer(length.to_bytes(8, "little"), dtype=np.uint8)
        rows[:, 8 : 8 + length] = np.frombuffer(b"".join(raws), dtype=np.uint8).reshape(
            len(keys), length)
        return rows.view(np.int64)
    buf = bytearray(row * len(keys))
    for i, raw in enumerate(raws):
        at = i * row
        if len(raw) > KEY_BYTES_MAX:
            buf[at : at + 8] = (_DIGEST_FLAG | len(raw)).to_bytes(8, "little")
            buf[at + 8 : at + 40] = hashlib.sha256(raw).digest()
        else:
            buf[at : at + 8] = len(raw).to_bytes(8, "little")
            buf[at + 8 : at + 8 + len(raw)] = raw
    return np.frombuffer(buf, dtype=np.int64).reshape(len(keys), KEY_TOKENS)


def key_slots(tokens: np.ndarray) -> int:
    """How many leading int64 slots of the key ids `tokens` (`keys_tokens`, `[n,
    KEY_TOKENS]`) hold every key's identity (its length slot and its bytes, or its
    digest); the slots after them are zero in every row."""
    lengths = tokens[:, 0]
    digest = (lengths & _DIGEST_FLAG) != 0
    slots = np.where(digest, 1 + 32 // 8, 1 + (lengths + 7) // 8)
    return int(slots.max()) if len(slots) else 1


def keys_slots(keys: list[str]) -> int:
    """`key_slots(keys_tokens(keys))`, from the keys' byte lengths alone (right after a
    batch's copies have flushed the caches, reading the first slot of each 4 KiB row
    costs some 40 us, the lengths a few)."""
    lengths = [len(key.encode()) for key in keys]
    return max((1 + 32 // 8 if n > KEY_BYTES_MAX else 1 + (n + 7) // 8 for n in lengths),
               default=1)


def page_hash(tokens: np.ndarray) -> bytes:
    """The 16-byte chunk hash of a page whose key ids are `tokens` (`key_tokens`)."""
    return hash_block_tokens(ROOT_HASH, tokens)


@dataclasses.dataclass(frozen=True)
class PageLayout(KVLayout):
    """A `KVLayout` whose namespace has the "sglang" format (its chunks are unchained
    pages, `protocol.UNCHAINED_FORMATS`); records are laid out as fmt "vllm" ones."""

    def to_wire(self) -> Layout:
        """The layout as sent in HELLO, with fmt "sglang"."""
        return msgspec.structs.replace(super().to_wire(), fmt="sglang")


def page_layout(name: str, world_size: int, worker_id: int, page_bytes: int) -> PageLayout:
    """The record layout of pages of `page_bytes` bytes in namespace `name`.

    Args:
        name: the namespace's model name (`namespace_name`), at most MAX_NAME_CHARS.
        world_size / worker_id: the ranks that share nothing (1 / 0: one copy for all).
        page_bytes: bytes of one page (the sum of its runs), >= 1.

    Raises:
        ValueError: a field out of range (`KVLayout`'s message).
    """
    head_size = -(-page_bytes // (2 * KEY_TOKENS))  # 2 * KEY_TOKENS * head_size >= page_bytes
    return PageLayout(model_name=name, num_layers=1, num_kv_heads=1, head_size=head_size,
                      dtype="uint8", chunk_size=KEY_TOKENS, fmt="vllm",
                      world_size=world_size, worker_id=worker_id)


def namespace_name(model_name: str | None, pool_layout: str, dtype: str, page_size: int,
                   run_bytes: list[int], parts: list[str]) -> str:
    """The model name of an SGLang namespace: who may share pages.

    Two SGLang processes share pages only when the model, the host pool's layout and
    dtype, the page size, the runs of a page (their byte sizes) and the rank parts
    (`parts`, e.g. "pp1of2") are equal. A name longer than MAX_NAME_CHARS keeps its
    head and ends with a SHA-256 prefix of the whole.
    """
    runs = "-".join(str(n) for n in run_bytes)
    name = "/".join(["sglang", model_name or "model", pool_layout, dtype,
                     f"p{page_size}", f"r{runs}", *parts])
    if len(name) > MAX_NAME_CHARS:
        digest = hashlib.sha256(name.encode()).hexdigest()[:32]
        name = f"{name[: MAX_NAME_CHARS - 33]}~{digest}"
    return name


def record_runs(base_ptr: int, block_offset, block_bytes: int, span: list[int],
                start: int, end: int) -> list[tuple[int, int]]:
    """(address, bytes) runs of bytes [start, end) of the record in `span`, in order.

    Args:
        base_ptr: the arena's address (`Arena.base_ptr`).
        block_offset: `Arena.block_offset`.
        block_bytes: the arena's block size.
        span: the record's block ids.
    """
    index, offset = divmod(start, block_bytes)
    if offset + end - start <= block_bytes:  # in one block (a block holds a whole page)
        return [(base_ptr + block_offset(span[index]) + offset, end - start)]
    runs = []
    while start < end:
        index, offset = divmod(start, block_bytes)
        n = min(end - start, block_bytes - offset)
        runs.append((base_ptr + block_offset(span[index]) + offset, n))
        start += n
    return runs


def copy_runs(dst: list[tuple[int, int]], src: list[tuple[int, int]]) -> None:
    """memmove the bytes of the `src` runs into the `dst` runs, in order (one memcpy
    per overlap of a source and a destination run).

    Raises:
        ValueError: the runs hold different numbers of bytes.
    """
    if sum(map(_SIZE, dst)) != sum(map(_SIZE, src)):
        raise ValueError(f"copy of {sum(map(_SIZE, src))} bytes into "
                         f"{sum(map(_SIZE, dst))}: the page runs do not match the record")
    memmove = ctypes.memmove
    if len(src) == 1:  # a record in one block into the page's runs
        saddr = src[0][0]
        for daddr, n in dst:
            memmove(daddr, saddr, n)
            saddr += n
        return
    if len(dst) == 1:  # the page's runs into a record in one block
        daddr = dst[0][0]
        for saddr, n in src:
            memmove(daddr, saddr, n)
            daddr += n
        return
    di = si = doff = soff = 0
    while di < len(dst) and si < len(src):
        daddr, dn = dst[di]
        saddr, sn = src[si]
        n = min(dn - doff, sn - soff)
        ctypes.memmove(daddr + doff, saddr + soff, n)
        doff += n
        soff += n
        if doff == dn:
            di, doff = di + 1, 0
        if soff == sn:
            si, soff = si + 1, 0


def zero_runs(runs: list[tuple[int, int]]) -> None:
    """Zero the bytes of `runs`."""
    for addr, n in runs:
        ctypes.memset(addr, 0, n)
