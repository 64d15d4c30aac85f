"""The namespace registry of the daemon: HELLO, and a namespace id per layout.

Why this file exists: a namespace (docs/architecture.md, "Namespaces") lives while an open
session or a cached value uses it, and its id is given again once freed; how ids are
given, counted and freed, and how the first layout sets the block size, is apart from
the value and admin handlers. `NamespaceRegistry` holds the ids and what each is
used by, as an object of its own (the service's `ns_registry`); the HELLO handler and
the functions that register and free a namespace take the daemon state they read and
change as an argument (`HelloState`: the service), not as a part of it.
"""

import heapq
import os
from typing import TYPE_CHECKING, Protocol

import msgspec

from lmcached.daemon import keys
from lmcached.wire.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HelloReply,
    Layout,
)
from lmcached.daemon.session import Session
from lmcached.shm.arena import HEADER_BYTES
from lmcached.shm.geometry import MIN_BLOCK_BYTES, min_block_bytes
from lmcached.daemon.replies import RequestError
from lmcached.daemon.request_checks import CheckState, check_record_fits
from lmcached.wire.logger import init_logger
from lmcached.wire.units import format_bytes

if TYPE_CHECKING:  # named in annotations only (no import at run time)
    from lmcached.daemon.spill.tier import SpillTier
    from lmcached.shm.arena import Arena

logger = init_logger(__name__)

BLOCK_ALIGN_BYTES = 4096  # a block size chosen from a layout is rounded up to this
MIN_DERIVED_BLOCKS = 16  # a block size derived from a layout leaves at least this many
MAX_DERIVED_BLOCKS = 1 << 16  # ... and at most this many (a client may not choose more)
# Namespaces (docs/architecture.md, "Namespaces"): one HELLO registers one layout per
# rank it serves (a vLLM scheduler: TP x PP ranks, 8 on a node, 64 across 8 nodes'
# pipeline); the daemon keeps a namespace while a session or a cached value uses it,
# and at most MAX_NAMESPACES at once (~1 KiB each: a few MiB at most).
MAX_LAYOUTS_PER_SESSION = 64
MAX_NAMESPACES = 4096


def _namespace_layout(layout: Layout) -> Layout:
    """The layout as its namespace is keyed: a key-value adapter's record_bytes is only a
    size hint, so its layouts of every hint share one namespace."""
    if layout.fmt == "kv":
        return msgspec.structs.replace(layout, record_bytes=1)
    return layout


class NamespaceRegistry:
    """The namespaces alive and their ids (docs/architecture.md, "Namespaces"): a layout
    gets an id at the first HELLO that names it, and keeps it while an open session or
    a cached value uses it; a freed id is given again, the smallest first.

    Attributes:
        ids: layout (as keyed, `_namespace_layout`) -> namespace id, of every namespace
            alive (the service's `namespaces`).
        layouts: namespace id -> its layout.
        prefixes: namespace id -> the block-pool key prefix of its chunks
            (`keys.chunk_prefix`).
        num_sessions: namespace id -> open sessions that registered it (absent: none).
    """

    def __init__(self) -> None:
        self.ids: dict[Layout, int] = {}
        self.layouts: dict[int, Layout] = {}
        self.prefixes: dict[int, bytes] = {}
        self.num_sessions: dict[int, int] = {}
        self._free_ids: list[int] = []  # a heap: the smallest freed id is given first
        self._next_id = 1

    def add(self, layout: Layout) -> int:
        """Give `layout` (as keyed) an id, the smallest freed one first; returns it."""
        if self._free_ids:
            ns = heapq.heappop(self._free_ids)
        else:
            ns = self._next_id
            self._next_id += 1
        self.ids[layout] = ns
        self.layouts[ns] = layout
        self.prefixes[ns] = keys.chunk_prefix(ns)
        return ns

    def remove(self, ns: int) -> Layout:
        """Free id `ns` (to be given again); returns its layout."""
        layout = self.layouts.pop(ns)
        del self.ids[layout]
        del self.prefixes[ns]
        heapq.heappush(self._free_ids, ns)
        return layout

    def open_session(self, namespaces: list[int]) -> None:
        """A session registered `namespaces` (its HELLO)."""
        for ns in namespaces:
            self.num_sessions[ns] = self.num_sessions.get(ns, 0) + 1

    def close_session(self, namespaces: list[int]) -> list[int]:
        """A session of `namespaces` ended; returns those no open session uses now."""
        unused = []
        for ns in namespaces:
            left = self.num_sessions[ns] - 1
            if left:
                self.num_sessions[ns] = left
            else:
                del self.num_sessions[ns]
                unused.append(ns)
        return unused


class HelloState(CheckState, Protocol):
    """The daemon state HELLO and the namespace functions read and change: the
    `CacheService` (service.py, which imports this module, so the attributes are named
    here; see `CacheService` for each), the checks' state and these."""

    spill_tiers: "list[SpillTier]"
    ns_registry: NamespaceRegistry

    def make_pool(self) -> None:
        """Cut the arena into blocks of its block size, once it is known."""


def hello(service: HelloState, session: Session, req: Hello) -> HelloReply:
    """HELLO (commands.py): register the session's layouts as namespaces and describe
    the arena and tiers to it.

    Raises:
        RequestError: `bad_request` (a second HELLO, too many or repeated layouts),
            `version`, `max_namespaces`, `too_large` (a record that does not fit).
    """
    if session.greeted:
        raise RequestError("bad_request", "HELLO was already sent on this connection")
    if req.version != PROTOCOL_VERSION:
        raise RequestError(
            "version", f"protocol version {req.version}; this daemon speaks "
            f"{PROTOCOL_VERSION}: use an lmcached client of the daemon's version"
        )
    if len(req.layouts) > MAX_LAYOUTS_PER_SESSION:
        raise RequestError(
            "bad_request", f"{len(req.layouts)} layouts in one HELLO (at most "
            f"{MAX_LAYOUTS_PER_SESSION})"
        )
    if len(set(req.layouts)) != len(req.layouts):
        raise RequestError("bad_request", "the same layout twice in one HELLO")
    _check_namespace_room(service.ns_registry, req.layouts)
    namespaces = []
    try:
        for layout in req.layouts:
            namespaces.append(register_layout(service, layout))
    except RequestError:
        for ns in namespaces:  # registered for this HELLO alone
            free_namespace_if_unused(service, ns)
        raise
    service.ns_registry.open_session(namespaces)
    session.greeted = True
    session.name = req.name[:128]
    session.namespaces = namespaces
    session.record_bytes = {ns: layout.record_bytes for ns, layout in
                            zip(namespaces, req.layouts) if layout.fmt != "kv"}
    session.devices = list(req.devices)
    session.readable = service.tiers.readable_for(session.devices)
    return HelloReply(
        session.session_id,
        service.config.name,
        service.arena.generation,
        service.arena.block_bytes,
        service.arena.num_blocks,
        service.arena.capacity_bytes,
        namespaces,
        os.getpid(),
        service.tiers.infos(),
    )


def register_layout(service: HelloState, layout: Layout) -> int:
    """The namespace id of `layout`, registered now if new (the first layout of the
    daemon's life sets the block size when `--block-size` is unset).

    Raises:
        RequestError: `too_large`, the layout's chunk record does not fit.
    """
    # The schema (protocol.Layout) has already checked every field's range.
    arena, config = service.arena, service.config
    if service.pool is None:
        block_bytes = config.block_bytes or _block_bytes_for(arena, layout)
        usable = arena.capacity_bytes - HEADER_BYTES
        if layout.record_bytes > usable // block_bytes * block_bytes:
            raise _too_large(layout, usable)  # refused before it sets the block size
        try:
            arena.set_block_bytes(block_bytes)
        except ValueError as exc:
            raise RequestError("too_large", str(exc)) from None
        service.make_pool()
        if config.block_bytes:
            logger.info("block_bytes=%d (--block-size): %d blocks", block_bytes,
                        arena.num_blocks)
        else:
            _warn_derived_block_bytes(arena, layout)
    check_record_fits(service, layout.record_bytes)
    layout = _namespace_layout(layout)
    registry = service.ns_registry
    ns = registry.ids.get(layout)
    if ns is None:
        ns = registry.add(layout)
        service.stats.ns_hits[ns] = 0
        service.stats.ns_misses[ns] = 0
        for tier in service.spill_tiers:
            tier.register_namespace(ns, layout)
    return ns


def _check_namespace_room(registry: NamespaceRegistry, layouts: list[Layout]) -> None:
    """Refuse a HELLO whose new layouts would take the namespaces alive over
    MAX_NAMESPACES (before any is registered)."""
    new = {_namespace_layout(layout) for layout in layouts} - registry.ids.keys()
    if len(registry.ids) + len(new) > MAX_NAMESPACES:
        raise RequestError(
            "max_namespaces", f"this HELLO's {len(new)} new layout(s) would take the "
            f"daemon over {MAX_NAMESPACES} namespaces, each used by an open session or "
            f"a cached value ({len(registry.ids)} now): close the sessions of layouts "
            "no longer served, evict their chunks (lmcached clear), or run one daemon "
            "per model (lmcached@NAME)"
        )


def end_namespaces(service: HelloState, session: Session) -> None:
    """An ended session no longer uses its namespaces: free those nothing else uses."""
    for ns in service.ns_registry.close_session(session.namespaces):
        free_namespace_if_unused(service, ns)


def namespace_emptied(service: HelloState, tag: bytes) -> None:
    """`ValueLedger.on_group_empty` (a pool's `ledger`): a pool's last value of a
    namespace left it."""
    ns = int.from_bytes(tag, "little")
    if ns in service.ns_registry.layouts:
        free_namespace_if_unused(service, ns)


def free_namespace_if_unused(service: HelloState, ns: int) -> None:
    """Free namespace `ns` when no open session and no cached value (any tier) uses
    it: its id may then be given to another layout, which can never find a value of
    this one (none is left, and the L2 tier drops the fetches still in flight for it,
    `L2Tier.unregister_namespace`). Its hit and miss counts go to
    `stats.freed_namespaces`."""
    registry = service.ns_registry
    if ns in registry.num_sessions:
        return
    tag = keys.namespace_tag(ns)
    if any(pool is not None and tag in pool.ledger.num_values_by_group
           for pool in service.tiers.pools):
        return
    layout = registry.remove(ns)
    stats = service.stats
    hits, misses = stats.ns_hits.pop(ns), stats.ns_misses.pop(ns)
    freed = stats.freed_namespaces
    freed["namespaces"] += 1
    freed["hit_chunks"] += hits
    freed["miss_chunks"] += misses
    freed["hit_tokens"] += hits * layout.chunk_size
    freed["miss_tokens"] += misses * layout.chunk_size
    for tier in service.spill_tiers:
        tier.unregister_namespace(ns)
    logger.debug("namespace %d (%s) freed: no session and no cached value uses it", ns,
                 layout.model_name)


def _block_bytes_for(arena: "Arena", layout: Layout) -> int:
    """Block size derived from the first layout when `--block-size` is unset.

    The rule (README's options table, docs/architecture.md "Block size"): the
    layout's record size rounded up to BLOCK_ALIGN_BYTES, so that one chunk takes
    one block, whenever the arena still holds MIN_DERIVED_BLOCKS such blocks (any
    capacity >= 1 GiB for Llama-3-8B's 32 MiB chunks: 31 blocks). A larger record
    is cut into the fewest equal page-rounded pieces that leave MIN_DERIVED_BLOCKS
    blocks (two 16 MiB + 4 KiB blocks per 32 MiB chunk in a 512 MiB arena), so the
    record still fills its blocks and no client can shrink the usable arena for the
    others. Never so small that the arena has more than MAX_DERIVED_BLOCKS blocks
    or blocks below MIN_BLOCK_BYTES (a smaller record then leaves the rest of its
    block unused), so that no client can make every walk over the cached
    values long.

    Args:
        arena: the daemon's arena (its capacity).
        layout: the first layout of the daemon's life.

    Returns:
        The block size in bytes, a multiple of BLOCK_ALIGN_BYTES.
    """
    wanted = _round_up(layout.record_bytes, BLOCK_ALIGN_BYTES)
    usable = arena.capacity_bytes - HEADER_BYTES
    ceiling = max(BLOCK_ALIGN_BYTES,  # an arena under 16 pages: one page
                  usable // MIN_DERIVED_BLOCKS // BLOCK_ALIGN_BYTES * BLOCK_ALIGN_BYTES)
    if wanted > ceiling:  # several blocks per record: equal pieces, each <= ceiling
        num_pieces = -(-wanted // ceiling)
        wanted = _round_up(-(-layout.record_bytes // num_pieces), BLOCK_ALIGN_BYTES)
    floor = _round_up(-(-usable // MAX_DERIVED_BLOCKS), BLOCK_ALIGN_BYTES)
    return max(MIN_BLOCK_BYTES, floor, wanted)


def _warn_derived_block_bytes(arena: "Arena", layout: Layout) -> None:
    """Log the block size the first layout set, with its fill ratio and the
    `--block-size` that keeps it whichever client comes first."""
    block_bytes = arena.block_bytes
    blocks_per_record = -(-layout.record_bytes // block_bytes)
    fill_ratio = layout.record_bytes / (blocks_per_record * block_bytes)
    one_block = max(_round_up(layout.record_bytes, BLOCK_ALIGN_BYTES),
                    _round_up(min_block_bytes(arena.capacity_bytes), BLOCK_ALIGN_BYTES))
    usable = arena.capacity_bytes - HEADER_BYTES
    best = one_block if usable // one_block >= MIN_DERIVED_BLOCKS else block_bytes
    logger.warning(
        "--block-size is unset: the first layout (%s, chunk record %d bytes) set "
        "block_bytes=%d for the daemon's life: %d blocks, %d block(s) per chunk, fill "
        "ratio %.4f; start the daemon with --block-size %d so that the block size does "
        "not depend on which client comes first",
        layout.model_name, layout.record_bytes, block_bytes, arena.num_blocks,
        blocks_per_record, fill_ratio, best,
    )


def _too_large(layout: Layout, usable_bytes: int) -> RequestError:
    """The refusal (a permanent one for clients) of a first layout whose chunk record is
    larger than the whole arena, naming both sizes and the fix."""
    needed_mib = -(-(layout.record_bytes + HEADER_BYTES) // (1 << 20))
    return RequestError(
        "too_large",
        f"a chunk record of {layout.record_bytes} bytes ({format_bytes(layout.record_bytes)}) "
        f"does not fit in the arena's {usable_bytes} usable bytes: start the daemon with "
        f"--capacity {needed_mib}MiB or more (several times that, to cache more than one "
        f"chunk), or give the client a smaller chunk_size",
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
