"""A transformers model as lmcached sees it: supported or not, its namespaces, its cache.

Why this file exists: both ways of generating with the cache (prefix caching, hf.py;
CacheBlend, hf_cacheblend.py) first ask the same questions of a model: is its cache a
DynamicCache of full-attention per-layer K/V (`check_model_supported`), which namespace
holds its chunks (`layout_for_model`, huggingface format) and its CacheBlend documents
(`segment_layout_for_model`, token-major), does a given engine belong to it
(`_check_engine`, `_segment_engine`), and under which name does this transformers take
and return the cache (`CACHE_ARG`, `model_cache`). hf.py re-exports the public names.
"""

import transformers
from transformers import DynamicCache, PreTrainedModel

from lmcached.client.blend.segments import segment_layout_of, segment_model_name
from lmcached.client.engine import CacheEngine
from lmcached.client.layout import KVLayout

# The name of the cache a model's forward (and `generate`) takes and its output holds:
# transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and is
# removed in 5.40); the 5.x releases before it know only `past_key_values`.
CACHE_ARG = ("cache" if tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 24)
             else "past_key_values")


def model_cache(out) -> DynamicCache:
    """The cache of a model's forward output, by its name in this transformers
    (`CACHE_ARG`)."""
    return getattr(out, CACHE_ARG)


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
