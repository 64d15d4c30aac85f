"""What the connector reads of vLLM's attention layers: their backends and their KV tensors.

Why this file exists: the worker side (client/vllm/worker.py) is vllm-free and takes the
paged KV cache as tensors and names; vLLM keeps them in its static forward context
(`compilation_config.static_forward_context`: layer name -> attention layer, with its
`attn_backend` and the `kv_cache` bound to it). The connector reads them here, when vLLM
registers its KV caches and when it wakes up from sleep mode.
"""

import torch


def attention_backends(vllm_config, layer_names: list[str]) -> dict[str, str]:
    """Layer name -> the name of its attention backend ("?" for a layer the forward
    context does not hold, or one without a backend), folded into the record fingerprint.

    Args:
        vllm_config: the engine's VllmConfig.
        layer_names: the KV cache group's layers.
    """
    forward_context = vllm_config.compilation_config.static_forward_context
    backends = {}
    for name in layer_names:
        backend = getattr(forward_context.get(name), "attn_backend", None)
        backends[name] = backend.get_name() if backend is not None else "?"
    return backends


def bound_kv_caches(vllm_config, layer_names: list[str]) -> dict[str, torch.Tensor]:
    """Layer name -> the KV tensor bound to that attention layer now.

    Args:
        vllm_config: the engine's VllmConfig.
        layer_names: the KV cache group's layers.

    Raises:
        KeyError, AttributeError: a layer the forward context does not hold, or one
            with no KV cache bound.
    """
    forward_context = vllm_config.compilation_config.static_forward_context
    kv_caches = {}
    for name in layer_names:
        kv_cache = forward_context[name].kv_cache
        # vLLM 0.32 and 0.33 bind one tensor per layer (older releases a list per
        # virtual engine).
        kv_caches[name] = kv_cache[0] if isinstance(kv_cache, list) else kv_cache
    return kv_caches
