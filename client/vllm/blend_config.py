"""Which engines can blend, and where CacheBlend's documents are stored.

Why this file exists: the connector (client/vllm/connector.py) decides once, from vLLM's
configuration, whether its engine can blend at all (a blend-aware
`LMCached*ForCausalLM` architecture, a RoPE a delta rotation moves exactly) and which
namespace holds the documents; both roles compute the same answer without seeing a
tensor.
"""

from lmcached.client.blend.segments import segment_layout
from lmcached.client.layout import KVLayout
from lmcached.client.vllm.blend_plugin import BLEND_ARCHITECTURES
from lmcached.client.vllm.blend_worker import rotary_of
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


def segment_layouts(vllm_config, chunk_size: int, model_name: str | None = None) -> list[KVLayout]:
    """The namespace of CacheBlend's document segments for every TP rank.

    The one definition of the documents' namespace, `segment_layout`
    (client/blend/segments.py), shared with the Hugging Face path (`blend_prefill`):
    segments are stored token-major per layer (`[num_layers, 2, num_tokens,
    num_kv_heads, head_size]`, the model dtype), computed alone from position 0, so they
    depend neither on vLLM's version, paged format, block size or attention backend nor
    on the engine that computed them; each rank stores its own head slice.

    Args:
        vllm_config: the engine's VllmConfig.
        chunk_size: tokens per chunk.
        model_name: the model id in the namespace (default: model_config.model, the
            model as given to vLLM); a Hugging Face process shares the documents when it
            passes the same name as `model_name=` (at TP 1).

    Returns:
        One KVLayout per TP rank (index = rank).
    """
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return [segment_layout(model_name or model_config.model,
                           model_config.get_num_layers(parallel),
                           num_kv_heads=model_config.get_num_kv_heads(parallel),
                           head_size=model_config.get_head_size(), dtype=model_config.dtype,
                           chunk_size=chunk_size, world_size=parallel.tensor_parallel_size,
                           worker_id=rank)
            for rank in range(parallel.tensor_parallel_size)]


def blend_refusal(vllm_config) -> str | None:
    """Why no request of this engine can be blended (a `REFUSALS` reason), or None.

    Args:
        vllm_config: the engine's VllmConfig.
    """
    architectures = getattr(vllm_config.model_config.hf_config, "architectures", None) or []
    if not any(name in BLEND_ARCHITECTURES for name in architectures):
        return "no_model"
    try:
        rotary_of(vllm_config.model_config.hf_config)
    except (ValueError, TypeError, AttributeError) as exc:
        logger.warning("lmcached blend: this model's RoPE cannot be re-rotated (%s)", exc)
        return "rope"
    return None
