"""What the serving core's scheduler side sends its workers, and their shared settings.

Why this file exists: the scheduler side (client/serving/scheduler.py) and the worker side
(client/serving/worker.py) of an engine's connector run in different processes and share
only the pickled step metadata, the daemon and its arena; what they exchange is defined
here. Block ids and the block size are the engine's (vLLM's paged blocks).
"""

import dataclasses
from typing import Callable

import numpy as np

from lmcached.client.chain import check_verify
from lmcached.client.daemon_link import DaemonLink
from lmcached.client.layout import KVLayout
from lmcached.wire.logger import init_logger
from lmcached.shm.arena import Arena

logger = init_logger(__name__)


@dataclasses.dataclass
class ConnectorSettings:
    """The connector's configuration, identical on the scheduler and every worker.

    Attributes:
        layouts: one KVLayout (namespace) per TP rank, index = rank.
        chunk_size: tokens per chunk, a multiple of block_size.
        block_size: the engine's block size in tokens.
        world_size: TP world size.
        socket: daemon socket path (None: that of daemon `daemon_name`).
        daemon_name: daemon name, used when socket is None (None: $LMCACHED_NAME, else
            "default").
        timeout_s: per-request timeout of a daemon session, seconds.
        verify: "tokens" (default): workers check each record's header and token ids
            before a load. "checksum": saves also seal a payload checksum into every
            record, and loads check it (client/chain/, `Chain`).

    Raises:
        ValueError: verify is neither "tokens" nor "checksum".
    """

    layouts: list[KVLayout]
    chunk_size: int
    block_size: int
    world_size: int
    socket: str | None
    daemon_name: str | None
    timeout_s: float
    verify: str = "tokens"

    def __post_init__(self) -> None:
        check_verify(self.verify)

    @property
    def blocks_per_chunk(self) -> int:
        """Engine blocks in one chunk."""
        return self.chunk_size // self.block_size

    def open_link(self, ranks: list[int], client_name: str,
                  on_attach: Callable[[Arena], object] | None = None,
                  on_detach: Callable[[Arena], object] | None = None) -> DaemonLink:
        """A daemon session in the namespaces of `ranks` (one per rank, in order); marked
        down (misses) if unreachable.

        The scheduler opens one session for every rank, so that one LOOKUP or ACQUIRE
        covers all of them; a worker opens its own rank's.
        `on_attach` / `on_detach` are called with each arena the session maps / unmaps
        (e.g. to page-lock it for CUDA copies).
        """
        link = DaemonLink(self.socket, self.daemon_name,
                          [self.layouts[rank].to_wire() for rank in ranks],
                          self.timeout_s, client_name)
        link.on_attach, link.on_detach = on_attach, on_detach
        link.try_connect()
        return link


@dataclasses.dataclass
class LoadSpec:
    """Chunks one request loads from the arena in this step (scheduler -> workers).

    Attributes:
        req_id: the engine's request id.
        epoch: the request's save epoch (see SaveSpec) when the load was planned.
        first_chunk: index of the first loaded chunk in the request.
        tokens: int64 `[num_chunks * chunk_size]` token ids of the chunks, checked
            against each record's header before its bytes are used.
        hashes: the chunks' 16-byte prefix hashes.
        spans: `[rank][chunk]` arena block ids of each record pinned for that rank;
            shorter than `hashes` when a chunk could not be pinned.
        generations: `[rank]` arena generation the spans belong to.
        block_offsets: `[chunk]` positions (within the chunk) of the engine blocks to fill.
        block_ids: `[chunk]` engine block ids to fill, aligned with block_offsets.
    """

    req_id: str
    epoch: int
    first_chunk: int
    tokens: np.ndarray
    hashes: list[bytes]
    spans: list[list[list[int]]]
    generations: list[int]
    block_offsets: list[list[int]]
    block_ids: list[list[int]]


@dataclasses.dataclass
class SaveSpec:
    """New full chunks of one request to store after this step's forward pass.

    Attributes:
        req_id: the engine's request id.
        epoch: bumped by the scheduler when a load of the request failed; a worker
            skips saves of an epoch whose load failed (their KV attended to bad blocks).
        tokens: int64 `[num_chunks * chunk_size]` token ids of the chunks.
        hashes: the chunks' 16-byte prefix hashes.
        block_ids: `[num_chunks * blocks_per_chunk]` engine block ids holding them.
        parent: the 16-byte hash of the chunk before `hashes[0]` in the request's
            chain (saved in an earlier step), ROOT_HASH when `hashes[0]` is the chain's
            first (salted or not: the daemon never learns a salt), which the daemon
            publishes as the first chunk's parent in its KV event feed; None: not
            known (the chunk stored before it in the same ALLOC stands in).
    """

    req_id: str
    epoch: int
    tokens: np.ndarray
    hashes: list[bytes]
    block_ids: list[int]
    parent: bytes | None = None
