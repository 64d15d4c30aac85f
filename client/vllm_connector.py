"""The stable module path of the vLLM KV connector, as users' `--kv-transfer-config` names it.

Why this file exists: vLLM imports the connector by module path
(`"kv_connector_module_path": "lmcached.client.vllm_connector"`), and that path is in
deployed configs. The connector itself lives in `lmcached.client.vllm.connector`; this
module only re-exports it (importing it imports vllm).
"""

from lmcached.client.vllm.connector import LMCachedConnector
from lmcached.client.vllm.metadata import LMCachedConnectorMetadata, LMCachedWorkerMetadata
from lmcached.client.vllm.namespaces import UnsupportedConfig, namespace_layouts

__all__ = [
    "LMCachedConnector",
    "LMCachedConnectorMetadata",
    "LMCachedWorkerMetadata",
    "UnsupportedConfig",
    "namespace_layouts",
]
