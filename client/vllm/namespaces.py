"""The namespaces (KV layouts) of a vLLM engine's KV cache, from its configuration alone.

Why this file exists: the connector's scheduler side and every worker compute the same
layouts (one per tensor parallel rank) without seeing the KV tensors, so that both sides
address the same namespaces; which vLLM configurations can be cached at all is decided
here (`UnsupportedConfig`).
"""

import vllm
from vllm.v1.kv_cache_interface import FullAttentionSpec

from lmcached.client.layout import KVLayout
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


class UnsupportedConfig(Exception):
    """The vLLM configuration is one lmcached cannot cache for (the connector idles)."""


def namespace_layouts(vllm_config, kv_cache_config, chunk_size: int,
                      model_name: str | None = None) -> list[KVLayout]:
    """The KV layout (namespace) of every TP rank, from configuration alone.

    The scheduler and the workers compute the same layouts without seeing the KV
    tensors, so that both sides address the same namespaces.

    Args:
        vllm_config: the engine's VllmConfig.
        kv_cache_config: the engine's KVCacheConfig (one full-attention group).
        chunk_size: tokens per chunk, a multiple of vLLM's block size.
        model_name: the model id in the namespace (default: model_config.model).

    Returns:
        One KVLayout per TP rank (index = rank). Geometry: the spec's heads, head size
        and dtype when a page is exactly K and V of every head; otherwise uint8 "heads"
        of page_bytes / (2 * block_size) bytes (the bytes are opaque either way).

    Raises:
        ValueError: chunk_size is not a positive multiple of the block size.
        UnsupportedConfig: pipeline/context parallelism or an unsupported KV cache.
    """
    parallel = vllm_config.parallel_config
    for field in ("pipeline_parallel_size", "decode_context_parallel_size",
                  "prefill_context_parallel_size"):
        if getattr(parallel, field, 1) != 1:
            raise UnsupportedConfig(f"{field}={getattr(parallel, field)} (only TP is supported)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedConfig(f"{len(groups)} KV cache groups (hybrid models)")
    spec = groups[0].kv_cache_spec
    if (not isinstance(spec, FullAttentionSpec) or spec.sliding_window is not None
            or spec.attention_chunk_size is not None):
        raise UnsupportedConfig(f"KV cache spec {spec!r} is not plain full attention")
    block_size = spec.block_size
    if chunk_size < 1 or chunk_size % block_size:
        raise ValueError(
            f"chunk_size {chunk_size} must be a positive multiple of vLLM's block size "
            f"{block_size}: set kv_connector_extra_config.chunk_size"
        )
    page_bytes = spec.page_size_bytes
    cache_config = vllm_config.cache_config
    kv_cache_layout = kv_cache_config.kv_cache_layout or cache_config.kv_cache_layout
    backend = vllm_config.attention_config.backend
    description = "|".join([
        model_name or vllm_config.model_config.model,
        f"vllm-{vllm.__version__}",
        _device_type(),
        f"layout={kv_cache_layout}",
        f"bs={block_size}",
        f"page={page_bytes}",
        type(spec).__name__,
        f"kv={cache_config.cache_dtype}",
        f"attn={backend.name if backend is not None else 'auto'}",
        f"isa={_cpu_attention_isa(spec, cache_config.cache_dtype)}",
    ])
    num_layers = len(groups[0].layer_names)
    world_size = parallel.tensor_parallel_size
    for geometry in _geometries(spec, page_bytes):
        try:
            return [KVLayout(description, num_layers, chunk_size=chunk_size, fmt="vllm",
                             world_size=world_size, worker_id=rank, **geometry)
                    for rank in range(world_size)]
        except ValueError as exc:  # e.g. a KV dtype KVLayout has no name for
            logger.debug("geometry %s refused (%s): trying bytes", geometry, exc)
    raise UnsupportedConfig(f"no KVLayout describes {page_bytes}-byte pages of {spec!r}")


def _geometries(spec, page_bytes: int) -> list[dict]:
    """KVLayout geometries for pages of `page_bytes`, the most descriptive first."""
    block_size = spec.block_size
    geometries = []
    if (spec.head_size_v == spec.head_size and page_bytes
            == 2 * block_size * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize):
        geometries.append(dict(num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                               dtype=spec.dtype))
    if page_bytes % (2 * block_size) == 0:
        geometries.append(dict(num_kv_heads=1, head_size=page_bytes // (2 * block_size),
                               dtype="uint8"))
    return geometries


def _device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def _cpu_attention_isa(spec, cache_dtype: str) -> str:
    """The CPU attention kernel's ISA ("vec", "amx", ...): it decides how K is packed."""
    if _device_type() != "cpu":
        return "-"
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, cache_dtype)
    except Exception as exc:  # private helper (0.32, 0.33); a failure only loses sharing
        return f"unknown({type(exc).__name__})"
