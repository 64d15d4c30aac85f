"""The one layer loop of CacheBlend's prefill, over a small decoder-adapter interface.

Why this file exists: CacheBlend (Yao et al., EuroSys 2025) and EPIC's LegoLink (Hu et
al., ICML 2025) compute only some rows of a prompt through some layers; the other rows'
K/V come from the cache, moved to their new positions. No engine's forward does that
(every row of every layer), so the prefill drives each decoder layer from its parts and
lets a `BlendExecutor` (executor.py) decide at each layer which rows go on. The loop is
written once, here; an engine supplies a `DecoderAdapter` that knows its modules:

    DecoderAdapter      the Hugging Face one: client/hf_blend.py (transformers modules,
                        K/V kept in a DynamicCache, last token's hidden state for logits)
                        the vLLM one: client/vllm/blend_layers.py (fused qkv_proj, vLLM's
                        rotary embedding, K/V written into the paged cache)

Per layer, with R the rows selected by the previous layer (at layer 0 every row, or
those `executor.fresh_rows` names, e.g. LegoLink's selection, known before any layer):

    input norm, K/V (RoPE at R's positions) for R; Q for R too, unless the executor
    selects from fresh K at this layer (CacheBlend's check layer): then Q after blend,
    for the selected rows only (an adapter whose Q comes with K/V anyway, a fused
    projection, may hand it over: the selection is the same)
    executor.blend(...) with the retriever's K/V of the layer (token axis 0)
    write_kv(layer, long K/V)                       (every row of the prompt)
    the selected rows S attend over the long K/V (key j visible to query i iff j <= i's
    position), o_proj, residual, post-attention norm, MLP, residual, for S

Hidden states of rows outside S keep their last value and are never read again. At the
last layer only its K/V are needed, plus, where the caller needs logits
(`last_token_output`), the prompt's last token's output: that token is then always
recomputed, and only its row goes through the last layer's attention and MLP. A layer
with no row to compute calls no module. With every row selected the loop computes what
the model's own forward computes.

Imports neither transformers nor vllm: adapters hold the engine's modules.
"""

import abc
import dataclasses

import torch

from lmcached.client.blend.interfaces import BlendExecutor, BlendRetrieverTask


class DecoderAdapter(abc.ABC):
    """What the layer loop needs of one Llama-style decoder (pre-norm attention + MLP,
    RoPE). Tensors are token-major: hidden `[n, hidden_size]`, Q `[n, num_heads,
    head_size]`, K/V `[n, num_kv_heads, head_size]`, on `device`, model dtype.

    Attributes:
        num_layers: decoder layers.
        device: where the model's weights are.
    """

    num_layers: int
    device: torch.device

    @abc.abstractmethod
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states `[T, hidden_size]` of the prompt's tokens (int64 `[T]`, cpu) at
        positions 0..T-1, before layer 0."""

    @abc.abstractmethod
    def head_shape(self, layer_id: int) -> tuple[int, int, int]:
        """(num_heads, num_kv_heads, head_size) of one layer (of this TP rank)."""

    @abc.abstractmethod
    def input_norm(self, layer_id: int, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input norm of `hidden` `[n, hidden_size]` (n >= 1)."""

    @abc.abstractmethod
    def project(self, layer_id: int, x: torch.Tensor, positions: torch.Tensor,
                with_q: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Q, K, V of the normed rows `x` `[n, hidden_size]`, RoPE on Q and K at
        `positions` (int64 `[n]`, device). Q may be None where `with_q` is False (an
        adapter whose Q comes at no cost with K/V may return it anyway)."""

    @abc.abstractmethod
    def project_q(self, layer_id: int, x: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        """Q of the normed rows `x` `[n, hidden_size]`, RoPE at `positions`."""

    @abc.abstractmethod
    def write_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Receive the layer's long K/V `[T, num_kv_heads, head_size]` each (reused rows
        re-rotated, fresh rows where computed); called once per layer, in order, before
        the layer's `attend`. The tensors are not modified later."""

    @abc.abstractmethod
    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Causal attention of the selected rows: q `[S, num_heads, head_size]`, the
        layer's long k/v `[T, num_kv_heads, head_size]`, positions int64 `[S]`, cpu,
        increasing; key j visible to row i iff j <= positions[i]. Returns `[S,
        num_heads, head_size]`."""

    @abc.abstractmethod
    def finish(self, layer_id: int, hidden: torch.Tensor,
               attn_out: torch.Tensor) -> torch.Tensor:
        """The rest of the layer for the selected rows: o_proj of `attn_out` `[S,
        num_heads, head_size]`, the residual onto `hidden` `[S, hidden_size]`, the
        post-attention norm, the MLP and its residual. Returns `[S, hidden_size]`."""


@dataclasses.dataclass
class LayerLoopRun:
    """What `run_layers` computed.

    Attributes:
        hidden: `[T, hidden_size]`, device: hidden states after the last layer each row
            went through (the prompt's last row: after the last layer, where
            `last_token_output`).
        num_reused_tokens: tokens whose cached K/V were blended in (the last layer's
            valid mask; without the last token where `last_token_output`).
        recomputed_indices: int64 `[n]`, cpu: the rows whose K/V the last layer computed.
    """

    hidden: torch.Tensor
    num_reused_tokens: int
    recomputed_indices: torch.Tensor


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device, non_blocking=True)


def run_layers(decoder: DecoderAdapter, input_ids: torch.Tensor, task: BlendRetrieverTask,
               executor: BlendExecutor, last_token_output: bool) -> LayerLoopRun:
    """Prefill one prompt layer by layer, computing only the rows the executor selects
    (see the module docstring for the steps of a layer).

    Args:
        decoder: the model's adapter (every TP rank calls this on the same rows, in step).
        input_ids: int64 `[num_tokens]`, cpu: the prompt, from position 0.
        task: its retrieval (one request, `query_start_loc = [0, num_tokens]`); K/V per
            layer token-major, `[num_tokens, num_kv_heads, head_size]`.
        executor: a fresh executor (one per prompt) with its positional encoder set.
        last_token_output: the caller reads the last token's output (its logits): that
            token is always recomputed, and the last layer's attention and MLP run for
            it alone; False: the last layer computes K/V only.

    Returns:
        LayerLoopRun.
    """
    device = decoder.device
    num_tokens = input_ids.numel()
    query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int64)
    all_positions = torch.arange(num_tokens, dtype=torch.int64)  # [T], cpu
    hidden = decoder.embed(input_ids)  # [T, hidden_size]
    rows = all_positions  # int64 [n], cpu: rows of this layer's fresh q/k/v
    num_reused = 0
    last_layer = decoder.num_layers - 1
    for layer_id in range(decoder.num_layers):
        retrieved = task.result(layer_id)
        valid_mask = retrieved.valid_mask
        if last_token_output:  # its output gives the logits: always recomputed
            valid_mask = valid_mask.to(torch.bool).clone()
            valid_mask[-1] = False
        num_reused = int(valid_mask.sum())
        ahead = executor.fresh_rows(layer_id, valid_mask, retrieved.original_positions,
                                    query_start_loc)
        if ahead is not None:  # e.g. LegoLink's selection, known before layer 0
            rows = ahead.to("cpu", torch.int64)
        q_after = executor.selects_from_fresh_k(layer_id)
        x = None
        if rows.numel():
            rows_dev = rows.to(device)
            x = decoder.input_norm(layer_id, hidden[rows_dev])  # [n, hidden_size]
            q, k, v = decoder.project(layer_id, x, rows_dev, with_q=not q_after)
        else:  # nothing to compute: no module is called on zero rows
            num_heads, num_kv_heads, head_size = decoder.head_shape(layer_id)
            q = hidden.new_empty((0, num_heads, head_size))
            k = hidden.new_empty((0, num_kv_heads, head_size))
            v = hidden.new_empty((0, num_kv_heads, head_size))
        out = executor.blend(
            layer_id, _to(retrieved.k, device), _to(retrieved.v, device), valid_mask,
            retrieved.original_positions, q, k, v, all_positions[rows], query_start_loc,
            token_dim=0,
        )
        selected = out.local_indices.to("cpu", torch.int64)
        if out.q is None:  # [S, heads, head_size]: Q of the selected rows, computed now
            local = torch.searchsorted(rows, selected).to(device)
            out.q = decoder.project_q(layer_id, x[local], selected.to(device))
        rows = selected
        decoder.write_kv(layer_id, out.k, out.v)
        if layer_id == last_layer and not last_token_output:
            break
        # At the last layer only the last row's output is read (the logits).
        tail = slice(-1, None) if layer_id == last_layer else slice(None)
        rows_out = rows[tail]
        if not rows_out.numel():
            continue
        rows_dev = rows_out.to(device)
        attn_out = decoder.attend(layer_id, out.q[tail], out.k, out.v, out.positions[tail])
        hidden[rows_dev] = decoder.finish(layer_id, hidden[rows_dev], attn_out)

    assert not last_token_output or int(rows[-1]) == num_tokens - 1, (
        "the prompt's last token was not recomputed through the last layer: the "
        "executor dropped a row marked not-valid (bug)"
    )
    return LayerLoopRun(hidden=hidden, num_reused_tokens=num_reused,
                        recomputed_indices=rows)
