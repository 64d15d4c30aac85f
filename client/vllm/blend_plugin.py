"""The `vllm.general_plugins` entry point: registers lmcached's blend-aware model classes.

Why this file exists: CacheBlend inside vLLM needs the model object in the connector
(vLLM hands a KV connector none). LMCache patched vLLM for that, and the patch stopped
applying at vLLM 0.12 (LMCache issues 4476, 4131). vLLM's out-of-tree model registration
(`ModelRegistry.register_model`, vllm/model_executor/models/registry.py ~l.1132 in
0.32.0), run from a `vllm.general_plugins` entry point (vllm/plugins/__init__.py) in
every vLLM process, does it without a patch: `pip install 'lmcached[vllm]'` installs the
entry point, and a deployment selects a class with::

    --hf-overrides '{"architectures": ["LMCachedLlamaForCausalLM"]}'

The classes (client/vllm/blend_models.py) are registered by name ("module:class"), so
loading the plugin imports no model code; vLLM loads plugins several times per process,
and registering again is harmless.
"""

# architecture name -> vLLM's class it extends (weights, forward and compilation kept).
BLEND_ARCHITECTURES = {
    "LMCachedLlamaForCausalLM": "LlamaForCausalLM",
    "LMCachedMistralForCausalLM": "MistralForCausalLM",
    "LMCachedQwen2ForCausalLM": "Qwen2ForCausalLM",
}


def register() -> None:
    """Register every class of `BLEND_ARCHITECTURES` with vLLM's ModelRegistry (lazily,
    by "module:class"); the `vllm.general_plugins` entry point `lmcached_blend`."""
    from vllm import ModelRegistry

    for name in BLEND_ARCHITECTURES:
        ModelRegistry.register_model(name, f"lmcached.client.vllm.blend_models:{name}")
