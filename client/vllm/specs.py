"""The serving core's settings and step specs, under the name the CacheBlend side imports.

Why this file exists: `ConnectorSettings`, `LoadSpec` and `SaveSpec` live in the
engine-neutral serving core (`lmcached.client.serving.specs`); the CacheBlend scheduler and
worker (client/vllm/blend_*.py) import them from here. Re-exports only.
"""

from lmcached.client.serving.specs import ConnectorSettings, LoadSpec, SaveSpec

__all__ = ["ConnectorSettings", "LoadSpec", "SaveSpec"]
