"""BlockPool: exact free-queue orders for scripted sequences, and a stateful model test.

The scripted tests follow vLLM's tests/v1/core tests: they assert the list of block ids
in the free queue after each step.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcached.daemon.block_pool import BlockPool
from lmcached.daemon.free_queue import BlockState
from lmcached.wire.record_format import ROOT_HASH


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def block_ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def store(pool: BlockPool, key, num_blocks: int = 1):
    """Allocate, commit and free one value, as a writer session does."""
    blocks = pool.allocate(num_blocks)
    assert pool.commit(blocks, key)
    pool.free(blocks)
    return blocks


def test_allocate_hands_out_empty_blocks_in_order():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert block_ids(blocks) == [0, 1]
    assert all(b.state == BlockState.WRITING and b.ref_cnt == 1 for b in blocks)
    assert queue_ids(pool) == [2, 3]
    pool.check_invariants()


def test_free_appends_a_chain_tail_first():
    pool = BlockPool(4)
    chain = pool.allocate(3)
    for i, block in enumerate(chain):
        assert pool.commit([block], ("ns", i))
    pool.free(chain)
    assert queue_ids(pool) == [3, 2, 1, 0]
    pool.check_invariants()


def test_allocate_evicts_the_least_recently_used_value():
    pool = BlockPool(4)
    chain = pool.allocate(3)
    for i, block in enumerate(chain):
        pool.commit([block], i)
    pool.free(chain)
    blocks = pool.allocate(2)
    assert block_ids(blocks) == [3, 2]  # the empty block, then the chain's tail
    assert pool.get_cached(2) is None
    assert pool.get_cached(1) is not None
    assert pool.stats.evictions == 1
    assert queue_ids(pool) == [1, 0]
    pool.check_invariants()


def test_touch_takes_a_cached_block_out_of_the_queue():
    pool = BlockPool(3)
    store(pool, "a")
    store(pool, "b")
    assert queue_ids(pool) == [2, 0, 1]
    pool.touch(pool.get_cached("a"))
    assert queue_ids(pool) == [2, 1]
    assert pool.num_pinned_blocks == 1
    pool.free(pool.get_cached("a"))
    assert queue_ids(pool) == [2, 1, 0]  # "a" is now the most recently used
    pool.check_invariants()


def test_pinned_and_writing_blocks_are_never_handed_out():
    pool = BlockPool(3)
    store(pool, "a")
    pool.touch(pool.get_cached("a"))
    writing = pool.allocate(1)
    assert pool.allocate(2) is None
    assert queue_ids(pool) == [2]  # a failed allocate changes nothing
    last = pool.allocate(1)
    assert block_ids(last) == [2]
    assert pool.allocate(1) is None
    assert block_ids(writing) == [1]
    pool.check_invariants()


def test_abort_returns_blocks_to_the_front():
    pool = BlockPool(3)
    store(pool, "a")
    blocks = pool.allocate(2)
    assert block_ids(blocks) == [1, 2]
    pool.abort(blocks)
    assert queue_ids(pool) == [1, 2, 0]
    assert all(b.state == BlockState.FREE and b.ref_cnt == 0 for b in blocks)
    pool.check_invariants()


def test_a_multi_block_value_is_evicted_together():
    pool = BlockPool(4)
    span = store(pool, "big", num_blocks=2)
    assert block_ids(span) == [0, 1]
    assert queue_ids(pool) == [2, 3, 1, 0]
    blocks = pool.allocate(3)
    # Popping block 1 evicts "big": block 0 leaves the queue's back for its front.
    assert block_ids(blocks) == [2, 3, 1]
    assert queue_ids(pool) == [0]
    assert pool.get_cached("big") is None
    assert pool.stats.evictions == 1
    assert pool.num_cached_blocks == 0
    pool.check_invariants()


def test_evicting_a_multi_block_value_hands_out_its_other_blocks_next():
    pool = BlockPool(4)
    big, small = pool.allocate(2), pool.allocate(2)
    assert pool.commit(big, "big")
    assert pool.commit(small[:1], "x") and pool.commit(small[1:], "y")
    for block_id in (1, 2, 0, 3):  # interleave "big" with "x" in the queue
        pool.free([pool.blocks[block_id]])
    assert queue_ids(pool) == [1, 2, 0, 3]
    blocks = pool.allocate(2)
    # Popping block 1 evicts "big"; its block 0 comes next, so "x" survives.
    assert block_ids(blocks) == [1, 0]
    assert queue_ids(pool) == [2, 3]
    assert pool.get_cached("x") is not None and pool.get_cached("big") is None
    assert pool.stats.evictions == 1
    pool.check_invariants()


def test_acquire_prefix_pins_the_cached_prefix_and_counts():
    pool = BlockPool(4)
    for key in ("h0", "h1", "h3"):
        store(pool, key)
    spans = pool.acquire_prefix(["h0", "h1", "h2", "h3"])
    assert [block_ids(s) for s in spans] == [[0], [1]]
    assert (pool.stats.hits, pool.stats.misses) == (2, 2)
    assert all(s[0].ref_cnt == 1 for s in spans)
    assert pool.num_ready_prefix(["h0", "h1", "h2"]) == 2
    pool.check_invariants()


def test_commit_of_an_existing_key_is_refused_unless_replacing():
    pool = BlockPool(4)
    old = store(pool, "k")
    pool.touch(old)  # a reader pins the old value
    new = pool.allocate(1)
    assert pool.commit(new, "k") is False
    assert new[0].state == BlockState.WRITING
    assert pool.commit(new, "k", replace=True) is True
    assert pool.get_cached("k") == new
    assert old[0].block_hash is None and old[0].ref_cnt == 1  # reader keeps its bytes
    pool.free(old)
    assert old[0].state == BlockState.FREE
    assert queue_ids(pool)[0] == old[0].block_id
    assert pool.stats.evictions == 0
    pool.check_invariants()


def test_evict_of_a_pinned_value_detaches_it_until_freed():
    pool = BlockPool(2)
    blocks = store(pool, "k")
    pool.touch(blocks)
    assert pool.evict("k") is True
    assert pool.get_cached("k") is None
    assert pool.num_detached_blocks == 1
    assert queue_ids(pool) == [1]
    pool.free(blocks)
    assert queue_ids(pool) == [0, 1]
    assert pool.evict("k") is False
    pool.check_invariants()


def test_values_are_counted_by_group_and_an_emptied_group_is_reported():
    """The daemon counts values per namespace (`group_of`): every way a value enters or
    leaves the index keeps the counts, and the last value of a group leaving calls
    `on_group_empty` once."""
    pool = BlockPool(4)
    emptied = []
    pool.ledger.group_of = lambda key: key[0]
    pool.ledger.on_group_empty = emptied.append
    store(pool, ("a", 1))
    store(pool, ("a", 2), num_blocks=2)
    store(pool, ("b", 1))
    assert pool.ledger.num_values_by_group == {"a": 2, "b": 1}
    replacement = pool.allocate(1)  # evicts ("a", 1), the least recently used
    assert pool.ledger.num_values_by_group == {"a": 1, "b": 1} and emptied == []
    pool.commit(replacement, ("b", 1), replace=True)  # a replacement: b stays counted
    pool.free(replacement)
    assert pool.ledger.num_values_by_group == {"a": 1, "b": 1}
    reader = pool.acquire_prefix([("a", 2)])[0]  # pinned: evicted later, detached
    assert pool.evict(("a", 2)) and emptied == ["a"]
    pool.free(reader)
    assert pool.clear() == 1 and emptied == ["a", "b"]
    assert pool.ledger.num_values_by_group == {}
    pool.check_invariants()


def test_evict_lru_spares_pinned_values_and_clear_detaches_them():
    pool = BlockPool(4)
    for key in "abcd":
        store(pool, key)
    reader = pool.get_cached("a")
    pool.touch(reader)
    assert pool.evict_lru(2) == 2
    assert pool.get_cached("b") is None and pool.get_cached("c") is None
    assert pool.clear_generation == 0
    assert pool.clear() == 2  # "d", and "a" although pinned: found by no one from now on
    assert pool.get_cached("a") is None and pool.clear_generation == 1
    assert pool.num_detached_blocks == 1 and reader[0].state == BlockState.READY
    pool.free(reader)  # its reader is done: the block becomes empty
    assert pool.num_free_blocks == 4 and pool.num_detached_blocks == 0
    assert pool.stats.evictions == 4
    pool.check_invariants()


@pytest.mark.parametrize(
    "call",
    [
        lambda pool, blocks: pool.free(blocks),
        lambda pool, blocks: pool.touch(blocks),
    ],
    ids=["free", "touch"],
)
def test_misuse_of_writing_blocks_raises_value_error(call):
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    with pytest.raises(ValueError, match="WRITING|READY"):
        call(pool, blocks)
    pool.check_invariants()


def test_commit_of_a_ready_block_raises_value_error():
    pool = BlockPool(2)
    blocks = store(pool, "k")
    with pytest.raises(ValueError, match="only blocks from allocate"):
        pool.commit(blocks, "other")
    with pytest.raises(ValueError, match="abort"):
        pool.abort(blocks)
    with pytest.raises(ValueError, match="num_blocks"):
        pool.allocate(0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


# ---------------------------------------------------------------- stateful model test
NUM_BLOCKS = 8
KEYS = st.integers(min_value=0, max_value=5)


class BlockPoolMachine(RuleBasedStateMachine):
    """Random operations against a list-based reference model of the same semantics.

    The model keeps the free queue as a plain list, so every step checks the exact
    eviction order, the returned block ids, and that no held block is handed out.
    """

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.queue = list(range(NUM_BLOCKS))
        self.ref = [0] * NUM_BLOCKS
        self.hash_of: list = [None] * NUM_BLOCKS
        self.index: dict = {}
        self.writing: list[list[int]] = []
        self.pins: list[list[int]] = []

    # model helpers -------------------------------------------------------------
    def _model_unindex(self, key):
        for b in self.index.pop(key):
            if self.ref[b] == 0:
                self.queue.remove(b)
                self.queue.insert(0, b)
            self.hash_of[b] = None

    def _blocks(self, ids_):
        return [self.pool.blocks[i] for i in ids_]

    # rules ------------------------------------------------------------------------
    @rule(n=st.integers(min_value=1, max_value=3))
    def allocate(self, n):
        got = self.pool.allocate(n)
        if n > len(self.queue):
            assert got is None
            return
        expected = []
        for _ in range(n):
            b = self.queue.pop(0)
            if self.hash_of[b] is not None:
                for o in self.index.pop(self.hash_of[b]):
                    if o != b:
                        self.queue.remove(o)
                        self.queue.insert(0, o)
                        self.hash_of[o] = None
                self.hash_of[b] = None
            assert self.ref[b] == 0, "a held block was handed out"
            self.ref[b] = 1
            expected.append(b)
        assert block_ids(got) == expected
        for block in got:  # as the daemon does: bytes of the value in each block
            block.num_bytes = 100 + block.block_id
        self.writing.append(expected)

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), key=KEYS, replace=st.booleans())
    def commit(self, data, key, replace):
        handle = data.draw(st.sampled_from(self.writing))
        ok = self.pool.commit(self._blocks(handle), key, replace=replace)
        if key in self.index and not replace:
            assert ok is False
            return
        assert ok is True
        if key in self.index:
            self._model_unindex(key)
        self.writing.remove(handle)
        self.index[key] = handle
        for b in handle:
            self.hash_of[b] = key
        self.pins.append(handle)

    @precondition(lambda self: self.writing)
    @rule(data=st.data())
    def abort(self, data):
        handle = data.draw(st.sampled_from(self.writing))
        self.pool.abort(self._blocks(handle))
        self.writing.remove(handle)
        for b in reversed(handle):
            self.ref[b] = 0
            self.hash_of[b] = None
            self.queue.insert(0, b)

    @rule(keys=st.lists(KEYS, max_size=4))
    def acquire(self, keys):
        spans = self.pool.acquire_prefix(keys)
        expected = []
        for key in keys:
            if key not in self.index:
                break
            span = self.index[key]
            for b in span:
                if self.ref[b] == 0:
                    self.queue.remove(b)
                self.ref[b] += 1
            expected.append(span)
        assert [block_ids(s) for s in spans] == expected
        self.pins.extend(expected)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def free(self, data):
        count = data.draw(st.integers(min_value=1, max_value=len(self.pins)))
        chosen = self.pins[:count]
        del self.pins[:count]
        flat = [b for span in chosen for b in span]
        self.pool.free(self._blocks(flat))
        for b in reversed(flat):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of[b] is None:
                    self.queue.insert(0, b)
                else:
                    self.queue.append(b)

    @rule(key=KEYS)
    def evict(self, key):
        assert self.pool.evict(key) == (key in self.index)
        if key in self.index:
            self._model_unindex(key)

    @rule(n=st.integers(min_value=0, max_value=3))
    def evict_lru(self, n):
        victims = []
        for b in self.queue:
            if len(victims) == n:
                break
            if self.hash_of[b] is not None and self.hash_of[b] not in victims:
                victims.append(self.hash_of[b])
        assert self.pool.evict_lru(n) == len(victims)
        for key in victims:
            self._model_unindex(key)

    @rule()
    def clear(self):
        victims = list(self.index)
        assert self.pool.clear() == len(victims)
        for key in victims:
            self._model_unindex(key)

    @invariant()
    def matches_model(self):
        self.pool.check_invariants()
        assert queue_ids(self.pool) == self.queue
        assert [b.ref_cnt for b in self.pool.blocks] == self.ref
        assert {k: block_ids(v) for k, v in self.pool.cached.items()} == self.index


TestBlockPoolStateful = BlockPoolMachine.TestCase
TestBlockPoolStateful.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_commit_many_validates_everything_before_committing_anything():
    pool = BlockPool(3)
    writing = pool.allocate(2)
    ready = store(pool, "old")
    with pytest.raises(ValueError, match="WRITING"):
        pool.commit_many([[writing[0]], ready], ["a", "b"])
    assert writing[0].state == BlockState.WRITING and pool.get_cached("a") is None
    assert pool.commit_many([[writing[0]], [writing[1]]], ["a", "old"]) == [True, False]
    pool.check_invariants()


class RecordingFeed:
    """Stands in for the daemon's event feed: the stored and removed calls, in order."""

    def __init__(self) -> None:
        self.calls = []

    def stored(self, key, parent, block_id) -> None:
        self.calls.append(("stored", key, parent, block_id))

    def removed(self, key) -> None:
        self.calls.append(("removed", key))


def test_commit_announces_each_value_it_indexes_in_order_and_keeps_its_parent():
    """Whatever commits (one value or many) announces what it indexed, with its parent
    (ROOT_HASH spelled b""), in the values' order; a refused value announces nothing."""
    pool = BlockPool(8)
    pool.ledger.events = feed = RecordingFeed()
    a, b, c = pool.allocate(1), pool.allocate(2), pool.allocate(1)
    assert pool.commit_many([a, b], [b"ka", b"kb"], parents=[ROOT_HASH, b"pa"]) == [True, True]
    assert pool.commit(c, b"ka") is False  # already cached: not indexed, not announced
    pool.abort(c)
    d = pool.allocate(1)
    assert pool.commit(d, b"kd")  # no parent named
    assert feed.calls == [("stored", b"ka", b"", a[0].block_id),
                          ("stored", b"kb", b"pa", b[0].block_id),
                          ("stored", b"kd", b"", d[0].block_id)]
    assert pool.ledger.parents == {b"kb": b"pa"}
    e = pool.allocate(1)
    with pytest.raises(ValueError, match="1 spans but 2 parents"):
        pool.commit_many([e], [b"ke"], parents=[b"", b""])
    assert b"ke" not in pool.cached and len(feed.calls) == 3
    pool.abort(e)
    pool.check_invariants()
