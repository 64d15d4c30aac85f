"""The client's one chunk-chain core: lookup, ACQUIRE with pins and record checks, and
store (ALLOC -> fill -> COMMIT, or ABORT), split into frame-sized requests.

Why this package exists: every client that reads or writes chunk chains (the engine, the
vLLM scheduler and worker, the adapters, CacheBlend's retriever) needs the same few
operations with the same guarantees, and copies written per caller had drifted apart
(one evicted its own head, one skipped checksums). They are written here once:

    frames.py   chunks_per_request: the most chunks one LOOKUP / ACQUIRE / ALLOC may
                carry; acquire_chain: ACQUIRE of a chain in every namespace of a session,
                split; fill_and_commit: fill ALLOCated blocks, then COMMIT, ABORT if the
                fill fails
    pins.py     Pins: leases, valid while their session is open; PinnedChunks: a
                pinned, checked run of records
    core.py     Chain: one layout's lookup, acquire + checks (token ids, checksums,
                INVALIDATE of a corrupt record) and store (a split store keeps earlier
                requests WRITING until the whole store is filled)

Callers import from here (`lmcached.client.chain`).
"""

from lmcached.client.chain.core import Chain, ChunkWrite, chain_parents
from lmcached.client.chain.frames import (
    acquire_chain,
    check_verify,
    chunk_ranges,
    chunks_per_request,
    fill_and_commit,
    wire_parent,
)
from lmcached.client.chain.pins import PinnedChunks, Pins, release_all

__all__ = [
    "Chain",
    "ChunkWrite",
    "PinnedChunks",
    "Pins",
    "acquire_chain",
    "chain_parents",
    "check_verify",
    "chunk_ranges",
    "chunks_per_request",
    "fill_and_commit",
    "release_all",
    "wire_parent",
]
