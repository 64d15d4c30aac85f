"""KV exchange buffers between a producer and a consumer process (seed adapters).

Why this file exists: vLLM's disaggregated-prefill buffers (`KVLookupBufferBase`,
`KVStoreBufferBase`, both under `KVCacheBufferBase`) move KV from a prefill process to a
decode process. Here both sides open the same daemon namespace and exchange tensors
through shared memory: the producer writes each tensor once into arena blocks, the
consumer copies it out once.

The three abstract bases are defined here, with vLLM's names, methods and contracts, so
that code typed against them accepts our buffers without importing vLLM:

    KVCacheBufferBase           close()
      +- KVLookupBufferBase     insert(), drop_select()   <- KVLookupBuffer
      +- KVStoreBufferBase      put(), get()              <- KVStoreBuffer
"""

import abc
import uuid

import numpy as np
import torch
import xxhash

from lmcached.client.adapters.tensor_store import TensorStore, kv_namespace
from lmcached.client.hashing import FIXED_SEED, as_token_array

_PARTS = ("input_tokens", "roi", "key", "value", "hidden")


class KVCacheBufferBase(abc.ABC):
    """A buffer that moves KV cache between processes (seed: vLLM's KVCacheBufferBase)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the buffer and release its resources once it is no longer needed.

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError


class KVLookupBufferBase(KVCacheBufferBase):
    """A lookup buffer of KV entries (seed: vLLM's KVLookupBufferBase).

    An entry's key is `input_tokens` (token ids `[num_tokens]`) and `roi`, a bool mask
    `[num_tokens]` on top of them: the tokens the KV belongs to. Its value is `key` and
    `value` (the KV tensors) and `hidden` (the final hidden state, which lets the
    consumer skip the forward pass).
    """

    @abc.abstractmethod
    def insert(self, input_tokens: torch.Tensor, roi: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, hidden: torch.Tensor) -> None:
        """Insert an entry: `buffer[input_tokens, roi] = [key, value, hidden]`.

        Args:
            input_tokens: token ids `[num_tokens]`.
            roi: bool mask `[num_tokens]` on top of the input tokens.
            key / value: the KV cache tensors.
            hidden: the final hidden state of the forward pass.

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError

    @abc.abstractmethod
    def drop_select(self, input_tokens: torch.Tensor | None,
                    roi: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Select an entry, remove it from the buffer and return it:
        `buffer.pop(input_tokens, roi)`. With `input_tokens` and `roi` None, any entry.

        Args:
            input_tokens: token ids `[num_tokens]`, or None.
            roi: bool mask `[num_tokens]`, or None.

        Returns:
            The entry's tensors; any of them may be None.

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError


class KVStoreBufferBase(KVCacheBufferBase):
    """A key-value buffer of tensors (seed: vLLM's KVStoreBufferBase).

    Keys are unique strings; a value is a tensor, or None for deletion / no value.
    """

    @abc.abstractmethod
    def put(self, key: str, value: torch.Tensor | None) -> None:
        """Store `value` under `key` (a key, value or hidden-state tensor).

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError

    @abc.abstractmethod
    def get(self, key: str) -> torch.Tensor | None:
        """The tensor stored under `key`, or None.

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError


class KVStoreBuffer(KVStoreBufferBase):
    """Tensors by string key shared by every process of a namespace.

    Args:
        socket / name: the daemon.
        namespace: the key space.
    """

    def __init__(self, socket: str | None = None, name: str | None = None,
                 namespace: str = "lmcached-kv-store") -> None:
        self._store = TensorStore(kv_namespace(namespace), socket, name)

    def put(self, key: str, value: torch.Tensor | None) -> None:
        """Store `value` under `key`; None deletes the key."""
        if value is None:
            self._store.delete(key)
        else:
            self._store.put(key, value)

    def get(self, key: str) -> torch.Tensor | None:
        """The tensor under `key` (a copy), or None."""
        return self._store.get(key)

    def close(self) -> None:
        """End the daemon session (stored values stay in the daemon)."""
        self._store.close()


class KVLookupBuffer(KVLookupBufferBase):
    """Entries of (input_tokens, roi, key, value, hidden), matched by their tokens.

    A vLLM KVLookupBufferBase: `insert` on the producer, `drop_select` on the
    consumer, which removes the entry it returns. An entry matches a request when the
    tokens selected by the roi mask are equal. Inserting the same tokens twice queues two
    entries; two consumers never receive the same entry (the daemon's DELETE decides).
    Entries are cache values: under memory pressure the least recently used unconsumed
    entries are evicted like any other value (size the arena for the transfer backlog).

    Args:
        socket / name: the daemon.
        namespace: the key space shared by producer and consumer.
    """

    def __init__(self, socket: str | None = None, name: str | None = None,
                 namespace: str = "lmcached-lookup-buffer") -> None:
        self._store = TensorStore(kv_namespace(namespace), socket, name)

    @staticmethod
    def _match_key(input_tokens: torch.Tensor, roi: torch.Tensor | None) -> str:
        tokens = as_token_array(input_tokens)
        if roi is not None:
            tokens = tokens[np.asarray(roi.cpu() if isinstance(roi, torch.Tensor) else roi, dtype=bool)]
        return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(tokens), seed=FIXED_SEED)

    def insert(self, input_tokens: torch.Tensor, roi: torch.Tensor | None, key: torch.Tensor | None,
               value: torch.Tensor | None, hidden: torch.Tensor | None) -> bool:
        """Publish one entry. Returns False when it could not be stored (no space/daemon)."""
        entry = f"{self._match_key(input_tokens, roi)}:{uuid.uuid4().hex}"
        tensors = (input_tokens, roi, key, value, hidden)
        for part, tensor in zip(_PARTS, tensors):
            if tensor is not None and not self._store.put(f"p:{entry}/{part}", tensor):
                self._drop_parts(entry)
                return False
        # The marker goes last: a consumer that sees it finds every part.
        if not self._store.put(f"e:{entry}", torch.zeros(0, dtype=torch.uint8)):
            self._drop_parts(entry)
            return False
        return True

    def drop_select(self, input_tokens: torch.Tensor | None, roi: torch.Tensor | None) -> list:
        """Remove and return a matching entry as [input_tokens, roi, key, value, hidden].

        `drop_select(None, None)` takes any entry. Returns five Nones when none matches.
        """
        prefix = "e:" if input_tokens is None else f"e:{self._match_key(input_tokens, roi)}:"
        for marker in self._store.scan(prefix, limit=64):
            if self._store.delete(marker):  # claimed: no other consumer gets it
                entry = marker[2:]
                parts = [self._store.get(f"p:{entry}/{part}") for part in _PARTS]
                self._drop_parts(entry)
                return parts
        return [None] * len(_PARTS)

    def _drop_parts(self, entry: str) -> None:
        for part in _PARTS:
            self._store.delete(f"p:{entry}/{part}")

    def close(self) -> None:
        """End the daemon session (stored values stay in the daemon)."""
        self._store.close()
