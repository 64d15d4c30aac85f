"""What the daemon answers to INFO and CLIENTS: the fields, after Redis's INFO.

Why this file exists: INFO and CLIENTS are the daemon's observable state, read by
operators, scripts and tests, so their field names never change once shipped
(snake_case, `*_bytes` with a `*_human` twin, one `errors_<code>` per error code).
Building them from the daemon's state lives here, apart from the request semantics
(`service.py`); the CLI's text rendering of the same fields is `stats.py`.
"""

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Iterable, Protocol

from lmcached import __version__
from lmcached.daemon.demotion import DemotionStats
from lmcached.daemon.spill.counters import info_fields
from lmcached.wire import protocol
from lmcached.wire.protocol import PROTOCOL_VERSION
from lmcached.daemon.session import Session
from lmcached.daemon.progress import loading_fields
from lmcached.daemon.stats import MAX_TENANTS, DaemonStats, StatsSnapshot
from lmcached.wire.units import format_bytes

if TYPE_CHECKING:
    from lmcached.daemon.block_pool import BlockPool
    from lmcached.daemon.demotion import Demoter
    from lmcached.daemon.spill.tier import SpillTier
    from lmcached.daemon.progress import Loading
    from lmcached.daemon.server_config import ServerConfig
    from lmcached.daemon.memory_tiers import TierSet
    from lmcached.shm.arena import Arena
    from lmcached.wire.protocol import Layout

INFO_SECTIONS = protocol.INFO_SECTIONS  # their names are the wire contract's
# The spill tiers' sections (`SpillTier.name`): `<name>_enabled: 0` while the tier is off.
SPILL_SECTIONS = INFO_SECTIONS[INFO_SECTIONS.index("stats") + 1:INFO_SECTIONS.index("tenants")]
InfoFields = dict[str, int | float | str]


class DaemonState(Protocol):
    """The daemon state INFO reads: `CacheService` (service.py, whose admin handlers
    call `info_sections`, so this module names the attributes here and does not import
    it back; see `CacheService` for each)."""

    config: "ServerConfig"
    arena: "Arena"
    tiers: "TierSet"
    pool: "BlockPool | None"
    demoter: "Demoter | None"
    spill_tiers: "list[SpillTier]"
    sessions: dict[int, Session]
    namespaces: "dict[Layout, int]"
    started_at: float
    load_progress: "Loading | None"
    loading: "Loading | None"
    stats: DaemonStats
_own_process = None  # a psutil.Process, made once: psutil.Process() reads /proc


def _memory_info():
    """This process's memory (psutil), through one `psutil.Process` per pid. psutil is
    imported here, not with the module: request semantics never load it (only INFO and
    CLIENTS read /proc)."""
    import psutil

    global _own_process
    if _own_process is None or _own_process.pid != os.getpid():
        _own_process = psutil.Process()
    return _own_process.memory_info()


def stats_fields(counters: StatsSnapshot) -> InfoFields:
    """INFO's `stats` section of a counter snapshot (without the device tiers' fields)."""
    stats: InfoFields = {
        "requests": counters.requests,
        "connections_received": counters.connections_received,
        "lookups": counters.lookups,
        "stores": counters.stores,
        "hits": counters.hits,
        "misses": counters.misses,
        "hit_rate": counters.hit_rate,
        "salted_hits": counters.salted_hits,
        "salted_misses": counters.salted_misses,
        "evictions": counters.evictions,
        "total_stored_bytes": counters.total_stored_bytes,
        "total_stored_human": format_bytes(counters.total_stored_bytes),
        "total_served_bytes": counters.total_served_bytes,
        "total_served_human": format_bytes(counters.total_served_bytes),
        "writing_expired": counters.writing_expired,
        "invalidated_chunks": counters.invalidated_chunks,
        "errors": sum(counters.errors.values()),
    }
    for code in sorted(counters.errors):
        stats[f"errors_{code}"] = counters.errors[code]
    return stats


def tenant_fields(counters: StatsSnapshot) -> InfoFields:
    """INFO's `tenants` section: `tenants_tracked` (fingerprints with a row of their
    own, at most `tenants_max`), then `tenant_<name>_hits` / `_misses` (chunks, by
    ACQUIRE) and `_lookups` (LOOKUP requests) per tenant: "unsalted", "other" (past the
    bound, or a salted ACQUIRE of a client of before fingerprints), and each tracked
    fingerprint (16 hex digits)."""
    fields: InfoFields = {"tenants_tracked": len(counters.tenants) - 2,
                          "tenants_max": MAX_TENANTS}
    for name, row in counters.tenants.items():
        fields.update(info_fields(row, f"tenant_{name}_"))
    return fields


def own_tenant_fields(fields: InfoFields, tenants: set[bytes]) -> InfoFields:
    """The `tenants` section `fields` as a session outside the daemon's uid sees it:
    `tenants_tracked`, `tenants_max` and the rows of `tenants` (the fingerprints it sent
    itself) only, so that no tenant's client reads another's counts or learns its
    fingerprint."""
    names = {tenant.hex() for tenant in tenants}
    return {name: value for name, value in fields.items()
            if not name.startswith("tenant_") or name.split("_")[1] in names}


def info_sections(service: DaemonState,
                  counters: StatsSnapshot | None = None) -> dict[str, InfoFields]:
    """INFO fields by section (INFO_SECTIONS, in that order) of a running daemon.

    Args:
        service: the daemon's state; its block pool may not exist yet (no layout).
        counters: its counters (`service.stats.snapshot`), taken now when None.

    Returns:
        section name -> {field name: value}; names never change once shipped.
    """
    pool, arena = service.pool, service.arena
    num_blocks = arena.num_blocks
    block_bytes = arena.block_bytes
    cached = pool.num_cached_blocks if pool else 0
    writing = pool.num_writing_blocks if pool else 0
    detached = pool.num_detached_blocks if pool else 0
    used_bytes = (cached + writing + detached) * block_bytes
    stored_bytes = pool.num_cached_bytes if pool else 0
    if counters is None:
        counters = service.stats.snapshot([p.stats if p else None for p in service.tiers.pools])
    memory = _memory_info()
    rss = memory.rss
    rss_private = rss - getattr(memory, "shared", 0)  # the arena is shared memory
    stats = stats_fields(counters)
    device_memory, device_blocks = _device_tier_info(service, counters, stats)
    return {
        "server": {
            "version": __version__,
            "protocol_version": PROTOCOL_VERSION,
            "name": service.config.name,
            "pid": os.getpid(),
            "socket": service.config.socket,
            "uptime_s": int(time.time() - service.started_at),
            **loading_fields(service.load_progress, service.loading is not None),
            "generation": arena.generation,
            "shm_segment": arena.segment_name,
            "rss_bytes": rss,
            "rss_human": format_bytes(rss),
            "rss_private_bytes": rss_private,
            "rss_private_human": format_bytes(rss_private),
        },
        "memory": {
            "capacity_bytes": arena.capacity_bytes,
            "capacity_human": format_bytes(arena.capacity_bytes),
            "block_bytes": block_bytes,
            "block_human": format_bytes(block_bytes),
            "used_bytes": used_bytes,
            "used_human": format_bytes(used_bytes),
            "stored_bytes": stored_bytes,
            "stored_human": format_bytes(stored_bytes),
            "fill_ratio": round(stored_bytes / (cached * block_bytes), 4) if cached else 0.0,
            **device_memory,
        },
        "blocks": {
            "num_blocks": num_blocks,
            "free_blocks": pool.num_empty_blocks if pool else num_blocks,
            "cached_blocks": cached,
            "pinned_blocks": pool.num_pinned_blocks if pool else 0,
            "writing_blocks": writing,
            "detached_blocks": detached,
            "evictable_blocks": pool.num_free_blocks - pool.num_empty_blocks if pool else 0,
            "cached_values": len(pool.cached) if pool else 0,
            **device_blocks,
        },
        "clients": {
            "connected_clients": len(service.sessions),
            "namespaces": len(service.namespaces),
            "namespaces_sglang": sum(layout.fmt == "sglang" for layout in service.namespaces),
            "namespaces_freed": service.stats.freed_namespaces["namespaces"],
        },
        "stats": {**stats, **service.events.info()},
        **spill_tier_info(service.spill_tiers),
        "tenants": tenant_fields(counters),
    }


def spill_tier_info(spill_tiers: "list[SpillTier]") -> dict[str, InfoFields]:
    """INFO's section of each spill tier (SPILL_SECTIONS, in that order): its `info()`,
    or `{<name>_enabled: 0}` while it is off. A tier whose name is no INFO section (a
    test's) adds none: the sections are the wire contract's."""
    attached = {tier.name: tier for tier in spill_tiers}
    return {name: attached[name].info() if name in attached else {f"{name}_enabled": 0}
            for name in SPILL_SECTIONS}


# States of a device tier's blocks: INFO `tier<i>_<state>_blocks`, label `state` of
# lmcached_tier_blocks.
TIER_BLOCK_STATES = ("free", "cached", "pinned", "writing", "detached", "demoting")


@dataclasses.dataclass(frozen=True)
class DeviceTierRow:
    """One device tier's numbers at one instant (plain values): INFO's `tier<i>_*`
    fields (`_device_tier_info`) and the lmcached_tier_* families
    (`metrics.device_tier_families`) are both made from it.

    Attributes:
        tier_id: i >= 1 (the host arena is tier 0).
        kind / device: the tier's kind and device (e.g. "cuda", "cuda:0").
        failed: a device error marked it failed (it takes no new chunks).
        capacity_bytes / stored_bytes: its size, and the bytes of its cached values.
        num_blocks: its blocks (0 before its pool exists).
        blocks: blocks by state, one per TIER_BLOCK_STATES, in that order.
        hits: chunks it served to ACQUIRE.
    """

    tier_id: int
    kind: str
    device: str
    failed: bool
    capacity_bytes: int
    stored_bytes: int
    num_blocks: int
    blocks: dict[str, int]
    hits: int


def device_tier_rows(service: DaemonState, counters: StatsSnapshot) -> list[DeviceTierRow]:
    """A row per device tier of `service`, by tier id; [] without device tiers."""
    demoter = service.demoter
    rows = []
    for tier in service.tiers.device_tiers:
        pool = tier.pool
        by_state = (pool.num_empty_blocks, pool.num_cached_blocks, pool.num_pinned_blocks,
                    pool.num_writing_blocks, pool.num_detached_blocks) if pool else (0,) * 5
        demoting = demoter.demoting_blocks[tier.tier_id] if demoter else 0
        rows.append(DeviceTierRow(
            tier_id=tier.tier_id, kind=tier.kind, device=tier.device, failed=tier.failed,
            capacity_bytes=tier.size_bytes,
            stored_bytes=pool.num_cached_bytes if pool else 0,
            num_blocks=pool.num_blocks if pool else 0,
            blocks=dict(zip(TIER_BLOCK_STATES, (*by_state, demoting))),
            hits=counters.tier_hits[tier.tier_id]))
    return rows


def demotion_stats(service: DaemonState) -> DemotionStats | None:
    """A copy of the demotion counters (zeros before a demoter exists), or None without
    device tiers (INFO then shows none)."""
    if not service.tiers.device_tiers:
        return None
    return dataclasses.replace(service.demoter.stats) if service.demoter else DemotionStats()


def _device_tier_info(service: DaemonState, counters: StatsSnapshot,
                      stats: InfoFields) -> tuple[InfoFields, InfoFields]:
    """The `memory` and `blocks` fields of each device tier (`tier<i>_...`, i >= 1),
    and its hits and the demotion counters added to `stats`; the host arena's fields
    keep their names. Nothing without device tiers."""
    memory: InfoFields = {}
    blocks: InfoFields = {}
    rows = device_tier_rows(service, counters)
    if not rows:
        return memory, blocks
    memory["device_tiers"] = len(rows)
    for row in rows:
        t = f"tier{row.tier_id}_"
        memory.update({
            t + "kind": row.kind,
            t + "device": row.device,
            t + "state": "failed" if row.failed else "ok",
            t + "capacity_bytes": row.capacity_bytes,
            t + "capacity_human": format_bytes(row.capacity_bytes),
            t + "stored_bytes": row.stored_bytes,
            t + "stored_human": format_bytes(row.stored_bytes),
        })
        blocks[t + "num_blocks"] = row.num_blocks
        blocks.update({f"{t}{state}_blocks": count for state, count in row.blocks.items()})
        stats[t + "hits"] = row.hits
    stats.update(info_fields(demotion_stats(service), ""))
    return memory, blocks


def client_rows(sessions: Iterable[Session]) -> list[InfoFields]:
    """CLIENTS fields: one row per session (`id= pid= name= age_s= pinned_blocks= ...`).

    The process name and RSS come from psutil; a process that is gone or may not be
    inspected shows as `proc` "?" and `rss_bytes` 0.
    """
    import psutil

    now = time.monotonic()
    out = []
    for s in sessions:
        try:
            proc = psutil.Process(s.pid)
            proc_name, rss = proc.name(), proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            proc_name, rss = "?", 0
        out.append({
            "id": s.session_id,
            "pid": s.pid,
            "name": s.name,
            "proc": proc_name,
            "rss_bytes": rss,
            "uid": s.uid,
            "ns": ",".join(map(str, s.namespaces)) or "-",
            "devices": ",".join(s.devices) or "-",
            "age_s": round(now - s.created_at, 1),
            "idle_s": round(now - s.last_request_at, 1),
            "pinned_blocks": s.num_pinned_blocks,
            "writing_blocks": s.num_writing_blocks,
            "requests": s.num_requests,
        })
    return out
