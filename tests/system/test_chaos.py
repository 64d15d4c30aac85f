"""Chaos: clients killed at every protocol step, torn-read stress, daemon killed under load.

Real processes only (tests/engine_worker.py). After every fault the daemon must get back
to a clean state by itself, which the tests read from INFO with a deadline:

    pinned_blocks == 0, writing_blocks == 0, detached_blocks == 0,
    evictable_blocks == cached_blocks (every cached block is unpinned, in the LRU queue),
    free_blocks + cached_blocks == num_blocks,

and no reader is ever served bytes other than the KV of its tokens (every chunk's KV is
a deterministic function of its prefix hash, so any process can check every byte).
"""

import json
import os
import selectors
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import start_daemon
from engine_worker import STEP_TOKENS, STEPS, prompt_kv, small_layout
from lmcached.client import CacheEngine
from lmcached.shm.janitor import list_segments

WORKER = os.path.join(os.path.dirname(__file__), os.pardir, "engine_worker.py")
CLEAN_DEADLINE_S = 10.0
STEP_DEADLINE_S = 60.0  # a worker imports torch first: seconds on a loaded 2-core machine


def spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def read_json_line(proc: subprocess.Popen, deadline_s: float) -> dict:
    """The next stdout line of `proc` as JSON, waiting at most `deadline_s`."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(deadline_s):
            proc.kill()
            raise AssertionError(f"worker printed nothing in {deadline_s} s: {proc.stderr.read()}")
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise AssertionError(f"worker exited ({proc.returncode}): {proc.stderr.read()}")
    return json.loads(line)


def finish(proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    """Wait for a worker that ends by itself; its last stdout line as JSON."""
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()


def clean(fields: dict) -> bool:
    return (
        fields["pinned_blocks"] == 0
        and fields["writing_blocks"] == 0
        and fields["detached_blocks"] == 0
        and fields["evictable_blocks"] == fields["cached_blocks"]
        and fields["free_blocks"] + fields["cached_blocks"] == fields["num_blocks"]
    )


def wait_clean(daemon, num_clients: int = 0) -> dict:
    """Poll INFO until the block gauges are clean and only `num_clients` (+ INFO's own
    session) are connected; fail with the last INFO at the deadline."""
    deadline = time.monotonic() + CLEAN_DEADLINE_S
    while True:
        fields = daemon.info()
        if clean(fields) and fields["connected_clients"] == num_clients + 1:
            return fields
        assert time.monotonic() < deadline, f"daemon not clean after {CLEAN_DEADLINE_S} s: {fields}"
        time.sleep(0.05)


# ------------------------------------------------------------- client killed at a step
# What INFO shows while the worker is stopped at the step (4 chunks, one block each).
HELD_AT_STEP = {
    "alloc": {"writing_blocks": 4, "pinned_blocks": 0, "cached_blocks": 0},
    "copy": {"writing_blocks": 4, "pinned_blocks": 0, "cached_blocks": 0},
    "commit": {"writing_blocks": 0, "pinned_blocks": 0, "cached_blocks": 4},
    "views": {"writing_blocks": 0, "pinned_blocks": 4, "cached_blocks": 4},
    "lease": {"writing_blocks": 0, "pinned_blocks": 4, "cached_blocks": 4},
}


@pytest.mark.parametrize("step", STEPS)
def test_client_killed_at_each_protocol_step_leaves_no_trace(daemon, step):
    proc = spawn("step", daemon.socket, step)
    try:
        assert read_json_line(proc, STEP_DEADLINE_S) == {"stopped": step}
        fields = daemon.info()
        assert {k: fields[k] for k in HELD_AT_STEP[step]} == HELD_AT_STEP[step]
    finally:
        kill(proc)
    fields = wait_clean(daemon)
    committed = step in ("commit", "views", "lease")
    assert fields["cached_blocks"] == (4 if committed else 0)
    layout = small_layout()
    kv = prompt_kv(layout, STEP_TOKENS)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True, verify="tokens") as fresh:
        got, ret_mask = fresh.retrieve(STEP_TOKENS, return_tuple=False)
        if committed:
            assert bool(ret_mask.all()) and torch.equal(got, kv)
        else:  # half-written blocks were aborted: a miss, never their bytes
            assert not ret_mask.any()
            assert fresh.store(STEP_TOKENS, kv) == 4
            got, ret_mask = fresh.retrieve(STEP_TOKENS, return_tuple=False)
            assert bool(ret_mask.all()) and torch.equal(got, kv)
        assert fresh.num_verify_failures == 0
    wait_clean(daemon)


# ------------------------------------------------------------------ torn-read stress
TORN_READ_S = 30.0


@pytest.mark.slow
def test_torn_read_stress_serves_no_wrong_byte(daemon_factory):
    # 1 MiB arena of 8 KiB blocks (127 blocks, one ~4.2 KiB record each); the pool of 60
    # prompts needs ~250 blocks: every store evicts, every hit races an eviction.
    daemon = daemon_factory("--capacity", "1MiB", "--block-size", "8KiB")
    pool_size = 60
    writer = spawn("torn_writer", daemon.socket, 0, TORN_READ_S, pool_size)
    readers = [spawn("torn_reader", daemon.socket, seed, TORN_READ_S, pool_size)
               for seed in (1, 2, 3)]
    try:
        written = finish(writer, TORN_READ_S + 60)
        results = [finish(reader, TORN_READ_S + 60) for reader in readers]
    finally:
        for proc in [writer, *readers]:
            kill(proc)
    totals = {key: sum(r[key] for r in results) for key in results[0]}
    fields = wait_clean(daemon)
    print(f"torn-read stress {TORN_READ_S:.0f} s: writer {written}, readers {totals}, "
          f"evictions {fields['evictions']}")
    assert totals["mismatches"] == 0
    # Pinned blocks are never rewritten, so not even a verified miss happens.
    assert totals["verify_failures"] == 0 and totals["checksum_failures"] == 0
    assert totals["retrieves"] > 300 and totals["hits"] > 50
    assert written["chunks"] > 500 and fields["evictions"] > 300


# -------------------------------------------------------- daemon killed under load
@pytest.mark.slow
def test_daemon_killed_and_restarted_under_load(unique_name, short_tmp):
    socket = os.path.join(short_tmp, "d.sock")
    stop_file = os.path.join(short_tmp, "stop")
    args = ("--capacity", "4MiB", "--block-size", "8KiB")
    first = start_daemon(unique_name, socket, os.path.join(short_tmp, "1.log"), *args)
    second = None
    clients = [spawn("restart_client", socket, seed, stop_file) for seed in range(3)]
    try:
        old_generations = {read_json_line(c, STEP_DEADLINE_S)["connected"] for c in clients}
        deadline = time.monotonic() + 30
        while first.info()["hits"] < 20:  # load on the first daemon
            assert time.monotonic() < deadline, "no hits on the first daemon"
            time.sleep(0.05)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
        time.sleep(0.5)  # clients run into the dead daemon: misses, skipped stores
        second = start_daemon(unique_name, socket, os.path.join(short_tmp, "2.log"), *args)
        deadline = time.monotonic() + 30
        while True:  # every client is back and hitting the new generation
            fields = second.info()
            if fields["connected_clients"] == len(clients) + 1 and fields["hits"] >= 20:
                break
            assert time.monotonic() < deadline, f"clients did not come back: {fields}"
            time.sleep(0.05)
        open(stop_file, "w").close()
        results = [finish(c) for c in clients]
        new_generation = fields["generation"]
    finally:
        for c in clients:
            kill(c)
        first.stop()
        if second is not None:
            second.stop()
    print(f"daemon restart under load: {results}")
    assert len(old_generations) == 1 and new_generation not in old_generations
    for r in results:
        assert r["mismatches"] == 0
        assert r["generations"][-1] == new_generation == r["arena_generation"]
        assert r["reconnects"] >= 1 and r["hit_tokens"] > 0
    assert list_segments(unique_name) == []
