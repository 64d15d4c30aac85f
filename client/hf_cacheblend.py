"""CacheBlend with a transformers model: store documents, prefill a prompt reusing them.

Why this file exists: CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model
Serving for RAG with Cached Knowledge Fusion", EuroSys 2025; LMCache's `lmcache.blend`)
reuses the KV of every document of a RAG prompt wherever it appears, recomputing only
some tokens. This module is its public API for transformers models, re-exported by hf.py
(`from lmcached.client.hf import blend_prefill`):

    store_segments(model, engine, doc_ids, spt_token_id)   # once per document
    prefill = blend_prefill(model, engine, prompt_ids, spt_token_id, recompute_ratio=0.15)
    output_ids = generate_after_blend(model, prefill, max_new_tokens=32)

The documents live in the segment namespace (`segment_layout_for_model`, hf_models.py),
shared with vLLM's blend worker. The layer-by-layer decoder run is hf_blend.py.
"""

import dataclasses
import time

import torch
from transformers import DynamicCache, PreTrainedModel

from lmcached.client.blend.executor import CacheBlendImpl, LegoLinkImpl
from lmcached.client.blend.retriever import SPTBlendRetriever, split_on_spt
from lmcached.client.blend.rope import LlamaRotary
from lmcached.client.engine import CacheEngine
from lmcached.client.hf_blend import check_blend_supported, run_blended_layers
from lmcached.client.hf_models import CACHE_ARG, _segment_engine, model_cache
from lmcached.client.views import PinsLost
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

BLEND_STRATEGIES = ("cacheblend", "legolink")


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
