"""KV events in vLLM's terms: the relay's block events as vLLM's `BlockStored` / `BlockRemoved`.

Why this file exists: the scheduler-side connector's `take_events()` hook is how a
connector adds events to vLLM's own KV event stream (`--kv-events-config`, ZMQ, msgpack
`KVEventBatch`). The engine-neutral `EventRelay` (client/serving/events.py) follows the
daemon's feed; what is vLLM's is here: its block hash (`hash_block_tokens` with the hash
function of `--prefix-caching-hash-algo`, the salt folded in the first block's extra keys
as `generate_block_hash_extra_keys` does, `maybe_convert_block_hash` for the published
form), its event classes and its medium names: "CPU" for the daemon's arena, "STORAGE"
for its disk tier (vllm/distributed/kv_events.py's MEDIUM_CPU / MEDIUM_STORAGE), locality
"LOCAL" (any instance on the node loads them). Never `AllBlocksCleared` (docs/kv-events.md).
"""

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from lmcached.client.serving.events import BlockEvent, BlockHasher, EventRelay

# The daemon's media as vLLM names them.
MEDIA = {"cpu": MEDIUM_CPU, "disk": MEDIUM_STORAGE}
LOCALITY = "LOCAL"


def vllm_block_hasher(hash_algo: str) -> BlockHasher:
    """vLLM's prefix-cache block hash for `--prefix-caching-hash-algo` `hash_algo`
    (`kv_cache_utils.hash_block_tokens`, NONE_HASH as the first block's parent: the
    engine process has initialised it)."""
    hash_fn = get_hash_fn_by_name(hash_algo)

    def block_hash(parent: bytes | None, token_ids: list[int], extra_keys) -> bytes:
        return kv_cache_utils.hash_block_tokens(hash_fn, parent, token_ids, extra_keys)
    return block_hash


def salt_key(salt: str) -> tuple:
    """The extra keys of a salted request's first block, as vLLM hashes them."""
    return (("cache_salt", salt),)


def event_salt_key(salt: str) -> tuple:
    """The same, as vLLM's events publish them (`to_event_extra_keys`: untagged)."""
    return (salt,)


def to_vllm_events(events: list[BlockEvent]) -> list[KVCacheEvent]:
    """vLLM's events for the relay's block events, in order."""
    convert = kv_cache_utils.maybe_convert_block_hash
    stored_fields = BlockStored.__struct_fields__
    out: list[KVCacheEvent] = []
    for event in events:
        medium = MEDIA.get(event.medium, event.medium.upper())
        hashes = [convert(h) for h in event.block_hashes]
        if event.kind == "stored":
            extra = {"extra_keys": event.extra_keys} if event.extra_keys else {}
            if "locality" in stored_fields:
                extra["locality"] = LOCALITY
            parent = event.parent_block_hash
            out.append(BlockStored(
                block_hashes=hashes,
                parent_block_hash=convert(parent) if parent is not None else None,
                token_ids=event.token_ids, block_size=event.block_size, lora_id=None,
                medium=medium, lora_name=None, **extra))
        else:
            extra = {"locality": LOCALITY} if "locality" in BlockRemoved.__struct_fields__ else {}
            out.append(BlockRemoved(block_hashes=hashes, medium=medium, **extra))
    return out


def take_vllm_events(relay: EventRelay | None) -> list[KVCacheEvent]:
    """The connector's `take_events()`: vLLM's KV events for the chunks the daemon holds
    for this instance's namespace, whichever process stored them (docs/kv-events.md):
    `BlockStored` / `BlockRemoved` with medium "CPU" (arena) or "STORAGE" (disk tier),
    this instance's block size and block hashes. Empty without a relay (no
    `--kv-events-config`).

    Raises:
        Whatever the relay's `poll()` raises (the connector guards its hook).
    """
    if relay is None:
        return []
    return to_vllm_events(relay.poll())


def make_relay(vllm_config, settings) -> EventRelay | None:
    """The connector's relay when vLLM publishes KV events (`--kv-events-config` with
    enable_kv_cache_events) and the connector's extra config does not say
    `"kv_events": false`; else None.

    Args:
        vllm_config: the engine's VllmConfig.
        settings: the connector's `ConnectorSettings` (rank 0's layout is followed).
    """
    events_config = getattr(vllm_config, "kv_events_config", None)
    if events_config is None or not events_config.enable_kv_cache_events:
        return None
    transfer = vllm_config.kv_transfer_config
    if str(transfer.get_from_extra_config("kv_events", True)).lower() in ("false", "0", "off"):
        return None
    return EventRelay(
        settings.layouts[0].to_wire(), vllm_config.cache_config.block_size,
        vllm_block_hasher(vllm_config.cache_config.prefix_caching_hash_algo),
        salt_key=salt_key, event_salt_key=event_salt_key, socket=settings.socket,
        daemon_name=settings.daemon_name,
        max_events=int(transfer.get_from_extra_config("kv_events_max_per_step", 1024)),
        min_interval_s=float(transfer.get_from_extra_config("kv_events_interval_s", 0.01)),
        timeout_s=settings.timeout_s)
