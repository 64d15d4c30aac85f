"""The daemon's tiers of memory: the host arena and one tier per device, each with its
own block pool.

Why this file exists: a chunk may live in the host arena (tier 0) or in a device tier
(a CUDA allocation shared by file descriptor, or a memfd standing in for one in tests),
and every request must find, pin, place and release blocks across them with the same
rules. Those rules live here, so that `service.py` never branches on a tier's kind:

- Block references on the wire are `block_ref(tier, block id)` (lmcached/wire/protocol.py);
  each `KVCacheBlock.ref` holds its own.
- A session reads the tiers of its HELLO `devices` first, then the host arena; a
  session without devices reads the host arena only, so a client from before tiers
  never receives a reference it cannot map (docs/architecture.md, "Tiers").
- A key may be READY in several tiers at once (a host copy stored by a host-only
  client, a device copy by a GPU client); each tier's index is first-writer-wins.
- New chunks are placed in a device tier only into empty blocks: a device tier never
  evicts synchronously. Room is made in the background by demotion to the host arena
  (lmcached/daemon/demotion.py), after vLLM's CPU offloading and LMCache's tiered storage
  (a device hot tier that spills to host memory).
"""

from collections.abc import Callable

from lmcached.wire.logger import init_logger
from lmcached.wire.protocol import ANY_DEVICE, TierInfo, block_ref, tier_of
from lmcached.shm.arena import Arena
from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import BlockHash, KVCacheBlock

logger = init_logger(__name__)


class Tier:
    """One tier: its memory and, once the block size is known, its block pool.

    Args:
        tier_id: 0 for the host arena, 1.. for device tiers in `--gpu-device` order.
        kind: "host", "cuda" or "fake".
        device: the device's UUID ("" for the host arena).
        memory: the host `Arena`, or a device tier memory (shm/device_memory.py:
            `size_bytes`, `set_block_bytes`, `num_blocks`, `export_fd`, `copy_to_host`).

    Attributes:
        pool: the tier's BlockPool, or None until the first layout sets the block size.
        failed: a device error made the tier unusable (no new placements, no demotion);
            its READY values stay readable until evicted.
    """

    def __init__(self, tier_id: int, kind: str, device: str, memory) -> None:
        self.tier_id = tier_id
        self.kind = kind
        self.device = device
        self.memory = memory
        self.pool: BlockPool | None = None
        self.failed = False

    @property
    def size_bytes(self) -> int:
        """Bytes of the tier's memory."""
        memory = self.memory
        return memory.capacity_bytes if isinstance(memory, Arena) else memory.size_bytes

    def info(self) -> TierInfo:
        """What HELLO announces of this tier."""
        return TierInfo(self.tier_id, self.kind, self.device, self.size_bytes,
                        self.memory.block_bytes, self.memory.num_blocks)


class TierSet:
    """The host arena (tier 0) and the device tiers, and the rules that span them.

    Args:
        arena: the host arena (tier 0).
        device_memories: one device tier memory per `--gpu-device`, in order (tier ids
            1, 2, ...); empty without `--gpu-capacity`.

    Attributes:
        tiers: every tier, indexed by tier id.
        pools: each tier's BlockPool, indexed by tier id (filled by `make_pools`).
    """

    def __init__(self, arena: Arena, device_memories: list | tuple = ()) -> None:
        self.tiers = [Tier(0, "host", "", arena)]
        for i, memory in enumerate(device_memories, start=1):
            self.tiers.append(Tier(i, memory.kind, memory.device, memory))
        self.pools: list[BlockPool] = []
        self._by_device = {t.device: t for t in self.tiers[1:]}

    @property
    def host(self) -> Tier:
        """Tier 0, the host arena."""
        return self.tiers[0]

    @property
    def device_tiers(self) -> list[Tier]:
        """Every tier but the host arena."""
        return self.tiers[1:]

    def make_pools(self, on_evict: Callable | None = None) -> None:
        """Cut every tier into blocks of the host arena's block size (set by the first
        layout) and give each a BlockPool; `on_evict` is the host pool's hook (L2).

        A device tier smaller than one block gets no pool and stays unused (logged).
        """
        block_bytes = self.host.memory.block_bytes
        self.pools = []
        for tier in self.tiers:
            if tier.tier_id:
                try:
                    tier.memory.set_block_bytes(block_bytes)
                except ValueError as exc:  # smaller than one block: the tier stays unused
                    logger.warning("device tier %d (%s) is not used: %s", tier.tier_id,
                                   tier.device, exc)
            num_blocks = tier.memory.num_blocks
            tier.pool = BlockPool(num_blocks, tier.tier_id) if num_blocks else None
            self.pools.append(tier.pool)
        self.pools[0].on_evict = on_evict

    def infos(self) -> list[TierInfo]:
        """Every tier as HELLO announces it, tier 0 first."""
        return [tier.info() for tier in self.tiers]

    def readable_for(self, devices: list[str]) -> tuple[int, ...]:
        """Tier ids a session with HELLO `devices` may be handed, in read preference
        order: its own device tiers (in its order), the host arena, then, with
        ANY_DEVICE, every other device tier."""
        own = [self._by_device[d].tier_id for d in devices if d in self._by_device]
        order = [*own, 0]
        if ANY_DEVICE in devices:
            order += [t.tier_id for t in self.tiers[1:] if t.tier_id not in own]
        return tuple(order)

    def device_tier(self, tier_id: int) -> Tier | None:
        """The device tier `tier_id`, or None when there is no such device tier."""
        if 1 <= tier_id < len(self.tiers):
            return self.tiers[tier_id]
        return None

    # ------------------------------------------------------------------ readers
    def ready_prefix(self, keys: list[BlockHash], readable: tuple[int, ...]) -> int:
        """Length of the longest prefix of `keys` READY in some tier of `readable`."""
        pools = self.pools
        if len(readable) == 1:
            return pools[readable[0]].num_ready_prefix(keys)
        indexes = [pools[t].cached for t in readable if pools[t] is not None]
        n = 0
        for key in keys:
            if not any(key in cached for cached in indexes):
                break
            n += 1
        return n

    def find(self, key: BlockHash, readable: tuple[int, ...]) -> list[KVCacheBlock] | None:
        """The READY blocks of `key` in the first tier of `readable` that holds it."""
        pools = self.pools
        for tier_id in readable:
            pool = pools[tier_id]
            if pool is not None:
                span = pool.cached.get(key)
                if span is not None:
                    return span
        return None

    def acquire_prefix(self, keys: list[BlockHash],
                       readable: tuple[int, ...]) -> list[list[KVCacheBlock]]:
        """Pin the longest prefix of `keys` READY in `readable`, each chunk in the first
        tier (read preference order) that holds it; hits and misses are counted in the
        pools (a hit in the tier that served it, misses in the host pool).

        Returns:
            One block list per pinned value, in order; release them with `free`.
        """
        pools = self.pools
        if len(readable) == 1:
            return pools[readable[0]].acquire_prefix(keys)
        spans = []
        for key in keys:
            span = self.find(key, readable)
            if span is None:
                break
            pool = pools[tier_of(span[0].ref)]
            pool.touch(span)
            pool.stats.hits += 1
            spans.append(span)
        pools[0].stats.misses += len(keys) - len(spans)
        return spans

    def touch(self, span: list[KVCacheBlock]) -> None:
        """Pin one value's blocks in their tier."""
        self.pools[tier_of(span[0].ref)].touch(span)

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one pin from each block, each in its own tier's pool (tail first within
        a tier, as `BlockPool.free`)."""
        pools = self.pools
        if len(pools) == 1:
            pools[0].free(blocks)
            return
        by_tier: dict[int, list[KVCacheBlock]] = {}
        for block in blocks:
            by_tier.setdefault(tier_of(block.ref), []).append(block)
        for tier_id, group in by_tier.items():
            pools[tier_id].free(group)

    def abort(self, blocks: list[KVCacheBlock]) -> None:
        """Abort one WRITING value (its blocks are in one tier)."""
        self.pools[tier_of(blocks[0].ref)].abort(blocks)

    # ----------------------------------------------------------------- requests
    def evict(self, key: BlockHash) -> bool:
        """Remove `key` from every tier's index; True when some tier held it."""
        return sum(pool.evict(key) for pool in self.pools if pool is not None) > 0

    def clear(self) -> int:
        """Evict every value of every tier (`BlockPool.clear`: pinned ones too); how many."""
        return sum(pool.clear() for pool in self.pools if pool is not None)

    def check_invariants(self) -> None:
        """`BlockPool.check_invariants` of every tier, plus: every block's ref names its
        tier (tests).

        Raises:
            AssertionError: an invariant is broken (indicates a bug).
        """
        for tier_id, pool in enumerate(self.pools):
            if pool is None:
                continue
            pool.check_invariants()
            for block in pool.blocks:
                assert block.ref == block_ref(tier_id, block.block_id), (
                    f"{block!r} has ref {block.ref:#x} outside tier {tier_id}; bug"
                )
