"""Real processes sharing one daemon: cross-process hits, isolation, stress, daemon loss."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import start_daemon
from engine_worker import prompt_kv, small_layout
from test_hashing import GOLDEN
from lmcached.client import CacheEngine
from lmcached.shm.janitor import list_segments

WORKER = os.path.join(os.path.dirname(__file__), os.pardir, "engine_worker.py")


def run_worker(*args, env=None, timeout_s: float = 120) -> dict:
    proc = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_one_process_stores_two_others_retrieve_the_same_bytes(daemon):
    assert run_worker("store", daemon.socket, 0, 100, 0, 1) == {"stored": 7}
    for _ in range(2):  # processes B and C
        assert run_worker("retrieve", daemon.socket, 0, 100, 0, 1) == {"hit": 100, "mismatches": 0}
    fields = daemon.info()
    assert fields["hits"] == 14 and fields["stores"] == 7


@pytest.mark.slow
def test_another_tensor_parallel_rank_never_sees_the_chunks(daemon):
    run_worker("store", daemon.socket, 0, 64, 0, 2)  # rank 0 of 2
    assert run_worker("retrieve", daemon.socket, 0, 64, 1, 2)["hit"] == 0  # rank 1
    assert run_worker("retrieve", daemon.socket, 0, 64, 0, 1)["hit"] == 0  # world size 1
    assert run_worker("retrieve", daemon.socket, 0, 64, 0, 2)["hit"] == 64


# Hashes every case of the golden table in a fresh interpreter: {case: [hex digest, ...]}.
HASH_GOLDEN_CASES = textwrap.dedent("""
    import json, sys
    from lmcached.client import hash_request_tokens
    cases = json.load(sys.stdin)
    print(json.dumps({name: [h.hex() for h in hash_request_tokens(chunk_size, tokens)]
                      for name, (chunk_size, tokens) in cases.items()}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("hash_seed", ["1", "2"])
def test_hashes_in_other_processes_are_the_golden_digests(hash_seed):
    # Python's str/bytes hash is salted per process (PYTHONHASHSEED): chunk keys must not
    # depend on it, so each child must produce tests/wire/test_hashing.py's literal digests.
    cases = {name: (chunk_size, tokens) for name, (chunk_size, tokens, _) in GOLDEN.items()}
    proc = subprocess.run([sys.executable, "-c", HASH_GOLDEN_CASES], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONHASHSEED": hash_seed})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {name: digests for name, (_, _, digests) in GOLDEN.items()}


@pytest.mark.slow
def test_stress_four_processes_small_arena_every_byte_checked(daemon_factory):
    # 1 MiB arena of 8 KiB blocks (127 blocks) for prompts of up to 12 chunks: constant eviction.
    daemon = daemon_factory("--capacity", "1MiB", "--block-size", "8KiB")
    procs = [
        subprocess.Popen([sys.executable, WORKER, "stress", daemon.socket, str(seed), "8"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for seed in range(4)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert sum(r["mismatches"] for r in results) == 0
    assert sum(r["retrieves"] + r["views"] for r in results) > 40
    assert sum(r["hit_tokens"] for r in results) > 0
    fields = daemon.info()
    assert fields["evictions"] > 0
    assert fields["pinned_blocks"] == 0 and fields["writing_blocks"] == 0
    assert fields["errors"] == 0


@pytest.mark.slow
def test_daemon_killed_mid_run_means_misses_then_hits_after_restart(unique_name, short_tmp):
    socket = os.path.join(short_tmp, "d.sock")
    args = ("--capacity", "16MiB")
    first = start_daemon(unique_name, socket, os.path.join(short_tmp, "1.log"), *args)
    second = None
    layout = small_layout()
    tokens = list(range(64))
    kv = prompt_kv(layout, tokens)
    engine = CacheEngine.connect(layout, socket=socket, strict=True)
    try:
        assert engine.store(tokens, kv) == 4
        old_generation = engine.link.generation
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
        # The daemon is gone: misses and skipped stores, no exception.
        got, ret_mask = engine.retrieve(tokens)
        assert got == () and not ret_mask.any()
        assert engine.store(tokens, kv) == 0
        assert engine.lookup(tokens) == 0
        assert list_segments(unique_name)  # SIGKILL left the segment: the restart sweeps it
        second = start_daemon(unique_name, socket, os.path.join(short_tmp, "2.log"), *args)
        assert "removed orphaned arena segment" in second.log()
        deadline = time.monotonic() + 15
        while engine.store(tokens, kv) == 0:  # reconnects after its backoff
            assert time.monotonic() < deadline, "engine did not reconnect"
            time.sleep(0.1)
        assert engine.link.generation != old_generation
        got, ret_mask = engine.retrieve(tokens, return_tuple=False)
        assert bool(ret_mask.all()) and torch.equal(got, kv)
        assert engine.link.num_reconnects == 1
    finally:
        engine.close()
        first.stop()
        if second is not None:
            second.stop()
    assert list_segments(unique_name) == []
