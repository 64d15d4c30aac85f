"""Save on stop and prewarm inside one CacheService (lmcached/daemon/disk/save.py,
prewarm.py): no socket; job completions applied by hand as the loop would.

The save writes every arena chunk not on disk and leaves the disk LRU in the arena's
order; the prewarm reads the hottest disk chunks into the arena's empty blocks only,
never evicts what a client stored since the start, and leaves the hottest the most
recently used.
"""

from test_disk_slots import chain
from test_disk_tier import BLOCK_BYTES, KV_BYTES, RECORD_BYTES, assert_nothing_held, \
    close_disk_service, full_blocks, open_disk_service, settle, store_chunk, \
    written_then_restarted
from test_service import greeted
from lmcached.daemon.keys import chunk_prefix
from lmcached.daemon.spill.envelope import namespace_fingerprint


def arena_bytes(service, blocks) -> bytes:
    arena = service.arena
    return b"".join(arena.numpy_view(arena.block_offset(b.block_id), b.num_bytes).tobytes()
                    for b in blocks)


def test_the_save_writes_the_arenas_chunks_and_keeps_their_lru_order(unique_name, tmp_path):
    layout, chunks = full_blocks(BLOCK_BYTES)
    service = open_disk_service(unique_name, str(tmp_path / "disk"))  # on-evict
    try:
        session = greeted(service, layout)
        for _, chunk_hash, record in chunks:
            store_chunk(service, session, chunk_hash, record)
        settle(service, lambda: not service.spill_tier("disk")._writing)
        tier = service.spill_tier("disk")
        arena_order = [key[5:] for key, _ in service.pool.lru_values(100)]
        assert len(arena_order) == len(chunks)
        before = len(tier.index.entries)
        assert before < len(chunks)  # some were written ahead, not all
        result = tier.save_on_stop(5.0)
        assert result["written"] == len(chunks) - before and result["unwritten"] == 0
        fp = namespace_fingerprint(layout)
        assert [key for key in tier.index.entries] == [(fp, h) for h in arena_order]
        for _, chunk_hash, record in chunks:  # the bytes on disk are the chunk's
            entry = tier.index.get((fp, chunk_hash))
            with open(tier.slots.path, "rb") as f:
                f.seek(tier.slots.slot_offset(entry.slot) + 4096)
                assert f.read(len(record)) == record
        assert tier.save_on_stop(0)["written"] == 0  # off
    finally:
        close_disk_service(service)


def test_the_prewarm_fills_empty_blocks_only_hottest_last(unique_name, tmp_path):
    layout, chunks = full_blocks(BLOCK_BYTES)  # 6 chunks, one block each: the whole arena
    service = written_then_restarted(unique_name, str(tmp_path / "disk"), BLOCK_BYTES, chunks,
                                     layout)
    try:
        tier = service.spill_tier("disk")
        session = greeted(service, layout)  # plans the prewarm of all 6 (6 empty blocks)
        assert tier.prewarm_info()["disk_prewarm_pending"] == len(chunks)
        assert tier.prewarm_info()["disk_prewarm_state"] == "running"
        # A client stores 2 chunks before the first batch: the prewarm has room for 4.
        own = chain(2, BLOCK_BYTES - (RECORD_BYTES - KV_BYTES), first_token=90_000)
        for _, chunk_hash, record in own:
            store_chunk(service, session, chunk_hash, record)
        def done() -> bool:  # the housekeeping's pump, as the loop calls it
            tier.prewarm_pump()
            return tier.prewarm_info()["disk_prewarm_state"] == "done"
        settle(service, done)
        info = tier.prewarm_info()
        assert info["disk_prewarm_chunks"] == 4 and info["disk_prewarm_skipped"] == 2
        assert info["disk_prewarm_failures"] == 0
        prefix = chunk_prefix(1)
        cached = service.pool.cached
        for _, chunk_hash, record in own:  # never evicted for the prewarm
            assert arena_bytes(service, cached[prefix + chunk_hash]) == record
        hottest = chunks[2:]  # written last, so the most recent on disk
        for _, chunk_hash, record in hottest:
            assert arena_bytes(service, cached[prefix + chunk_hash]) == record
        # The arena evicts the client's older stores first, then the prewarmed chunks
        # coldest first: the hottest is the most recently used.
        assert [key for key, _ in service.pool.lru_values(100)] == \
            [prefix + h for _, h, _ in own] + [prefix + h for _, h, _ in hottest]
        assert_nothing_held(service)
    finally:
        close_disk_service(service)


def test_a_prewarmed_slot_that_fails_its_checks_is_counted_forgotten_and_given_back(
        unique_name, tmp_path):
    import os

    layout, chunks = full_blocks(BLOCK_BYTES)
    service = written_then_restarted(unique_name, str(tmp_path / "disk"), BLOCK_BYTES, chunks,
                                     layout)
    try:
        tier = service.spill_tier("disk")
        key = (namespace_fingerprint(layout), chunks[3][1])
        entry = tier.index.get(key)
        with open(tier.slots.path, "r+b") as f:  # a KV byte of chunk 3's record
            f.seek(tier.slots.slot_offset(entry.slot) + 4096 + BLOCK_BYTES - 1)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        greeted(service, layout)

        def done() -> bool:
            tier.prewarm_pump()
            return tier.prewarm_info()["disk_prewarm_state"] == "done"
        settle(service, done)
        info = tier.info()
        assert info["disk_prewarm_chunks"] == len(chunks) - 1
        assert info["disk_prewarm_failures"] == 1 and info["disk_fetch_verify_checksum"] == 1
        assert tier.index.get(key) is None  # never read again
        prefix = chunk_prefix(1)
        assert prefix + chunks[3][1] not in service.pool.cached
        assert service.pool.num_empty_blocks == 1  # its block given back
        assert_nothing_held(service)
    finally:
        close_disk_service(service)


def test_the_plan_walks_the_disk_index_in_bounded_steps_and_reads_after_it(
        unique_name, tmp_path, monkeypatch):
    """A namespace's registration examines at most PREWARM_PLAN_BATCH disk index
    entries (the index may hold millions, most of them other namespaces'); each pump
    examines that many more, and the reads start once the walk is over, so that the
    arena ends in the disk's order (the hottest the most recent), as in one step."""
    from lmcached.daemon.disk import prewarm

    monkeypatch.setattr(prewarm, "PREWARM_PLAN_BATCH", 2)
    layout, chunks = full_blocks(BLOCK_BYTES)
    service = written_then_restarted(unique_name, str(tmp_path / "disk"), BLOCK_BYTES, chunks,
                                     layout)
    try:
        tier = service.spill_tier("disk")
        state = tier._prewarm
        greeted(service, layout)
        assert state.visited == 2 and tier.prewarm_info()["disk_prewarm_pending"] == 2
        assert not tier.prewarm_pump() and state.visited == 4 and state.in_flight is None
        assert tier.prewarm_pump() and state.visited == 6  # the walk is over: reads start

        def done() -> bool:
            tier.prewarm_pump()
            return tier.prewarm_info()["disk_prewarm_state"] == "done"
        settle(service, done)
        assert tier.prewarm_info()["disk_prewarm_chunks"] == len(chunks)
        assert state.visited == len(chunks)
        prefix = chunk_prefix(1)
        assert [key for key, _ in service.pool.lru_values(100)] == \
            [prefix + h for _, h, _ in chunks]
        assert_nothing_held(service)
    finally:
        close_disk_service(service)
