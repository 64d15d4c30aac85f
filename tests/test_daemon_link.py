"""DaemonLink.fill_and_commit: a failed fill never leaves a readable or a stuck record."""

import pytest

from lmcached.client.daemon_link import DaemonLink
from lmcached.client.layout import KVLayout
from lmcached.protocol import Alloc, Connection, Info, Lookup

LAYOUT = KVLayout("link-test", num_layers=2, num_kv_heads=2, head_size=16, dtype="float16",
                  chunk_size=16)
HASHES = [bytes([i]) * 16 for i in range(1, 4)]


def alloc(link: DaemonLink) -> tuple[list[int], int]:
    hello = link.ensure_connected()
    reply = link.request(Alloc(hello.namespaces[0], b"".join(HASHES), [4096] * len(HASHES)))
    return list(reply.block_ids), hello.generation


def num_ready(link: DaemonLink) -> int:
    return link.request(Lookup(link.hello_reply.namespaces, b"".join(HASHES))).num_chunks


def writing_blocks(socket: str) -> int:
    with Connection(socket) as conn:
        return conn.request(Info("blocks")).sections["blocks"]["writing_blocks"]


def test_a_fill_that_raises_aborts_the_blocks_and_reraises(daemon):
    link = DaemonLink(daemon.socket, layouts=[LAYOUT.to_wire()])
    try:
        block_ids, generation = alloc(link)
        assert block_ids and writing_blocks(daemon.socket) == len(block_ids)

        def broken_fill() -> None:
            raise RuntimeError("copy failed half way")

        with pytest.raises(RuntimeError, match="half way"):
            link.fill_and_commit(block_ids, generation, broken_fill)
        assert writing_blocks(daemon.socket) == 0  # aborted, back in the free queue
        assert num_ready(link) == 0  # nothing half-written is readable

        block_ids, generation = alloc(link)  # the same chunks can be stored again
        filled = []
        assert link.fill_and_commit(block_ids, generation, lambda: filled.append(1)) is True
        assert filled == [1] and num_ready(link) == len(HASHES)
    finally:
        link.close()


def test_a_commit_into_another_generation_is_not_sent(daemon):
    link = DaemonLink(daemon.socket, layouts=[LAYOUT.to_wire()])
    try:
        block_ids, generation = alloc(link)
        assert link.fill_and_commit(block_ids, generation + 1, lambda: None) is False
    finally:
        link.close()
