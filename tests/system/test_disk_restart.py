"""What a restart keeps: a graceful stop saves the arena's chunks to the disk tier, most
recently used first, within --disk-save-on-stop; the restarted daemon reads the hottest
back into the arena in the background (prewarm), so that the prompts most recently used
before the stop hit in memory, not on disk. docs/operator.md, "What a restart keeps".
"""

import os
import re
import time

import pytest
import torch

from conftest import start_daemon
from engine_worker import prompt_kv, small_layout
from test_limits import wait_for
from test_notify import daemon_env, notify_socket, receive  # noqa: F401 - a fixture
from lmcached.client import CacheEngine
from lmcached.daemon.disk.save import SLOW_WRITE_ENV
from lmcached.shm.janitor import list_segments

pytestmark = pytest.mark.slow

# 8 KiB blocks, one 16-token chunk (a 4.3 KB record) each: a 1 MiB arena holds 127
# chunks; 100 prompts of 2 chunks are 200 chunks, the arena holds ~60% of them.
BLOCKS = ("--capacity", "1MiB", "--block-size", "8KiB", "--disk-fetch-wait", "5")
NUM_PROMPTS = 100
PROMPT_TOKENS = 32
ARENA_PROMPTS = 60  # the most recent prompts that fit the arena (63 would)


def prompts() -> list[list[int]]:
    return [list(range(start, start + PROMPT_TOKENS))
            for start in range(0, NUM_PROMPTS * 1000, 1000)]


def disk_args(directory: str, *more: str) -> tuple[str, ...]:
    return (*BLOCKS, "--disk-path", directory, "--disk-capacity", "4MiB", *more)


def store_all(daemon, layout) -> None:
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True,
                             data_timeout_s=10) as engine:
        for tokens in prompts():
            engine.store(tokens, prompt_kv(layout, tokens))
    wait_for(lambda: not daemon.info()["disk_queue_values"], what="the disk writes",
             timeout_s=30)


def test_a_restart_after_sigterm_serves_the_most_recent_prompts_from_the_arena(
        daemon_factory, short_tmp):
    layout = small_layout()
    disk_dir = os.path.join(short_tmp, "disk")
    daemon = daemon_factory(*disk_args(disk_dir))  # the default policy: on-evict
    store_all(daemon, layout)
    before = daemon.info()
    assert before["evictions"] > 0 and before["cached_values"] >= 2 * ARENA_PROMPTS
    assert daemon.stop() == 0, daemon.log()  # SIGTERM
    saved = re.search(r"saved (\d+) chunks of the arena", daemon.log())
    assert saved and int(saved[1]) > 0 and "not written" not in daemon.log(), daemon.log()
    restarted = start_daemon(daemon.name, daemon.socket, daemon.log_path + ".2",
                             *disk_args(disk_dir))
    try:
        info = restarted.info()
        assert info["disk_recency_restored_chunks"] == info["disk_restored_chunks"] > 0
        with CacheEngine.connect(layout, socket=restarted.socket, strict=True,
                                 data_timeout_s=10) as engine:  # its HELLO plans the prewarm
            info = wait_for(lambda: (lambda i: i if i["disk_prewarm_state"] == "done"
                                     else None)(restarted.info()),
                            what="the prewarm", timeout_s=30)
            assert info["disk_prewarm_chunks"] >= 2 * ARENA_PROMPTS
            assert info["disk_prewarm_failures"] == 0
            fetched = info["disk_fetch_hit_chunks"], info["disk_fetches"]
            recent = prompts()[-ARENA_PROMPTS:]
            assert [engine.lookup(tokens) for tokens in recent] == \
                [PROMPT_TOKENS] * ARENA_PROMPTS
            for tokens in recent[::10]:  # bit-exact
                kv, mask = engine.retrieve(tokens, return_tuple=False)
                assert int(mask.sum()) == PROMPT_TOKENS
                assert torch.equal(kv, prompt_kv(layout, tokens))
        info = restarted.info()
        # Served from the arena: not one chunk was read from disk for them.
        assert (info["disk_fetch_hit_chunks"], info["disk_fetches"]) == fetched
        assert info["pinned_blocks"] == 0 and info["writing_blocks"] == 0
    finally:
        assert restarted.stop() == 0
    assert not [s for s in list_segments() if daemon.name in s]


def test_a_stop_whose_budget_runs_out_writes_the_hottest_chunks_first(daemon_factory,
                                                                       short_tmp,
                                                                       notify_socket):
    """Each save write takes 20 ms (a slow disk, by a test seam), the budget 0.5 s: the
    stop writes about 25 of the arena's ~70 unsaved chunks, the most recently used, says
    how many it did not write (the log, systemd's STATUS=), and exits within the budget
    plus 1 s."""
    sock, notify_path = notify_socket
    layout = small_layout()
    disk_dir = os.path.join(short_tmp, "disk")
    budget_s = 0.5
    env = daemon_env(NOTIFY_SOCKET=notify_path, **{SLOW_WRITE_ENV: "0.02"})
    daemon = daemon_factory(*disk_args(disk_dir, "--disk-save-on-stop", str(budget_s)),
                            env=env)
    store_all(daemon, layout)
    started = time.monotonic()
    assert daemon.stop() == 0
    stop_s = time.monotonic() - started
    log = daemon.log()
    found = re.search(r"saved (\d+) of (\d+) chunks .* (\d+) not written \(the 0.5 s budget "
                      r"ran out", log)
    assert found, log
    written, candidates, unwritten = map(int, found.groups())
    assert 0 < written < candidates and written + unwritten == candidates
    assert stop_s < budget_s + 1.0, f"the stop took {stop_s:.2f} s"
    statuses = []
    while (lines := receive(sock, 0.2)) is not None:
        statuses += [line for line in lines if line.startswith("STATUS=")]
    assert f"STATUS=saving {candidates} chunks to disk" in statuses, statuses
    assert f"STATUS=saved {written} of {candidates} chunks to disk" in statuses, statuses
    restarted = start_daemon(daemon.name, daemon.socket, daemon.log_path + ".2",
                             *disk_args(disk_dir, "--disk-save-on-stop", "0"))
    try:
        with CacheEngine.connect(layout, socket=restarted.socket, strict=True,
                                 data_timeout_s=10) as engine:
            # Every saved chunk is one of the most recent: the newest prompts hit whole,
            # as many as the chunks written cover (each prompt is 2 chunks).
            hottest = prompts()[-(written // 2):]
            assert [engine.lookup(tokens) for tokens in hottest] == \
                [PROMPT_TOKENS] * len(hottest)
            # The prompts just older than the save reached were neither saved nor spilled.
            newest_unsaved = prompts()[-(written // 2) - 2]
            assert engine.lookup(newest_unsaved) == 0
    finally:
        assert restarted.stop() == 0
