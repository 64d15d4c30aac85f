"""vLLM model classes that hand their model object to the lmcached connector.

Why this file exists: the connector's CacheBlend (client/vllm/blend_worker.py) runs the
model's own modules layer by layer in `start_load_kv`, and vLLM gives a KV connector no
model. Each class here subclasses vLLM's own (weights, forward, torch.compile unchanged)
and only records the instance in a process-wide registry, which the connector's worker
reads (docs/cacheblend.md, "Inside vLLM").
Registered by the `vllm.general_plugins` entry point (client/vllm/blend_plugin.py).
"""

import weakref

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

# The models built in this process, oldest first (weak: a freed model is never returned).
_ORDER: list[weakref.ref] = []


def _record(model) -> None:
    _ORDER[:] = [ref for ref in _ORDER if ref() is not None] + [weakref.ref(model)]


def registered_model():
    """The newest blend-aware model built in this process that is still alive, or None
    (the deployment did not select an `LMCached*ForCausalLM` architecture)."""
    for ref in reversed(_ORDER):
        model = ref()
        if model is not None:
            return model
    return None


class LMCachedLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's LlamaForCausalLM, recorded for the lmcached connector's CacheBlend."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        _record(self)


class LMCachedMistralForCausalLM(MistralForCausalLM):
    """vLLM's MistralForCausalLM, recorded for the lmcached connector's CacheBlend."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        _record(self)


class LMCachedQwen2ForCausalLM(Qwen2ForCausalLM):
    """vLLM's Qwen2ForCausalLM, recorded for the lmcached connector's CacheBlend."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        _record(self)
