"""The device tiers a client session maps: opened by OPEN_TIER, kept across a reconnect to
the same arena generation, unmapped when they are not.

Why this file exists: `DaemonLink` (client/daemon_link.py) asks for the tiers of its
devices at HELLO; mapping one is its own concern (descriptors passed over the socket, a
"fake" tier mapped as an arena, a CUDA tier imported by client/tier_map.py) and is kept
apart from the link's call path. A tier that cannot be mapped here raises
`TierUnusable`, and the link reconnects without that device (docs/architecture.md,
"Tiers").
"""

import os

from lmcached.client.link_failures import describe
from lmcached.shm.arena import Arena
from lmcached.wire.protocol import HelloReply, OpenTier, TierInfo
from lmcached.wire.connection import Connection, DaemonError


class TierUnusable(Exception):
    """A device tier this session asked for cannot be mapped in this process."""

    def __init__(self, device: str, reason: str) -> None:
        super().__init__(f"{device}: {reason}")
        self.device = device
        self.reason = reason


def close_other(tiers: dict, kept: dict) -> None:
    """Unmap each tier mapping of `tiers` that `kept` does not hold (the same object)."""
    for tier_id, mapping in tiers.items():
        if kept.get(tier_id) is not mapping:
            mapping.close()  # devices whose unusable tier was warned about


def map_tier(info: TierInfo, handle, fd: int):
    """Map a device tier's memory from the descriptor OPEN_TIER sent.

    A "fake" tier is an anonymous arena (`Arena.from_fd`); a "cuda" tier is imported
    with CUDA VMM (client/tier_map.py).

    Raises:
        ValueError: another generation's memory, or a kind this client cannot map.
        Whatever the CUDA import raises (ImportError without cuda-bindings, CudaError).
    """
    if handle.kind == "fake":
        return Arena.from_fd(fd, handle.generation, info.block_bytes, handle.size_bytes)
    if handle.kind == "cuda":
        from lmcached.client.tier_map import CudaTierMap

        return CudaTierMap(info, handle, fd)
    raise ValueError(f"a device tier of kind {handle.kind!r} cannot be mapped by this client")


def map_tiers(conn: Connection, reply: HelloReply, devices: list[str], current: dict) -> dict:
    """The device tiers of `devices` in `reply`, mapped (the ones of `current` already
    mapped in this generation are kept).

    Args:
        conn: the session's connection, right after HELLO (OPEN_TIER is sent on it).
        reply: the HELLO reply (its tiers and generation).
        devices: the devices the session asked for.
        current: the link's mapped tiers, by tier id.

    Returns:
        tier id -> mapping (an `Arena` or a `CudaTierMap`).

    Raises:
        TierUnusable: a tier cannot be opened or mapped here (the session asked for
            it, so the daemon may hand it blocks of it: reconnect without it).
    """
    tiers: dict = {}
    try:
        _open_tiers(conn, reply, devices, current, tiers)
    except BaseException:
        close_other(tiers, current)
        raise
    return tiers


def _open_tiers(conn: Connection, reply: HelloReply, devices: list[str], current: dict,
                tiers: dict) -> None:
    for info in reply.tiers:
        if not info.tier_id or info.device not in devices:
            continue
        mapped = current.get(info.tier_id)
        if mapped is not None and mapped.generation == reply.generation:
            tiers[info.tier_id] = mapped
            continue
        try:
            handle, fds = conn.request_with_fds(OpenTier(info.tier_id))
        except (DaemonError, ConnectionError) as exc:
            raise TierUnusable(info.device, describe(exc)) from None
        try:
            if len(fds) != 1:
                raise TierUnusable(info.device, f"OPEN_TIER sent {len(fds)} descriptors")
            tiers[info.tier_id] = map_tier(info, handle, fds[0])
        except TierUnusable:
            raise
        except Exception as exc:  # no CUDA here, another device, a stale generation...
            raise TierUnusable(info.device, describe(exc)) from None
        finally:
            for fd in fds:
                os.close(fd)
