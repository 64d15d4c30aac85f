"""The vLLM connector's extra config (`kv_connector_extra_config`): its keys and defaults.

Why this file exists: the connector reads its settings from the extra config of vLLM's
`--kv-transfer-config` (client/vllm/connector.py) in one place, here.

Extra config keys: `socket` (default: that of daemon `name`, found as the CLI finds it),
`name` (default: $LMCACHED_NAME, else "default"),
`chunk_size` (256 tokens, a multiple of vLLM's block size), `namespace` (the model id
in the key namespace; default: vLLM's model path or name), `timeout_s` (5), `verify`
("tokens": loads check each record's header and token ids; "checksum": saves also seal
a payload checksum into every record, and loads check it: README, "Trust model"),
`kv_load_failure_policy` ("fail": a load that fails finishes its request with an error;
default "recompute"), `blend_tokens_per_step` (16384: prompt tokens one step may blend; CacheBlend requests,
`kv_transfer_params={"lmcached_blend": ...}` with an `LMCached*ForCausalLM` model, are
served by client/vllm/blend_*.py: docs/cacheblend.md, "Inside vLLM").

Keys read where they act: `kv_load_failure_policy` (client/vllm/load_policy.py),
`blend_tokens_per_step` (client/vllm/connector.py), `kv_events`, `kv_events_max_per_step`
and `kv_events_interval_s` (client/vllm/kv_events.py, docs/kv-events.md).
"""

from lmcached.client.layout import KVLayout
from lmcached.client.serving.specs import ConnectorSettings

DEFAULT_CHUNK_SIZE = 256
DEFAULT_TIMEOUT_S = 5.0


def chunk_size(transfer) -> int:
    """The extra config's `chunk_size` in tokens (DEFAULT_CHUNK_SIZE when absent).

    Args:
        transfer: the engine's KVTransferConfig.
    """
    return int(transfer.get_from_extra_config("chunk_size", DEFAULT_CHUNK_SIZE))


def connector_settings(vllm_config, layouts: list[KVLayout], chunk_size: int) -> ConnectorSettings:
    """The connector's settings from the engine's configuration and its extra config.

    Args:
        vllm_config: the engine's VllmConfig (kv_transfer_config carries the extra config).
        layouts: one KVLayout (namespace) per TP rank (`namespace_layouts`).
        chunk_size: tokens per chunk (`chunk_size`).

    Raises:
        ValueError: `verify` is neither "tokens" nor "checksum".
    """
    transfer = vllm_config.kv_transfer_config
    return ConnectorSettings(
        layouts=layouts,
        chunk_size=chunk_size,
        block_size=vllm_config.cache_config.block_size,
        world_size=vllm_config.parallel_config.tensor_parallel_size,
        socket=transfer.get_from_extra_config("socket", None),
        daemon_name=transfer.get_from_extra_config("name", None),
        timeout_s=float(transfer.get_from_extra_config("timeout_s", DEFAULT_TIMEOUT_S)),
        verify=transfer.get_from_extra_config("verify", "tokens"),
    )
