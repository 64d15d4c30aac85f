"""Salted chains through L2: a daemon verifies a fetched chain from the parent hash the
client sends (LOOKUP / ACQUIRE `parent`), so a tenant's chunks (their chain starts at
`root_hash(salt)`) and a run read from mid-chain come back from L2 on another node,
bit-exact; the daemon never learns the salt (docs/l2.md)."""

import numpy as np
import pytest
import torch

from engine_worker import prompt_kv, small_layout
from test_l2_daemon import ARENA, FETCH_WAIT, wait_written
from lmcached.client import CacheEngine

pytestmark = pytest.mark.slow

NUM_TOKENS = 100  # 7 chunks of 16
NUM_CHUNKS = 7


def engine(daemon) -> CacheEngine:
    # 10 s for a reply: the daemon waits up to 5 s for a fetch (FETCH_WAIT).
    return CacheEngine.connect(small_layout(), socket=daemon.socket, strict=True,
                               data_timeout_s=10.0)


def test_a_salted_prompt_comes_back_from_l2_on_another_node(redis_server, daemon_factory):
    node_a = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    node_b = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    tokens = np.arange(NUM_TOKENS)
    kv = prompt_kv(small_layout(), list(range(NUM_TOKENS)))
    with engine(node_a) as writer:
        assert writer.store(tokens, kv, cache_salt="tenant-a") == NUM_CHUNKS
    wait_written(node_a, NUM_CHUNKS)
    with engine(node_b) as reader:
        got, mask = reader.retrieve(tokens, return_tuple=False, cache_salt="tenant-a")
        assert bool(mask.all()) and torch.equal(got, kv)
    info = node_b.info()
    assert info["l2_fetch_hit_chunks"] == NUM_CHUNKS
    assert not [k for k, v in info.items() if k.startswith("l2_fetch_verify_") and v]
    assert info["salted_hits"] == NUM_CHUNKS and info["pinned_blocks"] == 0


def test_another_salt_fetches_nothing_of_a_salted_prompt(redis_server, daemon_factory):
    node_a = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    node_b = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    tokens = np.arange(NUM_TOKENS)
    with engine(node_a) as writer:
        writer.store(tokens, prompt_kv(small_layout(), list(range(NUM_TOKENS))),
                     cache_salt="tenant-a")
    wait_written(node_a, NUM_CHUNKS)
    with engine(node_b) as reader:
        for salt in ("tenant-b", None):
            _, mask = reader.retrieve(tokens, cache_salt=salt)
            assert not bool(mask.any())
    assert node_b.info()["l2_fetch_hit_chunks"] == 0


def test_a_run_from_mid_chain_is_verified_from_the_chunk_before_it(redis_server,
                                                                  daemon_factory):
    node_a = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    node_b = daemon_factory(*ARENA, "--l2", redis_server.url, *FETCH_WAIT)
    tokens = np.arange(NUM_TOKENS)
    kv = prompt_kv(small_layout(), list(range(NUM_TOKENS)))
    with engine(node_a) as writer:
        writer.store(tokens, kv, cache_salt="tenant-a")
    wait_written(node_a, NUM_CHUNKS)
    mask = torch.ones(NUM_TOKENS, dtype=torch.bool)
    mask[:48] = False  # chunks 3..6: the ACQUIRE starts mid-chain
    with engine(node_b) as reader:
        got, ret_mask = reader.retrieve(tokens, mask=mask, return_tuple=False,
                                        cache_salt="tenant-a")
    assert ret_mask.tolist() == mask.tolist()
    assert torch.equal(got, kv.narrow(small_layout().token_dim, 48, NUM_TOKENS - 48))
    assert node_b.info()["l2_fetch_hit_chunks"] == NUM_CHUNKS - 3
