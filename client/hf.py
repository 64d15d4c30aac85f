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

With hf_blend.py (the layer-by-layer decoder run), the only modules of lmcached.client
that import transformers (examples/demo.py does too).
"""

import dataclasses
import time

import torch
import transformers
from transformers import DynamicCache, PreTrainedModel

from lmcached.client.blend.executor import CacheBlendImpl, LegoLinkImpl
from lmcached.client.blend.retriever import SPTBlendRetriever, split_on_spt
from lmcached.client.blend.rope import LlamaRotary
from lmcached.client.blend.segments import segment_layout_of, segment_model_name
from lmcached.client.engine import CacheEngine
from lmcached.client.hf_attention import prefix_attention
from lmcached.client.hf_blend import check_blend_supported, run_blended_layers
from lmcached.client.layout import KVLayout
from lmcached.client.views import PinsLost
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

BLEND_STRATEGIES = ("cacheblend", "legolink")

# The name of the cache a model's forward (and `generate`) takes and its output holds:
# transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and is
# removed in 5.40); the 5.x releases before it know only `past_key_values`.
CACHE_ARG = ("cache" if tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 24)
             else "past_key_values")


def model_cache(out) -> DynamicCache:
    """The cache of a model's forward output, by its name in this transformers
    (`CACHE_ARG`)."""
    return getattr(out, CACHE_ARG)


# generate_with_cache leaves a cached prefix shorter than this unused: loading it (one
# retrieve round trip, a cache built from it) must cost less than computing its tokens.
# With "lmcached_sdpa" a short prefix costs no attention time (the queries are padded to
# the causal square), so a hit pays once its tokens' projections outweigh one retrieve
# (a fraction of a millisecond): a few tokens on any real model. 32 is a conservative
# floor; `python -m benchmarks.hf.bench_hf --crossover` measures it (not yet on a quiet machine).
DEFAULT_MIN_CACHED_TOKENS = 32


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


def segment_layout_for_model(model: PreTrainedModel, chunk_size: int = 256,
                             model_name: str | None = None) -> KVLayout:
    """The namespace of a model's CacheBlend documents, token-major, shared with vLLM's
    blend worker (client/blend/segments.py) when `model_name` is the name vLLM uses
    (`kv_connector_extra_config.namespace`, default the model as given to vLLM), the
    chunk size is the connector's (256), vLLM runs at TP 1, and the salt is the same.

    Args:
        model: a decoder-only model with full-attention layers.
        chunk_size: tokens per chunk.
        model_name: as `layout_for_model` (default: the config's name_or_path, i.e. the
            name or directory given to `from_pretrained`).

    Raises:
        ValueError: the model is not supported (see `check_model_supported`).
    """
    return segment_layout_of(layout_for_model(model, chunk_size, model_name))


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


def _check_engine(model: PreTrainedModel, engine: CacheEngine) -> None:
    """Raise ValueError unless `engine.layout` is `layout_for_model(model)` (same name and
    chunk size)."""
    expected = layout_for_model(model, engine.layout.chunk_size, engine.layout.model_name)
    if engine.layout != expected:
        raise ValueError(f"engine layout {engine.layout} does not match the model: {expected}")


def _segment_engine(model: PreTrainedModel, engine: CacheEngine) -> CacheEngine:
    """The engine of the model's document segments: `engine` itself when its layout is
    `segment_layout_for_model(model)`, else the segment sibling of an engine of
    `layout_for_model(model)` (same name and chunk size). Raises ValueError otherwise."""
    name = segment_model_name(engine.layout)
    if name is None:
        _check_engine(model, engine)
        return engine.sibling(segment_layout_of(engine.layout))
    expected = segment_layout_for_model(model, engine.layout.chunk_size, name)
    if engine.layout != expected:
        raise ValueError(f"engine layout {engine.layout} does not match the model: {expected}")
    return engine


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


# ------------------------------------------------------------------------ CacheBlend
def _prompt_1d(input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids as int64 `[num_tokens]`, or ValueError (batch, empty, not integer)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point():
        raise TypeError("input_ids must be an integer torch.Tensor of token ids")
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be one non-empty 1-D prompt [num_tokens], got shape "
                         f"{tuple(input_ids.shape)}: pass input_ids[0] for a batch of one")
    return input_ids.to(torch.int64)


@torch.inference_mode()
def store_segments(model: PreTrainedModel, engine: CacheEngine, input_ids: torch.Tensor,
                   spt_token_id: int, cache_salt: str | None = None) -> int:
    """Compute and store the KV of each separated segment on its own, from position 0.

    CacheBlend's precompute step (Yao et al., EuroSys 2025; EPIC's "compile", Hu et al.,
    ICML 2025): the prompt is cut after every `spt_token_id` (`split_on_spt`:
    `[x,x,S,y,y,S,z]` -> `[x,x,S]`, `[y,y,S]`, `[z]`); each segment not fully cached is
    prefilled alone (a plain forward from position 0, nothing before it) and stored as its
    own chunk chain, where `blend_prefill` finds it wherever it appears later, and so
    does vLLM's blend worker: the chains go to the segment namespace
    (`segment_layout_for_model`, token-major, shared with vLLM).

    Args:
        model: a supported decoder-only model (see `check_model_supported`), eval mode.
        engine: a CacheEngine of `segment_layout_for_model(model)`, or of
            `layout_for_model(model)` (its `sibling` in the segment namespace is used).
        input_ids: int64 `[num_tokens]`, any device: one document, or several joined by
            `spt_token_id`.
        spt_token_id: the separator's token id, inserted by the caller (a reserved
            special token that never occurs in text).
        cache_salt: the tenant's cache salt (vLLM's `cache_salt`), or None: documents
            are found only under the salt they were stored under.

    Returns:
        Tokens computed now (0 when every segment was cached). A segment partly cached is
        computed whole; only its missing chunks are written.

    Raises:
        ValueError / TypeError: input_ids not 1-D, an engine of another layout, an
            unsupported model, an empty or non-str cache_salt.
    """
    ids = _prompt_1d(input_ids)
    engine = _segment_engine(model, engine)
    num_computed = 0
    for start, end in split_on_spt(ids.cpu(), spt_token_id):
        segment = ids[start:end]
        if engine.lookup(segment.cpu(), cache_salt=cache_salt) >= end - start:
            continue
        out = model(segment[None].to(model.device), use_cache=True, logits_to_keep=1)
        engine.store(segment.cpu(), model_cache(out), cache_salt=cache_salt)
        num_computed += end - start
    return num_computed


@dataclasses.dataclass
class BlendPrefill:
    """What `blend_prefill` computed for one prompt.

    Attributes:
        logits: float32 `[vocab_size]`, model device: next-token logits after the
            prompt's last token.
        past_key_values: a DynamicCache over the whole prompt (`[1, num_kv_heads,
            num_prompt_tokens, head_size]` per layer: the K/V each layer's attention
            used). Continue with `generate_after_blend`, or with `model.generate` given
            the prompt plus the first token (`logits.argmax()`): given only the prompt,
            generate would feed its last token a second time.
        num_prompt_tokens: prompt length.
        num_reused_tokens: prompt tokens whose cached KV was found and blended in (the
            last token, always recomputed, is not counted).
        num_recomputed_tokens: tokens computed through every layer: the selected reused
            tokens plus every token without cached KV.
        ttft_s: seconds from the call to the logits (retrieval, all layers, lm_head).
        strategy: "cacheblend" or "legolink".
    """

    logits: torch.Tensor
    past_key_values: DynamicCache
    num_prompt_tokens: int
    num_reused_tokens: int
    num_recomputed_tokens: int
    ttft_s: float
    strategy: str


@torch.inference_mode()
def blend_prefill(model: PreTrainedModel, engine: CacheEngine, input_ids: torch.Tensor,
                  spt_token_id: int, recompute_ratio: float = 0.15,
                  strategy: str = "cacheblend", legolink_k: int = 16,
                  cache_salt: str | None = None) -> BlendPrefill:
    """Prefill a prompt reusing the cached KV of each of its segments, wherever it sits.

    Segments (cut after each `spt_token_id`, stored by `store_segments`) are found in
    the cache as their own chunk chains (`SPTBlendRetriever`); their K is re-rotated
    from the positions it was computed at to its new ones (`LlamaRotary`, one rotation
    by the position delta). Then the decoder runs layer by layer (hf_blend.py) and only
    some tokens are recomputed, restoring the cross-attention between segments:

    - "cacheblend" (Yao et al., EuroSys 2025; LMCache's `CacheBlendImpl`): every token
      through layer 0; at layer 1 the `recompute_ratio` of the reused tokens whose fresh
      K deviates most from the reused K, plus every token without cached KV, go on;
      the others keep their cached KV on every later layer. Ratio 1.0 is a full prefill.
    - "legolink" (EPIC, Hu et al., ICML 2025): the first `legolink_k` tokens of every
      reused segment but the prompt's first (their spurious attention sinks), plus every
      token without cached KV, computed through every layer from layer 0.

    The prompt's last token is always recomputed: its output gives the logits.

    Args:
        model: a Llama-family model (`check_blend_supported`: llama, mistral, qwen2) in
            eval mode, on cpu or a CUDA device, whose RoPE can be re-rotated (default,
            linear or llama3 scaling; see `LlamaRotary.from_model`).
        engine: a CacheEngine of `segment_layout_for_model(model)`, or of
            `layout_for_model(model)` (its `sibling` in the segment namespace is used):
            the documents `store_segments` or vLLM's blend worker stored.
        input_ids: int64 `[num_tokens]`, any device: segments joined by `spt_token_id`
            (no separator: one segment, i.e. prefix caching of the whole prompt).
        spt_token_id: the separator's token id, as given to `store_segments`.
        recompute_ratio: "cacheblend": fraction of the reused tokens to recompute, in
            [0, 1] (the paper's 15% by default).
        strategy: "cacheblend" or "legolink".
        legolink_k: "legolink": tokens recomputed at the start of each reused segment.
        cache_salt: the salt the documents were stored under (vLLM's `cache_salt` of
            the requests that met them), or None.

    Returns:
        BlendPrefill.

    Raises:
        ValueError / TypeError: input_ids not 1-D, an unknown strategy, an engine of
            another layout, an unsupported model or RoPE (the message says which).
    """
    started = time.perf_counter()
    ids = _prompt_1d(input_ids)
    if strategy not in BLEND_STRATEGIES:
        raise ValueError(f"strategy must be one of {BLEND_STRATEGIES}, got {strategy!r}")
    engine = _segment_engine(model, engine)
    check_blend_supported(model)
    rotary = LlamaRotary.from_model(model)

    def new_executor():  # one per attempt: an executor keeps per-prompt state
        executor = (CacheBlendImpl(recompute_ratio) if strategy == "cacheblend"
                    else LegoLinkImpl(legolink_k))
        executor.set_positional_encoder(rotary.encoder)
        return executor

    retriever = SPTBlendRetriever(spt_token_id, engine, device=model.device)
    query_start_loc = torch.tensor([0, ids.numel()])
    try:
        with retriever.new_request(ids.cpu(), query_start_loc, cache_salt) as task:
            run = run_blended_layers(model, ids, task, new_executor())
    except PinsLost as exc:  # the pins went with their daemon session: pin again, once
        logger.warning("blend_prefill: %s", exc)
        try:
            with retriever.new_request(ids.cpu(), query_start_loc, cache_salt) as task:
                run = run_blended_layers(model, ids, task, new_executor())
        except PinsLost:  # the session keeps ending: a full prefill, reusing nothing
            with retriever.empty_request(ids.numel()) as task:
                run = run_blended_layers(model, ids, task, new_executor())
    logits = model.lm_head(model.model.norm(run.last_hidden)).float()
    ttft_s = time.perf_counter() - started
    return BlendPrefill(
        logits=logits,
        past_key_values=run.cache,
        num_prompt_tokens=ids.numel(),
        num_reused_tokens=run.num_reused_tokens,
        num_recomputed_tokens=run.recomputed_indices.numel(),
        ttft_s=ttft_s,
        strategy=strategy,
    )


@torch.inference_mode()
def generate_after_blend(model: PreTrainedModel, prefill: BlendPrefill,
                         max_new_tokens: int = 16) -> torch.Tensor:
    """Greedy decoding that continues from a `blend_prefill`.

    The first token is `prefill.logits.argmax()`; each next one is a forward of the
    previous token over `prefill.past_key_values` (as `generate_with_cache` decodes).
    The cache is extended in place; tokens a previous call appended are cropped
    first, so calling this again decodes the same tokens.

    Args:
        model: the model given to `blend_prefill`.
        prefill: its result.
        max_new_tokens: tokens to generate, >= 1.

    Returns:
        int64 `[max_new_tokens]`, cpu: the generated token ids.

    Raises:
        ValueError: max_new_tokens < 1.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache = prefill.past_key_values
    num_appended = cache.get_seq_length() - prefill.num_prompt_tokens
    if num_appended > 0:
        cache.crop(-num_appended)  # transformers 5: a negative count removes that many
    next_token = int(prefill.logits.argmax())
    generated = [next_token]
    for _ in range(max_new_tokens - 1):
        out = model(torch.tensor([[next_token]], device=model.device), **{CACHE_ARG: cache},
                    use_cache=True)
        next_token = int(out.logits[0, -1].argmax())
        generated.append(next_token)
    return torch.tensor(generated, dtype=torch.int64)
