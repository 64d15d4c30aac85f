"""The interfaces of CacheBlend: what a retriever hands a layer, and what blending returns.

Why this file exists: CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model
Serving for RAG with Cached Knowledge Fusion", EuroSys 2025) splits into a retriever
(which KV of a prompt is cached, and where it was computed) and an executor (which
tokens to recompute, and how reused K is moved to its new positions). These are the
names and semantics of LMCache's `lmcache.blend.interfaces`, so code written against
LMCache's blending reads the same here; `executor.py` and `retriever.py` implement them
on lmcached's daemon.

Shapes: a layer's K or V is one tensor whose token axis is `token_dim` (1 for the
huggingface format `[num_kv_heads, num_tokens, head_size]`, 0 for the vllm format
`[num_tokens, num_kv_heads, head_size]`). A batch is the concatenation of its requests
along the token axis; `query_start_loc` (int64 `[batch + 1]`, CPU) holds where each
request starts, as in vLLM's attention metadata.
"""

import abc
import dataclasses
from typing import Callable

import torch

# (positions int64 [num_tokens], q, k) -> (q, k): RoPE (or any position encoding)
# applied at `positions`, with q and k token-first (`[num_tokens, ..., head_size]`, as
# vLLM's rotary embedding takes them; executors move a layer's token axis first); q may
# be None (the executors rotate K only). LMCache's `PositionalEncoder`.
PositionalEncoder = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor],
                             tuple[torch.Tensor | None, torch.Tensor]]


@dataclasses.dataclass
class BlendRetrieverResult:
    """The retrieved KV of one layer, covering every input token of the request(s).

    Attributes:
        k: K of the layer, every input token along the token axis (undefined where
            `valid_mask` is False), as it was stored: rotated at `original_positions`.
            None when nothing was retrieved.
        v: V of the layer, same shape; None when nothing was retrieved.
        valid_mask: bool `[num_tokens]` on CPU: True where K and V were retrieved.
        original_positions: int64 `[num_tokens]` on CPU: the position each retrieved
            token had when its KV was computed (its index in its segment, since segments
            are stored from position 0); 0 where `valid_mask` is False.
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    valid_mask: torch.Tensor
    original_positions: torch.Tensor


class BlendRetrieverTask(abc.ABC):
    """The retrieval of one batch of requests; LMCache's `BlendRetrieverTask`."""

    @abc.abstractmethod
    def result(self, layer_id: int) -> BlendRetrieverResult:
        """The retrieved K/V of layer `layer_id` (0-based), blocking until it is ready.

        Raises:
            IndexError: layer_id out of range.
            RuntimeError: the task was released.
        """


class BlendRetriever(abc.ABC):
    """Finds the cached KV of a batch of inputs; LMCache's `BlendRetriever`."""

    @abc.abstractmethod
    def new_request(self, input_tokens: torch.Tensor,
                    query_start_loc: torch.Tensor) -> BlendRetrieverTask:
        """Start retrieving the KV of `input_tokens` (int64 `[num_tokens]`, a batch laid
        out by `query_start_loc`)."""


@dataclasses.dataclass
class BlendOutput:
    """What one layer computes with, after blending; LMCache's `BlendOutput`.

    Attributes:
        q: Q of the selected tokens only (token axis as given to `blend`); None when
            `blend` got fresh_q None (`BlendExecutor.selects_from_fresh_k`).
        k: K of every token, fresh where selected and reused elsewhere.
        v: V of every token, same.
        positions: int64 positions (in their request) of the selected tokens.
        local_indices: int64 indices, into the whole batch, of the selected tokens,
            ascending; the rows of `q`.
        query_start_loc: int64 `[batch + 1]` starts of each request in `q` when this
            layer changed the selection, else None.
    """

    q: torch.Tensor | None
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    local_indices: torch.Tensor
    query_start_loc: torch.Tensor | None


class BlendExecutor(abc.ABC):
    """Decides, layer by layer, which tokens are recomputed; LMCache's `BlendExecutor`."""

    @abc.abstractmethod
    def blend(self, layer_id: int, retrieved_k: torch.Tensor | None,
              retrieved_v: torch.Tensor | None, valid_mask: torch.Tensor,
              original_positions: torch.Tensor, fresh_q: torch.Tensor,
              fresh_k: torch.Tensor, fresh_v: torch.Tensor, positions: torch.Tensor,
              query_start_loc: torch.Tensor, token_dim: int) -> BlendOutput:
        """Blend one layer's retrieved K/V with the fresh Q/K/V of the tokens computed now.

        Args:
            layer_id: 0-based layer, called in order for each layer of one batch.
            retrieved_k, retrieved_v, valid_mask, original_positions: the retriever's
                result for this layer (`BlendRetrieverResult`).
            fresh_q, fresh_k, fresh_v: Q/K/V computed now, RoPE applied at `positions`,
                for the tokens selected by the previous layer (every token at the first);
                fresh_q may be None where `selects_from_fresh_k(layer_id)`.
            positions: int64 positions (in their request) of the rows of fresh Q/K/V.
            query_start_loc: the batch's original `[batch + 1]` request starts (never
                the updated one).
            token_dim: the token axis of K/V (and of Q).
        """

    def fresh_rows(self, layer_id: int, valid_mask: torch.Tensor,
                   original_positions: torch.Tensor,
                   query_start_loc: torch.Tensor) -> torch.Tensor | None:
        """The rows whose fresh Q/K/V `blend(layer_id, ...)` needs, where the executor
        knows them before they are computed, so that the caller computes only those (an
        lmcached addition; LMCache's executors take every token at the first layer).

        Args:
            layer_id, valid_mask, original_positions, query_start_loc: as `blend`'s.

        Returns:
            int64 `[n]` ascending indices into the batch, cpu; or None: the rows `blend`
            documents (every token at the first layer, the previous layer's
            local_indices after).
        """
        return None

    def selects_from_fresh_k(self, layer_id: int) -> bool:
        """True where `blend(layer_id, ...)` picks the rows that go on from that layer's
        fresh K (CacheBlend's check layer): the caller may then pass `fresh_q=None`,
        get `BlendOutput.q` None and compute Q of `local_indices` only (an lmcached
        addition; every other layer needs fresh_q).

        Args:
            layer_id: 0-based layer.
        """
        return False
