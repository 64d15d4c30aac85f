"""A pin is only as good as the daemon session that took it.

Engine A stores T1 (KV = 1.0) and pins it with `lookup(T1, pin=True)`. A's session then
ends before the retrieve -- the daemon drops it (`--idle-timeout`), or one of A's calls
times out while the daemon is stalled and the link reconnects -- so the daemon releases
A's pins, and engine B's stores (KV = 2.0) reuse every block of the arena. A's retrieve of
T1 must then be a miss or T1's own bytes, never B's: through `retrieve`,
`retrieve_views` and a CacheBlend task, with verify="tokens" and "checksum".
"""

import os
import signal
import time

import pytest
import torch

from engine_worker import small_layout
from lmcached.client import CacheEngine, PinsLost
from lmcached.client.blend import SPTBlendRetriever
from lmcached.wire.connection import Connection
from lmcached.wire.protocol import Clients

DEADLINE_S = 20.0
NUM_TOKENS = 64  # 4 chunks of 16
SEPARATOR = 999_999  # a token id no prompt here holds


def wait_for(predicate, what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def session_ids(socket: str) -> set[int]:
    with Connection(socket) as conn:
        return {row["id"] for row in conn.request(Clients()).clients}


def filled(layout, num_tokens: int, value: float) -> torch.Tensor:
    return torch.full(layout.chunk_shape(num_tokens), value, dtype=layout.torch_dtype)


def end_session(path: str, engine: CacheEngine, daemon) -> None:
    """End `engine`'s daemon session behind its back, the way `path` says."""
    session_id = engine.link.hello_reply.session_id
    if path == "idle_timeout":  # the daemon drops the quiet session
        wait_for(lambda: session_id not in session_ids(daemon.socket), "the idle timeout")
        return
    # "stalled": one call waits past the data-path timeout while the daemon is stopped;
    # the link drops its session and the daemon releases its pins once it runs again.
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        assert engine.lookup(list(range(10_000, 10_000 + NUM_TOKENS))) == 0
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    wait_for(lambda: session_id not in session_ids(daemon.socket), "the session's end")


def overwrite_arena(daemon, layout) -> None:
    """Engine B stores KV = 2.0 under other prompts until every block was reused."""
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as other:
        num_blocks = other.link.hello_reply.num_blocks
        for i in range(2 * num_blocks // (NUM_TOKENS // layout.chunk_size) + 2):
            tokens = list(range(100_000 + i * NUM_TOKENS, 100_000 + (i + 1) * NUM_TOKENS))
            other.store(tokens, filled(layout, NUM_TOKENS, 2.0))
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as probe:
        assert probe.lookup(list(range(NUM_TOKENS))) == 0, "T1 was not evicted: no reuse"


def read_t1(how: str, engine: CacheEngine, tokens: list[int]) -> tuple[torch.Tensor, int]:
    """(KV of the tokens served, number of tokens served) through one read path."""
    layout = engine.layout
    if how == "retrieve":
        kv, ret_mask = engine.retrieve(tokens, return_tuple=False)
        return kv, int(ret_mask.sum())
    if how == "views":
        with engine.retrieve_views(tokens) as views:
            if not views.num_tokens:
                return None, 0
            kv = torch.cat([c.clone() for c in views.chunks], dim=layout.token_dim)
            assert views.pins_held(), "views served from pins that no longer hold"
            return kv, views.num_tokens
    retriever = SPTBlendRetriever(SEPARATOR, engine)
    with retriever.new_request(tokens, [0, len(tokens)]) as task:
        num_valid = int(task.valid_mask.sum())
        if not num_valid:
            return None, 0
        result = task.result(0)  # [T, H, D] (vllm layout), layer 0
        return result.k[:num_valid], num_valid


@pytest.mark.slow
@pytest.mark.parametrize("verify", ["tokens", "checksum"])
@pytest.mark.parametrize("how", ["retrieve", "views", "blend"])
@pytest.mark.parametrize("path", ["idle_timeout", "stalled"])
def test_a_pinned_lookup_whose_session_ended_never_serves_another_prompts_kv(
        daemon_factory, path, how, verify):
    args = ["--capacity", "4MiB"]
    if path == "idle_timeout":
        args += ["--idle-timeout", "1"]
    daemon = daemon_factory(*args)
    layout = small_layout()
    t1 = list(range(NUM_TOKENS))
    engine = CacheEngine.connect(layout, socket=daemon.socket, strict=True, verify=verify)
    try:
        assert engine.store(t1, filled(layout, NUM_TOKENS, 1.0)) == NUM_TOKENS // layout.chunk_size
        assert engine.lookup(t1, pin=True) == NUM_TOKENS
        end_session(path, engine, daemon)
        overwrite_arena(daemon, layout)

        kv, num_served = read_t1(how, engine, t1)

        if num_served:  # only T1's own bytes may come back
            assert torch.equal(kv, torch.ones_like(kv)), "served another prompt's KV"
        assert num_served == 0  # T1 was evicted: the only right answer is a miss
        assert engine.num_stale_pins == 1
    finally:
        engine.close()
    wait_for(lambda: daemon.pins_held() == 0, "no pins left")


@pytest.mark.slow
def test_a_blend_task_whose_session_ends_between_layers_raises_pins_lost(daemon_factory):
    daemon = daemon_factory("--capacity", "4MiB")
    layout = small_layout()
    t1 = list(range(NUM_TOKENS))
    engine = CacheEngine.connect(layout, socket=daemon.socket, strict=True)
    try:
        engine.store(t1, filled(layout, NUM_TOKENS, 1.0))
        with SPTBlendRetriever(SEPARATOR, engine).new_request(t1, [0, NUM_TOKENS]) as task:
            assert torch.equal(task.result(0).k, torch.ones_like(task.result(0).k))
            end_session("stalled", engine, daemon)
            overwrite_arena(daemon, layout)
            with pytest.raises(PinsLost):
                task.result(1)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_retrieve_whose_session_ends_during_the_copy_is_a_miss(daemon_factory, monkeypatch):
    """The check after the copy: the session ends while the bytes are copied out."""
    daemon = daemon_factory("--capacity", "4MiB")
    layout = small_layout()
    t1 = list(range(NUM_TOKENS))
    engine = CacheEngine.connect(layout, socket=daemon.socket, strict=True)
    try:
        engine.store(t1, filled(layout, NUM_TOKENS, 1.0))
        import lmcached.client.engine_retrieve as engine_module  # retrieve's copies out

        copy = engine_module.copy_records_out

        def copy_then_lose_the_session(*args, **kwargs):
            out = copy(*args, **kwargs)
            engine.link.mark_down("test: the session ends during the copy")
            return out

        monkeypatch.setattr(engine_module, "copy_records_out", copy_then_lose_the_session)
        kv, ret_mask = engine.retrieve(t1)
        assert kv == () and not ret_mask.any()
        assert engine.num_stale_pins == 1
    finally:
        engine.close()
    wait_for(lambda: daemon.pins_held() == 0, "no pins left")
