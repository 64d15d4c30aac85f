"""Hugging Face transformers integration: prefill only what the node has not cached.

Why this file exists: it is the shortest path from lmcached to a real model. Before the
prefill, the cached prefix of the prompt is retrieved (from any process on the node)
into a transformers `DynamicCache`; the model computes only the rest; the prompt's KV is
stored for everyone else; then decoding proceeds as usual. Greedy outputs equal those of
a run without the cache.

    engine = CacheEngine.connect(layout_for_model(model))
    result = generate_with_cache(model, engine, input_ids, max_new_tokens=32)
    result.output_ids, result.num_cached_tokens, result.ttft_s

CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with
Cached Knowledge Fusion", EuroSys 2025; LMCache's `lmcache.blend`) goes further for RAG
prompts: each document is stored on its own (`store_segments`), and `blend_prefill`
reuses every document's KV wherever it appears, recomputing only some tokens:

    store_segments(model, engine, doc_ids, spt_token_id)   # once per document
    prefill = blend_prefill(model, engine, prompt_ids, spt_token_id, recompute_ratio=0.15)
    output_ids = generate_after_blend(model, prefill, max_new_tokens=32)

The documents live in the segment namespace (`segment_layout_for_model`: token-major,
client/blend/segments.py), shared with vLLM's blend worker: a document either stored is
reused by the other, for the same model name, chunk size and cache salt.

This module holds prefix caching (`generate_with_cache`) and re-exports the rest of the
Hugging Face API: a model's support, namespaces and cache name (hf_models.py) and
CacheBlend's API (hf_cacheblend.py). With those, hf_blend.py (the layer-by-layer decoder
run) and hf_attention.py, the only modules of lmcached.client that import transformers
(examples/demo.py does too).
"""

import dataclasses
import time

import torch
from transformers import DynamicCache, PreTrainedModel

from lmcached.client.engine import CacheEngine
from lmcached.client.hf_attention import prefix_attention
from lmcached.client.hf_cacheblend import (BLEND_STRATEGIES, BlendPrefill, blend_prefill,
                                           generate_after_blend, store_segments)
from lmcached.client.hf_models import (CACHE_ARG, _check_engine, check_model_supported,
                                       layout_for_model, model_cache, segment_layout_for_model)

__all__ = [
    "BLEND_STRATEGIES", "CACHE_ARG", "DEFAULT_MIN_CACHED_TOKENS", "BlendPrefill",
    "GenerationResult", "blend_prefill", "check_model_supported", "generate_after_blend",
    "generate_with_cache", "layout_for_model", "model_cache", "segment_layout_for_model",
    "store_segments",
]

# generate_with_cache leaves a cached prefix shorter than this unused: loading it (one
# retrieve round trip, a cache built from it) must cost less than computing its tokens.
# With "lmcached_sdpa" a short prefix costs no attention time (the queries are padded to
# the causal square), so a hit pays once its tokens' projections outweigh one retrieve
# (a fraction of a millisecond): a few tokens on any real model. 32 is a conservative
# floor; `python -m benchmarks.hf.bench_hf --crossover` measures it (not yet on a quiet machine).
DEFAULT_MIN_CACHED_TOKENS = 32


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


def _worth_loading(engine: CacheEngine, ids: torch.Tensor, min_cached_tokens: int) -> bool:
    """Whether `ids` (int64 `[num_tokens]`) may have a usable hit of at least
    `min_cached_tokens`, asking the daemon only when the answer is not known without it.

    A hit is a run of whole chunks, or the whole prompt (its last chunk partial); at
    most num_tokens - 1 tokens are used. So with min_cached_tokens <= chunk_size any hit
    is long enough, and no LOOKUP round trip is spent before the retrieve.
    """
    if min_cached_tokens <= 0:
        return True
    if ids.numel() - 1 < min_cached_tokens:
        return False
    if min_cached_tokens <= engine.layout.chunk_size:
        return True
    return min(engine.lookup(ids.cpu()), ids.numel() - 1) >= min_cached_tokens


@torch.inference_mode()
def generate_with_cache(model: PreTrainedModel, engine: CacheEngine | None,
                        input_ids: torch.Tensor, max_new_tokens: int = 16,
                        store: bool = True,
                        min_cached_tokens: int = DEFAULT_MIN_CACHED_TOKENS) -> GenerationResult:
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
        min_cached_tokens: a cached prefix shorter than this is not loaded (the whole
            prompt is computed: `num_cached_tokens` 0), since loading it would cost more
            than it saves; 0 uses any hit. Default `DEFAULT_MIN_CACHED_TOKENS`. Above
            the chunk size it costs one LOOKUP round trip before the retrieve.

    Returns:
        GenerationResult.

    Raises:
        ValueError: batch other than 1, empty prompt, max_new_tokens < 1,
            min_cached_tokens < 0, or an engine whose layout does not match the model.
    """
    ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be one non-empty prompt, got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if min_cached_tokens < 0:
        raise ValueError(f"min_cached_tokens must be >= 0 (0 uses any hit), got {min_cached_tokens}")
    if engine is not None:
        _check_engine(model, engine)
    num_tokens = ids.shape[1]
    started = time.perf_counter()
    cache, num_cached = DynamicCache(), 0
    if engine is not None and _worth_loading(engine, ids[0], min_cached_tokens):
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
        if num_cached < min_cached_tokens:  # evicted since the LOOKUP: too short now
            num_cached = 0
        if num_cached > 0:
            cache = _cache_from_kv(kv, num_cached)
    with prefix_attention(model):  # the causal kernel over the cached prefix, no mask
        out = model(ids[:, num_cached:], **{CACHE_ARG: cache}, use_cache=True)
    logits = out.logits[0, -1].float()
    next_token = int(logits.argmax())
    ttft_s = time.perf_counter() - started
    cache = model_cache(out)
    if engine is not None and store:
        # DynamicCache.update concatenates into new tensors, so decoding does not touch
        # the tensors this background store reads.
        engine.store(ids[0], cache, blocking=False)
    generated = [next_token]
    for _ in range(max_new_tokens - 1):
        out = model(torch.tensor([[next_token]], device=ids.device), **{CACHE_ARG: cache},
                    use_cache=True)
        cache = model_cache(out)
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
