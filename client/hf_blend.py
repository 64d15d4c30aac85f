"""Run a Llama-family decoder layer by layer over blended K/V: the prefill of CacheBlend.

Why this file exists: CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model
Serving for RAG with Cached Knowledge Fusion", EuroSys 2025) and EPIC's LegoLink (Hu et
al., "EPIC: Efficient Position-Independent Caching for Serving Large Language Models",
ICML 2025) compute only some rows of a prompt through some layers; those rows attend over
the K/V of every token, where the other rows' K/V come from the cache. A transformers
forward computes every row of every layer, so this module drives each decoder layer from
its submodules (input_layernorm, q/k/v projections, rotary embedding, attention, o_proj,
post_attention_layernorm, mlp) and lets a `BlendExecutor` (client/blend/executor.py,
after LMCache's `lmcache.blend`) decide at each layer which rows go on. With every row
selected it computes what the model's own forward computes.

Used by hf.py, which holds the public API (`store_segments`, `blend_prefill`); these two
are the only modules of lmcached.client importing transformers.
"""

import dataclasses

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import rotate_half

from lmcached.client.attention import PositionsPlan, attend_at_positions
from lmcached.client.blend.interfaces import BlendExecutor, BlendRetrieverTask

# Model types whose decoder is exactly embed_tokens -> layers -> norm -> lm_head, each
# layer pre-norm attention + MLP with plain q/k/v/o projections and RoPE from
# `model.model.rotary_emb` (no q/k norms, no embedding or logit scaling, no soft-capping).
BLEND_MODEL_TYPES = ("llama", "mistral", "qwen2")

_ATTENTION_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj"}
_LAYER_MODULES = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def check_blend_supported(model: PreTrainedModel) -> None:
    """Refuse models whose decoder layer this module does not reproduce exactly.

    Raises:
        ValueError: a model type outside `BLEND_MODEL_TYPES`, or a decoder layer with
            submodules other than the Llama ones (the message says which).
    """
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if model_type not in BLEND_MODEL_TYPES:
        raise ValueError(
            f"blending runs the decoder layer by layer and supports model types "
            f"{BLEND_MODEL_TYPES}, not {model_type!r}: use generate_with_cache (prefix "
            "caching) for this model"
        )
    for layer in model.model.layers:
        layer_modules = {name for name, _ in layer.named_children()}
        attn_modules = {name for name, _ in layer.self_attn.named_children()}
        if layer_modules != _LAYER_MODULES or attn_modules != _ATTENTION_MODULES:
            raise ValueError(
                f"{model_type} decoder layer has submodules {sorted(layer_modules)} / "
                f"attention {sorted(attn_modules)}; blending reproduces only "
                f"{sorted(_LAYER_MODULES)} / {sorted(_ATTENTION_MODULES)}"
            )


@dataclasses.dataclass
class BlendedLayers:
    """What `run_blended_layers` computed.

    Attributes:
        last_hidden: `[hidden_size]`, model dtype and device: the prompt's last token's
            hidden state after the last decoder layer (before the final norm).
        cache: a DynamicCache of every layer's K/V over the whole prompt, each
            `[1, num_kv_heads, num_tokens, head_size]`: the long K/V attention used
            (fresh rows where recomputed, re-rotated cached rows elsewhere).
        num_reused_tokens: tokens whose cached K/V were blended in (the last token,
            always recomputed, excluded).
        recomputed_indices: int64 `[n]`, cpu: the rows whose K/V the last layer
            computed (its attention and MLP ran for the last of them only).
    """

    last_hidden: torch.Tensor
    cache: DynamicCache
    num_reused_tokens: int
    recomputed_indices: torch.Tensor


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device, non_blocking=True)


def _project(proj: torch.nn.Module, x: torch.Tensor, head_size: int,
             cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """`proj(x)` per head, token-major `[n, heads, head_size]` (as the segments are
    stored, client/blend/segments.py), with RoPE at the rows' positions where cos/sin
    (`[n, head_size]`) are given: transformers' `apply_rotary_pos_emb`, one tensor at a
    time. x: `[n, hidden_size]`."""
    out = proj(x).view(x.shape[0], -1, head_size)
    if cos is None:
        return out
    return (out * cos[:, None]) + (rotate_half(out) * sin[:, None])


def run_blended_layers(model: PreTrainedModel, input_ids: torch.Tensor,
                       task: BlendRetrieverTask, executor: BlendExecutor) -> BlendedLayers:
    """Prefill one prompt layer by layer, computing only the rows the executor selects.

    Per layer, with R the rows selected by the previous layer (at layer 0 every row, or
    those `executor.fresh_rows` names, e.g. LegoLink's selection):
    input_layernorm, q/k/v projections and RoPE for R (cos/sin of the model's own
    `rotary_emb`; Q after blend, of the selected rows only, where the executor selects
    from fresh K: CacheBlend's check layer), then `executor.blend` with the retriever's
    K/V of the layer; the
    selected rows S attend over the long K/V it returns, key j visible to query i iff
    j <= position of i (`attend_at_positions`: unmasked key blocks and small masked
    squares merged by log-sum-exp on CPU, no dense mask); then o_proj, the
    residual, post_attention_layernorm, mlp and the residual for S. Hidden states of
    rows outside S keep their last computed value and are never read again. At the
    last layer only the last row goes on after blend (its hidden state gives the
    logits; the others' would be read by no one), as vLLM's blend path does.

    Args:
        model: a model accepted by `check_blend_supported`, in eval mode.
        input_ids: int64 `[num_tokens]`, the prompt (any device).
        task: the retrieval of `input_ids` (one request, `query_start_loc = [0, n]`) in
            the segment namespace: its K/V per layer are token-major, `[num_tokens,
            num_kv_heads, head_size]` (client/blend/segments.py).
        executor: a fresh executor (one per prompt) with its positional encoder set.

    Returns:
        BlendedLayers.
    """
    device = model.device
    decoder = model.model
    num_tokens = input_ids.numel()
    query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int64)
    all_positions = torch.arange(num_tokens, dtype=torch.int64)  # [T], cpu
    key_positions = all_positions.to(device)  # [T]: long K/V row j is position j

    hidden = decoder.embed_tokens(input_ids.to(device)[None])  # [1, T, hidden_size]
    cos, sin = decoder.rotary_emb(hidden, key_positions[None])  # [1, T, head_size] each
    cos, sin = cos[0], sin[0]
    hidden = hidden[0]  # [T, hidden_size]

    rows = all_positions  # [n] int64 cpu: rows of the fresh q/k/v of this layer
    layers, num_reused = [], 0
    last_layer = len(decoder.layers) - 1
    plan = None  # PositionsPlan of the rows that attend, reused while they stay the same
    for layer_id, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        retrieved = task.result(layer_id)
        # The last token's output gives the logits: it is always recomputed.
        valid_mask = retrieved.valid_mask.to(torch.bool).clone()
        valid_mask[-1] = False
        num_reused = int(valid_mask.sum())
        ahead = executor.fresh_rows(layer_id, valid_mask, retrieved.original_positions,
                                    query_start_loc)
        if ahead is not None:  # e.g. LegoLink's selection, known before layer 0
            rows = ahead.to("cpu", torch.int64)

        rows_dev = rows.to(device)
        x = layer.input_layernorm(hidden[rows_dev])  # [n, hidden_size]
        row_cos, row_sin = cos[rows_dev], sin[rows_dev]  # [n, head_size] each
        k = _project(attn.k_proj, x, attn.head_dim, row_cos, row_sin)  # [n, kv_heads, head_size]
        v = _project(attn.v_proj, x, attn.head_dim)  # [n, kv_heads, head_size]
        # Where the executor picks the rows from this layer's fresh K (CacheBlend's check
        # layer), Q is projected after it, for the selected rows only.
        q_after = executor.selects_from_fresh_k(layer_id)
        q = None if q_after else _project(attn.q_proj, x, attn.head_dim, row_cos, row_sin)

        # Token-major, as the segments are stored (client/blend/segments.py).
        out = executor.blend(
            layer_id, _to(retrieved.k, device), _to(retrieved.v, device), valid_mask,
            retrieved.original_positions, q, k, v, all_positions[rows], query_start_loc,
            token_dim=0,
        )
        selected_rows = out.local_indices.to("cpu", torch.int64)
        if out.q is None:  # [n', heads, head_size]: Q of the selected rows
            local = torch.searchsorted(rows, selected_rows).to(device)
            out.q = _project(attn.q_proj, x[local], attn.head_dim, row_cos[local],
                             row_sin[local])
        rows = selected_rows
        # Head-major views: [heads, n', head_size] / [kv_heads, T, head_size].
        out_q, out_k, out_v = (t.transpose(0, 1) for t in (out.q, out.k, out.v))
        layers.append((out_k[None], out_v[None]))  # [1, kv_heads, T, head_size] each
        # The last layer's outputs are read for the last token only (its K/V, in the
        # cache, were computed for every selected row): attention and MLP for that row.
        tail = slice(-1, None) if layer_id == last_layer else slice(None)
        rows_out = rows[tail]
        rows_dev = rows_out.to(device)
        # Query i sees key j iff j <= its position (true positions, not the top-left
        # alignment of is_causal), without a dense mask on CPU.
        positions = out.positions[tail]
        if plan is None or not plan.matches(positions):  # a new selection: cut its rows once
            plan = PositionsPlan(positions)
        attn_out = attend_at_positions(
            out_q[:, tail][None], out_k[None], out_v[None], positions, scale=attn.scaling,
            plan=plan,
        )  # [1, heads, n', head_size]
        attn_out = attn_out[0].transpose(0, 1).reshape(rows_out.numel(), -1)
        selected = hidden[rows_dev] + attn.o_proj(attn_out)  # [n', hidden_size]
        selected = selected + layer.mlp(layer.post_attention_layernorm(selected))
        hidden[rows_dev] = selected

    assert int(rows[-1]) == num_tokens - 1, (
        "the prompt's last token was not recomputed through the last layer: the "
        "executor dropped a row marked not-valid (bug)"
    )
    return BlendedLayers(
        last_hidden=hidden[-1],
        cache=DynamicCache(ddp_cache_data=layers),
        num_reused_tokens=num_reused,
        recomputed_indices=rows,
    )
