"""Hugging Face transformers integration: prefill only what the node has not cached.

Why this file exists: it is the shortest path from lmcached to a real model. Before the
prefill, the cached prefix of the prompt is retrieved (from any process on the node)
into a transformers `DynamicCache`; the model computes only the rest; the prompt's KV is
stored for everyone else; then decoding proceeds as usual. Greedy outputs equal those of
a run without the cache.

    engine = CacheEngine.connect(layout_for_model(model))
    result = generate_with_cache(model, engine, input_ids, max_new_tokens=32)
    result.output_ids, result.num_cached_tokens, result.ttft_s

The only module of lmcached.client that imports transformers (examples/demo.py does too).
"""

import dataclasses
import time

import torch
from transformers import DynamicCache, PreTrainedModel

from lmcached.client.engine import CacheEngine
from lmcached.client.layout import KVLayout


def check_model_supported(model: PreTrainedModel) -> None:
    """Refuse models whose cache is not a DynamicCache of full-attention per-layer K/V.

    Raises:
        ValueError: encoder-decoder, sliding-window or non-attention layers (the message
            says which).
    """
    config = model.config
    name = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model: lmcached caches decoder-only prompts")
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(
            f"{name} has {other} layers: lmcached.client.hf supports models whose every layer "
            "keeps full-attention K/V in a DynamicCache (e.g. Llama)"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError(f"{name} uses a sliding window: its cache drops old K/V, unsupported")


def layout_for_model(model: PreTrainedModel, chunk_size: int = 256,
                     model_name: str | None = None) -> KVLayout:
    """The KVLayout (namespace) of a transformers model's DynamicCache (huggingface format).

    Args:
        model: a decoder-only model with full-attention layers.
        chunk_size: tokens per chunk.
        model_name: namespace name (default: the config's name_or_path, else its type).
            Processes share chunks only when this and the geometry are equal, so use the
            same name for the same weights.

    Raises:
        ValueError: the model is not supported (see `check_model_supported`).
    """
    check_model_supported(model)
    config = model.config
    num_heads = config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return KVLayout(
        model_name=model_name or config.name_or_path or config.model_type,
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_size=head_size,
        dtype=model.dtype,
        chunk_size=chunk_size,
        fmt="huggingface",
    )


@dataclasses.dataclass
class GenerationResult:
    """What `generate_with_cache` did for one prompt.

    Attributes:
        output_ids: generated token ids (greedy), `[max_new_tokens]` int64.
        num_prompt_tokens: prompt length.
        num_cached_tokens: prompt tokens whose KV came from lmcached (not computed).
        ttft_s: seconds from the call to the first generated token (retrieve + prefill).
        prefill_logits: logits of the last prompt token, `[vocab_size]` float32.
        num_stored_chunks: chunks this call wrote to the cache.
    """

    output_ids: torch.Tensor
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    prefill_logits: torch.Tensor
    num_stored_chunks: int


def _cache_from_kv(kv: tuple, num_tokens: int) -> DynamicCache:
    """A DynamicCache from retrieved per-layer (K, V) `[heads, n, head_size]`, cropped."""
    cache = DynamicCache()
    for layer, (keys, values) in enumerate(kv):
        cache.update(keys[:, :num_tokens].unsqueeze(0), values[:, :num_tokens].unsqueeze(0), layer)
    return cache


@torch.inference_mode()
def generate_with_cache(model: PreTrainedModel, engine: CacheEngine | None,
                        input_ids: torch.Tensor, max_new_tokens: int = 16,
                        store: bool = True) -> GenerationResult:
    """Greedy generation that reuses and extends the node's shared KV cache.

    Args:
        model: a supported decoder-only transformers model (see
            `check_model_supported`), in eval mode, on cpu or a CUDA device.
        engine: a CacheEngine whose layout is `layout_for_model(model)` (huggingface
            format); None runs without any cache (the reference path).
        input_ids: prompt token ids, `[num_tokens]` or `[1, num_tokens]` int64, on the
            model's device.
        max_new_tokens: tokens to generate, >= 1.
        store: store the prompt's KV after the first token (new chunks only).

    Returns:
        GenerationResult.

    Raises:
        ValueError: batch other than 1, empty prompt, max_new_tokens < 1, or an engine
            whose layout does not match the model.
    """
    ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be one non-empty prompt, got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if engine is not None:
        expected = layout_for_model(model, engine.layout.chunk_size, engine.layout.model_name)
        if engine.layout != expected:
            raise ValueError(f"engine layout {engine.layout} does not match the model: {expected}")
    num_tokens = ids.shape[1]
    started = time.perf_counter()
    cache, num_cached = DynamicCache(), 0
    if engine is not None:
        out = None
        if model.device.type != "cpu":  # retrieve straight into device buffers
            layout = engine.layout
            shape = (layout.num_kv_heads, num_tokens, layout.head_size)
            out = tuple(
                (torch.empty(shape, dtype=model.dtype, device=model.device),
                 torch.empty(shape, dtype=model.dtype, device=model.device))
                for _ in range(layout.num_layers)
            )
        kv, ret_mask = engine.retrieve(ids[0], out=out)
        num_cached = int(ret_mask.sum())
        # At least one prompt token is computed: its logits give the first new token.
        num_cached = min(num_cached, num_tokens - 1)
        if num_cached > 0:
            cache = _cache_from_kv(kv, num_cached)
    out = model(ids[:, num_cached:], past_key_values=cache, use_cache=True)
    logits = out.logits[0, -1].float()
    next_token = int(logits.argmax())
    ttft_s = time.perf_counter() - started
    cache = out.past_key_values
    if engine is not None and store:
        # DynamicCache.update concatenates into new tensors, so decoding does not touch
        # the tensors this background store reads.
        engine.store(ids[0], cache, blocking=False)
    generated = [next_token]
    for _ in range(max_new_tokens - 1):
        out = model(torch.tensor([[next_token]], device=ids.device), past_key_values=cache,
                    use_cache=True)
        cache = out.past_key_values
        next_token = int(out.logits[0, -1].argmax())
        generated.append(next_token)
    num_stored = engine.flush() if engine is not None and store else 0
    return GenerationResult(
        output_ids=torch.tensor(generated, dtype=torch.int64),
        num_prompt_tokens=num_tokens,
        num_cached_tokens=num_cached,
        ttft_s=ttft_s,
        prefill_logits=logits,
        num_stored_chunks=num_stored,
    )
