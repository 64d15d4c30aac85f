"""CacheBlend's decoder adapter for vLLM's Llama-family models (CacheBlend's prefill).

Why this file exists: CacheBlend (Yao et al., EuroSys 2025) and EPIC's LegoLink (Hu et
al., ICML 2025) compute only some rows of a prompt through some layers; the other rows'
K/V come from the cache, moved to their new positions. vLLM's forward computes every row
of every layer and its attention backends assume each request's queries are a contiguous
suffix (vllm/v1/attention/backends/flash_attn.py ~l.513 in 0.32.0), so the one layer
loop of lmcached.client.blend (client/blend/layer_loop.py, shared with the Hugging Face
path, client/hf_blend.py) drives each decoder layer of vLLM's own model through
`VllmDecoder`, the adapter over its submodules (`embed_input_ids`, `input_layernorm`,
`qkv_proj`, `rotary_emb`, `o_proj`, `post_attention_layernorm`, `mlp`). The selected
rows attend over the layer's long K/V through `attend_at_positions` (client/attention.py,
shared with the Hugging Face path), or on CUDA through FlashAttention varlen over the
paged cache (client/vllm/blend_flash.py). With every row selected it computes what the
model's own forward computes. vllm-free: the model is used through its attributes.
"""

import dataclasses
from typing import Callable

import torch

from lmcached.client.attention import attend_at_positions
from lmcached.client.blend.interfaces import BlendExecutor, BlendRetrieverTask
from lmcached.client.blend.layer_loop import DecoderAdapter, run_layers

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


def check_blend_model(model) -> None:
    """Refuse a vLLM model whose decoder layer `run_blended_layers` does not reproduce.

    Raises:
        ValueError: no `model.layers` of Llama-style layers with a fused `qkv_proj`,
            Q/K norms, Llama 4 attention scaling, or adaptive norms (the message says which).
    """
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not hasattr(decoder, "embed_input_ids"):
        raise ValueError(f"{type(model).__name__} has no model.layers / embed_input_ids: "
                         "blending supports vLLM's Llama, Mistral and Qwen2 classes")
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        missing = [name for name in ("qkv_proj", "rotary_emb", "o_proj", "attn")
                   if not hasattr(attn, name)]
        missing += [name for name in ("input_layernorm", "post_attention_layernorm", "mlp")
                    if not hasattr(layer, name)]
        if missing:
            raise ValueError(f"{type(layer).__name__} lacks {missing}: blending reproduces "
                             "Llama-style decoder layers only")
        if (getattr(attn, "qk_norm", False) or getattr(attn, "do_llama_4_scaling", False)
                or getattr(layer, "ada_rms_norm_t_cond", None) is not None):
            raise ValueError(f"{type(layer).__name__} uses Q/K norms, Llama 4 attention "
                             "scaling or adaptive norms: not reproduced by blending")


class VllmDecoder(DecoderAdapter):
    """The `DecoderAdapter` of a vLLM Llama-family model (one TP rank's heads).

    Q, K and V come from the fused `qkv_proj` (`(out, bias)`), RoPE from the layer's
    `rotary_emb(positions, q, k)`; Q is returned with K/V at every layer (the fused
    projection computes it anyway). K/V go to `sink`; the selected rows attend through
    `attention`.

    Args:
        model: a vLLM model accepted by `check_blend_model`.
        sink: called once per layer, in order, with the layer's long K/V.
        attention: the selected rows' attention (default `positions_attention`).
    """

    def __init__(self, model, sink: LayerSink, attention: "AttentionFn | None" = None):
        self._layers = model.model.layers
        self._embed = model.model.embed_input_ids
        self._sink = sink
        self._attention = attention or positions_attention
        self.num_layers = len(self._layers)
        self.device = next(model.parameters()).device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embed(input_ids.to(self.device))  # [T, hidden_size]

    def head_shape(self, layer_id: int) -> tuple[int, int, int]:
        attn = self._layers[layer_id].self_attn
        return attn.num_heads, attn.num_kv_heads, attn.head_dim

    def input_norm(self, layer_id: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._layers[layer_id].input_layernorm(hidden)

    def project(self, layer_id: int, x: torch.Tensor, positions: torch.Tensor,
                with_q: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self._layers[layer_id].self_attn
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q.contiguous(), k.contiguous())
        return (q.reshape(-1, attn.num_heads, attn.head_dim),  # [n, heads, head_size]
                k.reshape(-1, attn.num_kv_heads, attn.head_dim),  # [n, kv_heads, head_size]
                v.reshape(-1, attn.num_kv_heads, attn.head_dim))

    def project_q(self, layer_id: int, x: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        return self.project(layer_id, x, positions, with_q=True)[0]

    def write_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._sink(layer_id, k, v)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        return self._attention(layer_id, self._layers[layer_id].self_attn, q, k, v,
                               positions.to(self.device))

    def finish(self, layer_id: int, hidden: torch.Tensor,
               attn_out: torch.Tensor) -> torch.Tensor:
        layer = self._layers[layer_id]
        o, _ = layer.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        selected = hidden + o  # [S, hidden_size]
        return selected + layer.mlp(layer.post_attention_layernorm(selected))


def run_blended_layers(model, input_ids: torch.Tensor, task: BlendRetrieverTask,
                       executor: BlendExecutor, sink: LayerSink,
                       attention: "AttentionFn | None" = None) -> BlendRun:
    """Prefill one prompt layer by layer, computing only the rows the executor selects
    (`lmcached.client.blend.layer_loop.run_layers` over `VllmDecoder`): `sink` gets each
    layer's long K/V; the last layer computes K/V only (vLLM computes the rest of the
    prompt).

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
    run = run_layers(VllmDecoder(model, sink, attention), input_ids, task, executor,
                     last_token_output=False)
    return BlendRun(num_reused_tokens=run.num_reused_tokens,
                    recomputed_indices=run.recomputed_indices)


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
