"""The layer loop of CacheBlend's prefill over a vLLM-style Llama decoder.

Why this file exists: CacheBlend (Yao et al., EuroSys 2025) and EPIC's LegoLink (Hu et
al., ICML 2025) compute only some rows of a prompt through some layers; the other rows'
K/V come from the cache, moved to their new positions. This module drives each decoder
layer from its submodules (`embed_input_ids`, `input_layernorm`, `qkv_proj`,
`rotary_emb`, `o_proj`, `post_attention_layernorm`, `mlp`) and lets a `BlendExecutor`
(executor.py) decide at each layer which rows go on. The selected rows attend over the
layer's long K/V through `attend_at_positions` (client/attention.py) or a caller's
attention. With every row selected it computes what the model's own forward computes.
Imports neither vllm nor transformers: the model is used through its attributes.
"""

import dataclasses
from typing import Callable

import torch

from lmcached.client.attention import attend_at_positions
from lmcached.client.blend.interfaces import BlendExecutor, BlendRetrieverTask

# (layer_id, k, v): the long K/V of one layer, `[num_tokens, num_kv_heads, head_size]`
# each, model dtype and device (reused rows re-rotated, fresh rows where recomputed).
LayerSink = Callable[[int, torch.Tensor, torch.Tensor], None]
# (layer_id, attn, q, k, v, positions) -> out: the selected rows' attention at one layer.
# attn: the layer's self_attn module (num_heads, num_kv_heads, scaling); q `[S, num_heads,
# head_size]` of the selected rows; k, v the layer's long K/V `[T, num_kv_heads,
# head_size]`; positions int64 `[S]` (increasing) of the selected rows, q's device.
# out: `[S, num_heads, head_size]`, key j visible to row i iff j <= positions[i].
AttentionFn = Callable[[int, torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor,
                        torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class BlendRun:
    """What `run_blended_layers` computed.

    Attributes:
        num_reused_tokens: tokens whose cached K/V were blended in.
        recomputed_indices: int64 `[n]`, cpu: the rows computed through the last layer.
    """

    num_reused_tokens: int
    recomputed_indices: torch.Tensor


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def run_blended_layers(model, input_ids: torch.Tensor, task: BlendRetrieverTask,
                       executor: BlendExecutor, sink: LayerSink,
                       attention: "AttentionFn | None" = None) -> BlendRun:
    """Prefill one prompt layer by layer, computing only the rows the executor selects.

    Per layer, with R the rows selected by the previous layer (every row at layer 0):
    input_layernorm, qkv_proj and the model's own rotary embedding for R, then
    `executor.blend` with the retriever's K/V of the layer (token axis 0); `sink` gets
    the layer's long K/V; then, except at the last layer (only its K/V are needed: vLLM
    computes the rest of the prompt), the selected rows S attend over the long K/V
    (`attention`: key j visible to query i iff j <= position of i), o_proj, the residual,
    post_attention_layernorm, mlp and the residual for S. A layer with no selected row
    calls no module (a zero-row matmul is skipped).

    Args:
        model: a vLLM model accepted by `check_blend_model` (one TP rank's: its heads;
            every rank calls this on the same rows, in step).
        input_ids: int64 `[num_tokens]`, cpu: the tokens to prefill, from position 0.
        task: their retrieval (one request); K/V per layer `[num_tokens, num_kv_heads,
            head_size]`.
        executor: a fresh executor (one per prompt) with its positional encoder set.
        sink: called once per layer, in order, with the layer's long K/V.
        attention: the selected rows' attention, called after `sink` (default
            `positions_attention`; client/vllm/blend_flash.py's reads the paged cache the
            sink wrote).

    Returns:
        BlendRun.
    """
    device = _model_device(model)
    decoder = model.model
    num_tokens = input_ids.numel()
    query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int64)
    all_positions = torch.arange(num_tokens, dtype=torch.int64)  # [T], cpu
    hidden = decoder.embed_input_ids(input_ids.to(device))  # [T, hidden_size]
    rows = all_positions  # int64 [n], cpu: rows of this layer's fresh q/k/v
    num_reused = 0
    last_layer = len(decoder.layers) - 1
    for layer_id, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        retrieved = task.result(layer_id)
        num_reused = int(retrieved.valid_mask.sum())
        rows_dev = rows.to(device)
        head_size = attn.head_dim
        if rows.numel():
            x = layer.input_layernorm(hidden[rows_dev])  # [n, hidden_size]
            qkv, _ = attn.qkv_proj(x)
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, k = attn.rotary_emb(all_positions[rows].to(device), q.contiguous(),
                                   k.contiguous())
        else:
            q = hidden.new_empty((0, attn.q_size))
            k = hidden.new_empty((0, attn.kv_size))
            v = hidden.new_empty((0, attn.kv_size))
        q = q.reshape(-1, attn.num_heads, head_size)  # [n, heads, head_size]
        k = k.reshape(-1, attn.num_kv_heads, head_size)  # [n, kv_heads, head_size]
        v = v.reshape(-1, attn.num_kv_heads, head_size)
        out = executor.blend(layer_id, retrieved.k, retrieved.v, retrieved.valid_mask,
                             retrieved.original_positions, q, k, v, all_positions[rows],
                             query_start_loc, token_dim=0)
        sink(layer_id, out.k, out.v)
        rows = out.local_indices.to("cpu", torch.int64)
        if layer_id == last_layer or not rows.numel():
            continue
        rows_dev = rows.to(device)
        attn_out = (attention or positions_attention)(layer_id, attn, out.q, out.k, out.v,
                                                 out.positions.to(device))
        attn_out = attn_out.reshape(rows.numel(), -1)  # [S, heads * head_size]
        o, _ = attn.o_proj(attn_out)
        selected = hidden[rows_dev] + o  # [S, hidden_size]
        selected = selected + layer.mlp(layer.post_attention_layernorm(selected))
        hidden[rows_dev] = selected
    return BlendRun(num_reused_tokens=num_reused, recomputed_indices=rows)


def positions_attention(layer_id: int, attn, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The selected rows' causal attention over the layer's long K/V, through
    `lmcached.client.attention.attend_at_positions` (the Hugging Face path's: SDPA
    kernels over the causal staircase, no dense mask on CPU). An `AttentionFn`; any
    device."""
    out = attend_at_positions(
        q.transpose(0, 1)[None],  # [1, heads, S, head_size]
        k.transpose(0, 1)[None],  # [1, kv_heads, T, head_size]
        v.transpose(0, 1)[None], positions, scale=attn.scaling,
    )  # [1, heads, S, head_size]
    return out[0].transpose(0, 1)  # [S, heads, head_size]
