"""CacheBlend's decoder adapter for transformers' Llama-family models (CacheBlend's prefill).

Why this file exists: CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model
Serving for RAG with Cached Knowledge Fusion", EuroSys 2025) and EPIC's LegoLink (Hu et
al., "EPIC: Efficient Position-Independent Caching for Serving Large Language Models",
ICML 2025) compute only some rows of a prompt through some layers; those rows attend over
the K/V of every token, where the other rows' K/V come from the cache. A transformers
forward computes every row of every layer, so the one layer loop of lmcached.client.blend
(client/blend/layer_loop.py, shared with vLLM's path, client/vllm/blend_layers.py) drives
each decoder layer through `HFDecoder`, the adapter over its submodules
(input_layernorm, q/k/v projections, rotary embedding, o_proj, post_attention_layernorm,
mlp), and a `BlendExecutor` (client/blend/executor.py, after LMCache's `lmcache.blend`)
decides at each layer which rows go on. With every row selected it computes what the
model's own forward computes.

Used by hf_cacheblend.py, which holds the public API (`store_segments`, `blend_prefill`,
re-exported by hf.py); the hf*.py modules are the only modules of lmcached.client
importing transformers.
"""

import dataclasses

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import rotate_half

from lmcached.client.attention import PositionsPlan, attend_at_positions
from lmcached.client.blend.interfaces import BlendExecutor, BlendRetrieverTask
from lmcached.client.blend.layer_loop import DecoderAdapter, run_layers

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


class HFDecoder(DecoderAdapter):
    """The `DecoderAdapter` of a transformers Llama-family model.

    RoPE is the cos/sin of the model's own `rotary_emb` over the prompt's positions,
    made once by `embed`; Q is projected only when asked (`project(with_q=False)` skips
    it: CacheBlend's check layer computes Q of the selected rows only). Each layer's
    long K/V are kept (`layers`, head-major views for a DynamicCache). The selected rows
    attend through `attend_at_positions` (client/attention.py: unmasked key blocks and
    small masked squares merged by log-sum-exp on CPU, no dense mask), with one
    `PositionsPlan` per selection, reused while the rows stay the same.

    Args:
        model: a model accepted by `check_blend_supported`, in eval mode.

    Attributes:
        layers: per layer, (K, V) `[1, num_kv_heads, num_tokens, head_size]` each.
    """

    def __init__(self, model: PreTrainedModel):
        self._decoder = model.model
        self.num_layers = len(self._decoder.layers)
        self.device = model.device
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._cos = self._sin = None  # [T, head_size] each, set by embed
        self._plan = None  # PositionsPlan of the rows that attend

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        decoder = self._decoder
        hidden = decoder.embed_tokens(input_ids.to(self.device)[None])  # [1, T, hidden_size]
        positions = torch.arange(input_ids.numel(), device=self.device)
        cos, sin = decoder.rotary_emb(hidden, positions[None])  # [1, T, head_size] each
        self._cos, self._sin = cos[0], sin[0]
        return hidden[0]  # [T, hidden_size]

    def head_shape(self, layer_id: int) -> tuple[int, int, int]:
        config = self._decoder.config
        head_size = self._decoder.layers[layer_id].self_attn.head_dim
        return (config.num_attention_heads,
                getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                head_size)

    def input_norm(self, layer_id: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._decoder.layers[layer_id].input_layernorm(hidden)

    def project(self, layer_id: int, x: torch.Tensor, positions: torch.Tensor,
                with_q: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        attn = self._decoder.layers[layer_id].self_attn
        cos, sin = self._cos[positions], self._sin[positions]  # [n, head_size] each
        k = _project(attn.k_proj, x, attn.head_dim, cos, sin)  # [n, kv_heads, head_size]
        v = _project(attn.v_proj, x, attn.head_dim)  # [n, kv_heads, head_size]
        q = _project(attn.q_proj, x, attn.head_dim, cos, sin) if with_q else None
        return q, k, v

    def project_q(self, layer_id: int, x: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        attn = self._decoder.layers[layer_id].self_attn
        return _project(attn.q_proj, x, attn.head_dim, self._cos[positions],
                        self._sin[positions])

    def write_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # Head-major views: [1, kv_heads, T, head_size].
        self.layers.append((k.transpose(0, 1)[None], v.transpose(0, 1)[None]))

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        if self._plan is None or not self._plan.matches(positions):  # a new selection
            self._plan = PositionsPlan(positions)
        attn = self._decoder.layers[layer_id].self_attn
        out = attend_at_positions(
            q.transpose(0, 1)[None],  # [1, heads, S, head_size]
            k.transpose(0, 1)[None],  # [1, kv_heads, T, head_size]
            v.transpose(0, 1)[None], positions, scale=attn.scaling, plan=self._plan,
        )  # [1, heads, S, head_size]
        return out[0].transpose(0, 1)  # [S, heads, head_size]

    def finish(self, layer_id: int, hidden: torch.Tensor,
               attn_out: torch.Tensor) -> torch.Tensor:
        layer = self._decoder.layers[layer_id]
        selected = hidden + layer.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        return selected + layer.mlp(layer.post_attention_layernorm(selected))


def run_blended_layers(model: PreTrainedModel, input_ids: torch.Tensor,
                       task: BlendRetrieverTask, executor: BlendExecutor) -> BlendedLayers:
    """Prefill one prompt layer by layer, computing only the rows the executor selects
    (`lmcached.client.blend.layer_loop.run_layers` over `HFDecoder`), the last token's
    output included (its hidden state gives the logits: it is always recomputed, and
    the last layer's attention and MLP run for it alone).

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
    decoder = HFDecoder(model)
    run = run_layers(decoder, input_ids.cpu(), task, executor, last_token_output=True)
    return BlendedLayers(
        last_hidden=run.hidden[-1],
        cache=DynamicCache(ddp_cache_data=decoder.layers),
        num_reused_tokens=run.num_reused_tokens,
        recomputed_indices=run.recomputed_indices,
    )
