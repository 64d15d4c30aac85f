"""The GPU tier on a real GPU (`lmcached serve --gpu-capacity ... --gpu-backend cuda`):
the daemon's CUDA VMM allocation is imported by other processes, stores from GPU
tensors land there, reads are views of it, a full tier demotes to the host arena by the
daemon's CUDA copies, a killed client's pins come back, and a process that cannot map
the tier falls back to the host arena. Skipped without a CUDA device and cuda-bindings.
The same logic runs in CI on fake tiers (tests/client/engine/test_tiered_engine.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lmcached.wire.connection import Connection
from lmcached.wire.protocol import PROTOCOL_VERSION, Hello

WORKER = os.path.join(os.path.dirname(__file__), os.pardir, "engine_worker.py")
CHUNK = 16


def _cuda_bindings() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return True


# Skipped per test, not per module, so that `pytest --collect-only -m cuda` (the GPU
# window's dry run, benchmarks/gpu_window.sh collect) lists these tests on any machine.
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (torch.cuda.is_available() and _cuda_bindings()),
                       reason="needs a CUDA device and cuda-bindings (pip install 'lmcached[gpu]')"),
]


def gpu_uuid(socket: str) -> str:
    with Connection(socket) as conn:
        return conn.request(Hello(PROTOCOL_VERSION, os.getpid(), "t")).tiers[1].device


def run_worker(*args, device: str | None, env_extra=None, timeout_s: float = 180) -> dict:
    env = {**os.environ, "LMCACHED_TEST_TIER_DEVICE": device or "",
           "LMCACHED_TEST_KV_DEVICE": "cuda", **(env_extra or {})}
    proc = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, proc.stderr
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


@pytest.fixture
def gpu_daemon(daemon_factory):
    """A 64 MiB arena and a 2 MiB GPU tier (rounded down to the VMM granularity) of
    64 KiB blocks."""
    return daemon_factory("--capacity", "64MiB", "--block-size", "64KiB",
                          "--gpu-capacity", "2MiB", "--gpu-backend", "cuda")


def test_g1_g2_another_process_reads_the_gpu_tier_in_place(gpu_daemon):
    uuid = gpu_uuid(gpu_daemon.socket)
    assert run_worker("store", gpu_daemon.socket, 0, 8 * CHUNK, 0, 1, device=uuid)["stored"] == 8
    info = gpu_daemon.info()
    assert info["tier1_kind"] == "cuda" and info["tier1_cached_blocks"] == 8
    views = run_worker("views", gpu_daemon.socket, 0, 8 * CHUNK, device=uuid)
    assert (views["hit"], views["mismatches"], views["views_in_tier"], views["devices"]) == \
        (8 * CHUNK, 0, 8, ["cuda"])
    got = run_worker("retrieve", gpu_daemon.socket, 0, 8 * CHUNK, 0, 1, device=uuid)
    assert (got["hit"], got["mismatches"]) == (8 * CHUNK, 0)


def test_g3_a_full_gpu_tier_demotes_and_every_byte_reads_back(gpu_daemon):
    uuid = gpu_uuid(gpu_daemon.socket)
    prompts = [(p * 1000, 8 * CHUNK) for p in range(8)]  # 64 chunks for a ~31-chunk tier
    for start, length in prompts:
        assert run_worker("store", gpu_daemon.socket, start, length, 0, 1,
                          device=uuid)["stored"] == 8
    info = gpu_daemon.info()
    assert info["demotions"] > 0 and info["errors_demotion"] == 0
    assert info["tier1_state"] == "ok"
    for start, length in prompts:
        got = run_worker("retrieve", gpu_daemon.socket, start, length, 0, 1, device=uuid)
        assert (got["hit"], got["mismatches"]) == (length, 0)


def test_g5_a_killed_client_gives_its_gpu_pins_back(gpu_daemon):
    uuid = gpu_uuid(gpu_daemon.socket)
    run_worker("store", gpu_daemon.socket, 0, 4 * CHUNK, 0, 1, device=uuid)
    env = {**os.environ, "LMCACHED_TEST_TIER_DEVICE": uuid}
    holder = subprocess.Popen([sys.executable, WORKER, "hold", gpu_daemon.socket, "0",
                               str(4 * CHUNK)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert json.loads(holder.stdout.readline()) == {"pinned_chunks": 4}
        assert gpu_daemon.info()["tier1_pinned_blocks"] == 4
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.stdout.close()
    for _ in range(100):
        if gpu_daemon.info()["tier1_pinned_blocks"] == 0:
            break
    assert gpu_daemon.info()["tier1_pinned_blocks"] == 0


def test_g7_a_process_that_cannot_see_the_gpu_uses_the_host_arena(gpu_daemon):
    uuid = gpu_uuid(gpu_daemon.socket)
    env = {"CUDA_VISIBLE_DEVICES": "", "LMCACHED_TEST_KV_DEVICE": "cpu"}
    got = run_worker("store", gpu_daemon.socket, 0, 4 * CHUNK, 0, 1, device=uuid,
                     env_extra=env)
    assert got["stored"] == 4
    assert got["stderr"].count("not usable here") == 1
    info = gpu_daemon.info()
    assert (info["tier1_cached_blocks"], info["cached_blocks"]) == (0, 4)


def test_g6_views_outlive_a_killed_daemon_and_the_next_generation_is_mapped(
        gpu_daemon, short_tmp):
    from conftest import start_daemon
    from engine_worker import prompt_kv, small_layout
    from lmcached.client import CacheEngine
    from lmcached.client.daemon_link import CacheUnavailable

    uuid = gpu_uuid(gpu_daemon.socket)
    layout = small_layout()
    tokens = list(range(4 * CHUNK))
    expected = prompt_kv(layout, tokens).cuda()
    engine = CacheEngine.connect(layout, socket=gpu_daemon.socket, strict=True,
                                 tier_device=uuid)
    restarted = None
    try:
        assert engine.store(tokens, expected) == 4
        old_generation = engine.link.generation
        views = engine.retrieve_views(tokens)
        chunks = views.chunks
        assert all(c.device.type == "cuda" for c in chunks)
        gpu_daemon.proc.kill()
        gpu_daemon.proc.wait(30)
        # VMM memory lives while a mapping does: the views still read, no CUDA error.
        assert torch.equal(torch.cat(chunks, dim=layout.token_dim), expected)
        torch.cuda.synchronize()
        views.release()
        del chunks, views
        restarted = start_daemon(gpu_daemon.name, gpu_daemon.socket,
                                 os.path.join(short_tmp, "restarted.log"), "--capacity",
                                 "64MiB", "--block-size", "64KiB", "--gpu-capacity", "2MiB",
                                 "--gpu-backend", "cuda")
        for _ in range(200):  # past the link's back-off
            try:
                engine.link.ensure_connected()
                break
            except CacheUnavailable:
                time.sleep(0.05)
        assert engine.link.generation != old_generation
        assert engine.link.tiers[1].generation == engine.link.generation
        assert engine.store(tokens, expected) == 4
        kv, mask = engine.retrieve(tokens, return_tuple=False)
        assert int(mask.sum()) == len(tokens) and torch.equal(kv.cuda(), expected)
    finally:
        engine.close()
        if restarted is not None:
            restarted.stop()
