"""`check_pool_invariants`: every invariant of a `BlockPool`, verified in O(num_blocks).

Why this file exists: the check is the pool's specification in executable form (the
exact-order and model-based tests run it after every step), long enough to read on its
own; `BlockPool.check_invariants` calls it.
"""

from typing import Protocol

from lmcached.daemon.free_queue import BlockHash, BlockState, FreeKVCacheBlockQueue, KVCacheBlock


class PoolState(Protocol):
    """The parts of a `BlockPool` the check reads (block_pool.py calls the check, so this
    module names them here and does not import it back; see `BlockPool` for each)."""

    blocks: list[KVCacheBlock]
    free_block_queue: FreeKVCacheBlockQueue
    cached: dict[BlockHash, list[KVCacheBlock]]
    num_cached_bytes: int
    num_writing_blocks: int
    num_cached_blocks: int
    num_detached_blocks: int
    num_pinned_blocks: int


def check_pool_invariants(pool: PoolState) -> None:
    """Verify every invariant of `pool` in O(num_blocks) (tests and debug builds).

    Raises:
        AssertionError: an invariant is broken (indicates a bug).
    """
    queued = {id(b) for b in pool.free_block_queue.get_all_free_blocks()}
    assert len(queued) == pool.free_block_queue.num_free_blocks, (
        "free queue length differs from num_free_blocks; this indicates a bug"
    )
    counts = {"writing": 0, "cached": 0, "detached": 0, "pinned": 0}
    for block in pool.blocks:
        assert block.ref_cnt >= 0, f"negative ref_cnt in {block!r}; bug"
        in_queue = id(block) in queued
        should_be = block.ref_cnt == 0 and block.state != BlockState.WRITING
        assert in_queue == should_be, (
            f"{block!r} in free queue: {in_queue}, expected {should_be}; bug"
        )
        if block.state == BlockState.WRITING:
            assert block.ref_cnt >= 1, f"unheld WRITING block {block!r}; bug"
            counts["writing"] += 1
        elif block.state == BlockState.READY:
            if block.block_hash is None:
                assert block.ref_cnt > 0, f"unpinned detached {block!r}; bug"
                counts["detached"] += 1
            else:
                span = pool.cached.get(block.block_hash)
                assert span is not None and block in span, (
                    f"READY {block!r} is not indexed under its hash; bug"
                )
                counts["cached"] += 1
            if block.ref_cnt > 0:
                counts["pinned"] += 1
        else:
            assert block.block_hash is None and block.ref_cnt == 0, (
                f"FREE block with a hash or a ref: {block!r}; bug"
            )
    for span in pool.cached.values():
        for block in span:
            assert block.state == BlockState.READY and block.span is span, (
                f"index points at {block!r} that is not READY in this span; bug"
            )
    cached_bytes = sum(b.num_bytes for span in pool.cached.values() for b in span)
    assert cached_bytes == pool.num_cached_bytes, (
        f"num_cached_bytes {pool.num_cached_bytes} != {cached_bytes}; bug"
    )
    assert counts == {
        "writing": pool.num_writing_blocks,
        "cached": pool.num_cached_blocks,
        "detached": pool.num_detached_blocks,
        "pinned": pool.num_pinned_blocks,
    }, f"gauges differ from the blocks: {counts}; bug"
