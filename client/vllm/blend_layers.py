"""Run a vLLM Llama-family decoder layer by layer over blended K/V (CacheBlend's prefill).

Why this file exists: CacheBlend (Yao et al., EuroSys 2025) and EPIC's LegoLink (Hu et
al., ICML 2025) compute only some rows of a prompt through some layers; the other rows'
K/V come from the cache, moved to their new positions. vLLM's forward computes every row
of every layer and its attention backends assume each request's queries are a contiguous
suffix (vllm/v1/attention/backends/flash_attn.py ~l.513 in 0.32.0), so this module drives
each decoder layer of vLLM's own model from its submodules (`embed_input_ids`,
`input_layernorm`, `qkv_proj`, `rotary_emb`, `o_proj`, `post_attention_layernorm`,
`mlp`) and lets a `BlendExecutor` (lmcached.client.blend: the one implementation of the
selection and the re-rotation, shared with the Hugging Face path, client/hf_blend.py)
decide at each layer which rows go on. The selected rows attend over the layer's long
K/V through `attend_at_positions` (client/attention.py, shared with the Hugging Face
path), or on CUDA through FlashAttention varlen over the paged cache
(client/vllm/blend_flash.py). With every row selected it computes what the model's own
forward computes. vllm-free: the model is used through its attributes.
"""

from lmcached.client.blend.layer_loop import (  # noqa: F401  (this module's names)
    AttentionFn,
    BlendRun,
    LayerSink,
    positions_attention,
    run_blended_layers,
)


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
