"""FreeKVCacheBlockQueue: exact orders, O(1) removal, sentinels (after vLLM's tests)."""

import pytest

from lmcached.daemon.free_queue import FreeKVCacheBlockQueue, KVCacheBlock


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def make_queue(n: int):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_initial_order_is_block_order():
    _, queue = make_queue(5)
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert queue.num_free_blocks == 5


def test_popleft_returns_front_and_unlinks():
    blocks, queue = make_queue(3)
    block = queue.popleft()
    assert block is blocks[0]
    assert block.prev_free_block is None and block.next_free_block is None
    assert ids(queue) == [1, 2]
    assert queue.num_free_blocks == 2


def test_remove_from_middle_keeps_neighbours_linked():
    blocks, queue = make_queue(5)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]


def test_append_goes_back_appendleft_goes_front():
    blocks, queue = make_queue(3)
    first = queue.popleft()
    last = queue.popleft()
    queue.append(first)
    queue.appendleft(last)
    assert ids(queue) == [1, 2, 0]
    assert queue.num_free_blocks == 3


def test_popleft_on_empty_queue_raises():
    _, queue = make_queue(1)
    queue.popleft()
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()


def test_remove_of_block_not_in_queue_is_a_bug():
    blocks, queue = make_queue(2)
    queue.remove(blocks[0])
    with pytest.raises(AssertionError, match="bug"):
        queue.remove(blocks[0])


def test_empty_queue_then_refill():
    blocks, queue = make_queue(2)
    queue.popleft()
    queue.popleft()
    assert ids(queue) == []
    queue.append(blocks[1])
    assert ids(queue) == [1]
    assert queue.popleft() is blocks[1]


def test_popleft_n_returns_the_front_in_order_and_unlinks():
    blocks, queue = make_queue(5)
    taken = queue.popleft_n(3)
    assert [b.block_id for b in taken] == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in taken)
    assert ids(queue) == [3, 4]
    assert blocks[3].prev_free_block is queue.fake_head
    assert queue.num_free_blocks == 2
    assert [b.block_id for b in queue.popleft_n(2)] == [3, 4]
    assert ids(queue) == [] and queue.num_free_blocks == 0
    queue.append(blocks[1])  # the sentinels were relinked to each other
    assert ids(queue) == [1]


def test_popleft_n_of_zero_takes_nothing():
    _, queue = make_queue(2)
    assert queue.popleft_n(0) == []
    assert ids(queue) == [0, 1] and queue.num_free_blocks == 2


@pytest.mark.parametrize("n", [3, -1])
def test_popleft_n_beyond_the_queue_raises_and_changes_nothing(n):
    _, queue = make_queue(2)
    with pytest.raises(ValueError, match="holds 2"):
        queue.popleft_n(n)
    assert ids(queue) == [0, 1] and queue.num_free_blocks == 2


def test_append_n_puts_blocks_at_the_back_in_their_order():
    blocks, queue = make_queue(5)
    taken = queue.popleft_n(3)
    queue.append_n([taken[2], taken[0]])
    assert ids(queue) == [3, 4, 2, 0]
    assert queue.fake_tail.prev_free_block is blocks[0]
    assert queue.num_free_blocks == 4
    queue.append_n([])
    assert ids(queue) == [3, 4, 2, 0] and queue.num_free_blocks == 4


def test_prepend_n_puts_blocks_at_the_front_in_their_order():
    blocks, queue = make_queue(5)
    taken = queue.popleft_n(3)
    queue.prepend_n([taken[2], taken[0]])
    assert ids(queue) == [2, 0, 3, 4]
    assert blocks[0].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[0]
    assert queue.num_free_blocks == 4
    queue.prepend_n([])
    assert ids(queue) == [2, 0, 3, 4] and queue.num_free_blocks == 4


def test_prepend_n_undoes_popleft_n():
    _, queue = make_queue(4)
    queue.append(queue.popleft())
    before = ids(queue)
    queue.prepend_n(queue.popleft_n(3))
    assert ids(queue) == before == [1, 2, 3, 0]
    assert queue.num_free_blocks == 4


def test_bulk_operations_on_an_empty_queue():
    blocks, queue = make_queue(3)
    queue.popleft_n(3)
    queue.append_n([blocks[1], blocks[2]])
    assert ids(queue) == [1, 2]
    queue.popleft_n(2)
    queue.prepend_n([blocks[2], blocks[0]])
    assert ids(queue) == [2, 0]
    assert queue.fake_tail.prev_free_block is blocks[0]
    assert queue.num_free_blocks == 2


def test_iteration_is_front_to_back():
    blocks, queue = make_queue(4)
    queue.remove(blocks[1])
    queue.appendleft(blocks[1])
    queue.append(queue.popleft_n(2)[1])
    assert [b.block_id for b in queue] == [2, 3, 0]
