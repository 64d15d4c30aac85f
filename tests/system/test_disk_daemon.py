"""The disk tier end to end: real daemons on a temporary directory, real worker processes.

Chunks the arena evicts come back bit-exact from disk; a daemon stopped (SIGTERM) or
killed (SIGKILL during a burst of spills) and started again serves them again, and no
torn slot is ever served; a slot corrupted or a file truncated under the daemon is a
counted miss and the daemon serves on; a second daemon on one directory is refused.
docs/operator.md, "The disk tier", describes the behaviour.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from conftest import start_daemon
from engine_worker import prompt_kv, small_layout
from test_engine_multiprocess import run_worker
from test_limits import wait_for
from test_loading import server_info
from lmcached.cli import main
from lmcached.client import KVLayout, hash_request_tokens
from lmcached.daemon.disk.directory import DirectoryLock, prepare_disk_directory
from lmcached.daemon.disk.slots import FILE_NAME, PAGE_BYTES, SlotFile, slot_bytes_for
from lmcached.launcher import stop_daemon
from lmcached.shm.janitor import list_segments
from lmcached.daemon.spill.envelope import ENVELOPE, namespace_fingerprint
from lmcached.wire.connection import Connection, DaemonError, hello
from lmcached.wire.protocol import Clear, Info

pytestmark = pytest.mark.slow

# Workers wait up to 10 s for a reply, and daemons up to 5 s for a disk fetch: the
# chunks come back whole however loaded the machine is.
WORKER_ENV = {**os.environ, "LMCACHED_DATA_TIMEOUT_MS": "10000"}
# 1 MiB arena of 64 KiB blocks: 15 blocks, one 16-token chunk each; a prompt of 100
# tokens is 7 chunks, so a third prompt evicts the first.
ARENA = ("--capacity", "1MiB", "--block-size", "64KiB", "--disk-fetch-wait", "5")
NUM_CHUNKS = 7
BIG_NUM_SLOTS = 1_000_000  # a slot file that takes seconds to scan


def disk_args(directory: str, *more: str) -> tuple[str, ...]:
    return (*ARENA, "--disk-path", directory, "--disk-capacity", "8MiB", *more)


def store(daemon, start: int) -> None:
    assert run_worker("store", daemon.socket, start, 100, 0, 1, env=WORKER_ENV) == {
        "stored": NUM_CHUNKS}


def drained(daemon) -> None:
    """Wait until no disk write is queued: the writes ahead of eviction keep up, as
    between the prefills of a serving process (a burst faster than the disk drops
    chunks, tests/daemon/disk/test_disk_tier.py)."""
    wait_for(lambda: not daemon.info()["disk_queue_values"], what="the disk writes",
             timeout_s=30)


def retrieve(daemon, start: int) -> dict:
    return run_worker("retrieve", daemon.socket, start, 100, 0, 1, env=WORKER_ENV)


def written(daemon, count: int) -> dict:
    """Wait until `count` chunks are on disk and no write is queued."""
    def done():
        info = daemon.info()
        return info if info["disk_writes"] >= count and not info["disk_queue_values"] else None
    return wait_for(done, what=f"{count} disk writes", timeout_s=30)


@pytest.fixture
def disk_dir(short_tmp):
    return os.path.join(short_tmp, "disk")


def test_evicted_chunks_come_back_bit_exact_from_disk(daemon_factory, disk_dir):
    daemon = daemon_factory(*disk_args(disk_dir))
    for start in (0, 1000, 2000):
        store(daemon, start)
        drained(daemon)
    info = written(daemon, 6)  # 21 chunks in 15 blocks: the 6 least recently used spill
    assert info["evictions"] == 6 and info["disk_used_slots"] == info["disk_writes"] >= 6
    assert info["disk_direct_io"] == 1  # /tmp is ext4 here (tmpfs takes O_DIRECT too since Linux 6.6)
    assert retrieve(daemon, 0) == {"hit": 100, "mismatches": 0}
    info = daemon.info()
    assert info["disk_fetch_hit_chunks"] == 6 and info["disk_fetch_failures"] == 0
    assert info["pinned_blocks"] == 0 and info["writing_blocks"] == 0
    # The other prompts were evicted in turn: they too are served, from disk or arena.
    for start in (1000, 2000):
        assert retrieve(daemon, start) == {"hit": 100, "mismatches": 0}
    assert daemon.info()["pinned_blocks"] == 0


@pytest.mark.parametrize("stop", ["sigterm", "sigkill_during_spills"])
def test_a_restarted_daemon_serves_what_its_disk_holds(daemon_factory, disk_dir, stop):
    daemon = daemon_factory(*disk_args(disk_dir, "--disk-policy", "write-through"))
    prompts = range(0, 6000, 1000)
    for start in prompts[:3]:
        store(daemon, start)
    written(daemon, 3 * NUM_CHUNKS)
    if stop == "sigterm":
        daemon.stop()
    else:  # a burst of writes in flight when the daemon dies
        for start in prompts[3:]:
            store(daemon, start)
        os.kill(daemon.proc.pid, signal.SIGKILL)
        daemon.proc.wait(10)
    # Same name and socket: the new daemon sweeps the killed one's segment and socket.
    restarted = start_daemon(daemon.name, daemon.socket, daemon.log_path + ".2",
                             *disk_args(disk_dir))
    try:
        info = restarted.info()
        assert info["cached_values"] == 0 and info["disk_restored_chunks"] >= 3 * NUM_CHUNKS
        for start in prompts[:3]:  # written before the stop: every one is whole
            assert retrieve(restarted, start) == {"hit": 100, "mismatches": 0}
        for start in prompts[3:]:  # in flight at the kill: a prefix at most, never torn
            assert retrieve(restarted, start)["mismatches"] == 0
        assert restarted.info()["pinned_blocks"] == 0
    finally:
        restarted.stop()


def test_clear_holds_across_a_restart_after_write_aheads_were_cancelled(daemon_factory,
                                                                          disk_dir):
    """Chunks of 4 MiB, 14 slots: once they are full, every write ahead takes the slot of
    the disk's least recently used chunk, and a burst of stores from one process (a copy
    into the arena is faster than a write to disk) overtakes the writers, so writes ahead
    are cancelled in those slots. After CLEAR and a graceful restart, none of those
    chunks (nor any other) is served."""
    from lmcached.client import CacheEngine

    layout = KVLayout("clear-llama", num_layers=4, num_kv_heads=8, head_size=128,
                      chunk_size=256)
    args = ("--capacity", "70MiB", "--block-size", "4200KiB", "--disk-path", disk_dir,
            "--disk-capacity", "60MiB", "--disk-fetch-wait", "5")
    kv = torch.ones(layout.chunk_shape(512), dtype=layout.torch_dtype)  # 2 chunks
    prompts = [list(range(start, start + 512)) for start in range(0, 40_000, 1000)]
    for _ in range(3):  # the burst races the writers: a loaded machine may not overtake them
        daemon = daemon_factory(*args)
        with CacheEngine.connect(layout, socket=daemon.socket, strict=True,
                                 data_timeout_s=10) as engine:
            for tokens in prompts[:16]:
                engine.store(tokens, kv)
                drained(daemon)
            info = daemon.info()
            assert info["disk_used_slots"] == info["disk_slots"] == 14
            with Connection(daemon.socket) as admin:
                hello(admin, "admin")
                for tokens in prompts[16:]:  # the burst
                    engine.store(tokens, kv)
                assert admin.request(Clear()).count > 0  # writes ahead still queued
            drained(daemon)
        if daemon.info()["disk_write_drops_late"] >= 1:
            break
        daemon.stop()
    assert daemon.info()["disk_write_drops_late"] >= 1, "no write ahead was overtaken in 3 tries"
    assert daemon.info()["disk_used_slots"] == 0
    daemon.stop()  # graceful: the erasures queued by CLEAR reach the disk first
    restarted = start_daemon(daemon.name, daemon.socket, daemon.log_path + ".2", *args)
    try:
        assert restarted.info()["disk_restored_chunks"] == 0, "a restart undid CLEAR"
        with CacheEngine.connect(layout, socket=restarted.socket, strict=True,
                                 data_timeout_s=10) as engine:
            assert sum(engine.lookup(tokens) for tokens in prompts) == 0
        assert restarted.info()["disk_fetch_hit_chunks"] == 0
    finally:
        restarted.stop()


def test_a_wrong_parent_from_another_client_never_costs_the_victim_its_disk_chunks(
        daemon_factory, disk_dir):
    """A LOOKUP / ACQUIRE whose `parent` is wrong fails the chain check of the chunks it
    fetches: a miss for that request, never a slot forgotten (no EVICT right needed)."""
    from raw_frames import connect, recv_reply
    from lmcached.wire.frames import encode_frame
    from lmcached.wire.protocol import PROTOCOL_VERSION, Acquire, Hello, Lookup, Release

    daemon = daemon_factory(*disk_args(disk_dir))
    layout = small_layout()
    # 112 tokens, 7 chunks: as much as one session may hold of this 15-block arena
    assert run_worker("store", daemon.socket, 0, 112, 0, 1, env=WORKER_ENV) == {"stored": 7}
    drained(daemon)
    for start in (1000, 2000):  # the victim's chunks go to disk
        store(daemon, start)
        drained(daemon)
    used = daemon.info()["disk_used_slots"]
    hashes = b"".join(hash_request_tokens(layout.chunk_size, list(range(112))))
    sock = connect(daemon.socket)
    try:
        sock.sendall(encode_frame(Hello(PROTOCOL_VERSION, os.getpid(), "attacker",
                                        [layout.to_wire()])))
        (ns,) = recv_reply(sock).namespaces
        for offset in range(6, -1, -1):  # every run of the chain, each after a wrong parent
            # (the arena's chunks are counted: a reader verifies their token ids itself)
            sock.sendall(encode_frame(Lookup([ns], hashes[16 * offset:], parent=b"\7" * 16)))
            recv_reply(sock)
            sock.sendall(encode_frame(Acquire([ns], hashes[16 * offset:], parent=b"\7" * 16)))
            sock.sendall(encode_frame(Release([recv_reply(sock).lease])))
    finally:
        sock.close()
    info = daemon.info()
    assert info.get("disk_fetch_verify_tokens", 0) >= 1, "the attack never reached the disk"
    assert info["disk_used_slots"] >= used, "a request's wrong parent forgot a slot"
    assert run_worker("retrieve", daemon.socket, 0, 112, 0, 1, env=WORKER_ENV) == {
        "hit": 112, "mismatches": 0}
    assert daemon.info()["pinned_blocks"] == 0


def test_a_corrupted_slot_and_a_truncated_file_are_counted_misses(daemon_factory, disk_dir):
    daemon = daemon_factory(*disk_args(disk_dir, "--disk-policy", "write-through"))
    store(daemon, 0)
    store(daemon, 2000)
    written(daemon, 2 * NUM_CHUNKS)
    daemon.stop()
    layout = small_layout()
    fp = namespace_fingerprint(layout.to_wire())
    hashes = hash_request_tokens(layout.chunk_size, list(range(100)))
    path = os.path.join(disk_dir, FILE_NAME)
    with open(path, "rb") as f:
        superblock = f.read(PAGE_BYTES)
    slot_bytes = int.from_bytes(superblock[16:24], "little")
    with open(path, "r+b") as f:  # flip the last KV byte of the slot of chunk 3 (its
        # record starts after the slot's envelope page)
        for slot in range((os.path.getsize(path) - PAGE_BYTES) // slot_bytes):
            f.seek(PAGE_BYTES + slot * slot_bytes)
            _, _, _, length, _, slot_fp, slot_hash = ENVELOPE.unpack(f.read(ENVELOPE.size))
            if (slot_fp, slot_hash) == (fp, hashes[3]):
                f.seek(PAGE_BYTES + slot * slot_bytes + PAGE_BYTES + length - 1)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
                break
        else:
            raise AssertionError("chunk 3 is in no slot")
    restarted = daemon_factory(*disk_args(disk_dir), name=daemon.name)
    assert retrieve(restarted, 0) == {"hit": 3 * 16, "mismatches": 0}
    info = restarted.info()
    assert info["disk_fetch_verify_checksum"] == 1 and info["disk_fetch_hit_chunks"] == 3
    assert info["disk_used_slots"] == 2 * NUM_CHUNKS - 1, "a slot that failed is forgotten"
    restarted.stop()
    # Every slot gone under a running daemon, truncated before any client registers a
    # namespace: the prewarm that a registration starts would otherwise have read some
    # chunks into the arena first, and they would hit.
    again = daemon_factory(*disk_args(disk_dir), name=daemon.name)
    os.truncate(path, PAGE_BYTES)
    assert retrieve(again, 2000) == {"hit": 0, "mismatches": 0}
    info = again.info()
    assert info["disk_errors_io"] >= 1 and info["pinned_blocks"] == 0
    store(again, 5000)  # the daemon serves on
    assert retrieve(again, 5000) == {"hit": 100, "mismatches": 0}


def test_a_second_daemon_on_one_directory_is_refused(daemon_factory, disk_dir, unique_name,
                                                      short_tmp):
    daemon_factory(*disk_args(disk_dir))
    with pytest.raises(RuntimeError, match=r"--disk-path .* is used by another lmcached "
                       r"daemon \(pid \d+\); two daemons never share a disk tier"):
        start_daemon(f"{unique_name}-second", os.path.join(short_tmp, "second.sock"),
                     os.path.join(short_tmp, "second.log"), *disk_args(disk_dir))


def test_vllm_connector_records_come_back_bit_exact_from_disk(daemon_factory, disk_dir):
    """The vLLM connector's worker saves a prompt, later prompts evict it to disk, and the
    scheduler's ACQUIRE of it (the daemon fetches from disk inside the request) loads it
    into another worker's blocks byte for byte."""
    import numpy as np
    import torch

    from test_vllm_worker import CHUNK, LAYERS, cpu_layout_cache, page_bytes_of, raw_block, \
        registered_worker, worker_settings
    from lmcached.client.daemon_link import DaemonLink
    from lmcached.client.serving.specs import LoadSpec, SaveSpec
    from lmcached.wire.protocol import Acquire

    # 7 blocks of 32 KiB; a record (3 layers x 2 pages of 4 KiB, header) fits one block.
    daemon = daemon_factory("--capacity", "256KiB", "--block-size", "32KiB", "--disk-path",
                            disk_dir, "--disk-capacity", "8MiB", "--disk-fetch-wait", "5")
    caches_a = {name: cpu_layout_cache("cpu") for name in LAYERS}
    caches_b = {name: torch.zeros_like(caches_a[name]) for name in LAYERS}
    settings = worker_settings(daemon.socket, page_bytes_of(caches_a[LAYERS[0]]))
    prompts = [np.arange(start, start + 2 * CHUNK, dtype=np.int64)
               for start in (100, 2000, 3000, 4000, 5000)]
    hashes = [hash_request_tokens(CHUNK, tokens) for tokens in prompts]
    saver, loader = registered_worker(settings, caches_a), registered_worker(settings, caches_b)
    pins = DaemonLink(daemon.socket, layouts=[settings.layouts[0].to_wire()], data_timeout_s=10)
    try:
        for i, (tokens, chunk_hashes) in enumerate(zip(prompts, hashes)):
            saver.save([SaveSpec(f"r{i}", 0, tokens, chunk_hashes, block_ids=[3, 5, 7, 9])])
            drained(daemon)
        info = written(daemon, 2)  # 10 chunks in 7 blocks: the first prompt spilled
        assert info["disk_used_slots"] >= 2
        acquired = pins.request(Acquire(pins.ensure_connected().namespaces,
                                        b"".join(hashes[0])))
        spans = acquired.spans()
        assert len(spans) == 2 and daemon.info()["disk_fetch_hit_chunks"] >= 2
        loader.load([LoadSpec("b", 0, 0, prompts[0], hashes[0], [spans],
                              [pins.hello_reply.generation], [[0, 1], [0, 1]], [[1, 2], [4, 6]])])
        assert loader.take_load_errors() == set() and loader.num_loaded_tokens == 2 * CHUNK
        for name in LAYERS:
            for dst, src in ((1, 3), (2, 5), (4, 7), (6, 9)):
                assert raw_block(caches_b[name], dst) == raw_block(caches_a[name], src)
        pins.release([acquired.lease], pins.hello_reply.session_id)
        assert daemon.info()["pinned_blocks"] == 0
    finally:
        pins.close()
        saver.shutdown()
        loader.shutdown()


def serve_without_waiting(name: str, socket: str, log_path: str, *args: str) -> subprocess.Popen:
    """`lmcached serve`, not waited for (it may be loading for a while)."""
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "lmcached.cli", "serve", "--name", name,
                                 "--socket", socket, *args], stdout=log, stderr=subprocess.STDOUT)


def rebuilding(socket: str) -> dict | None:
    """INFO `server` once the daemon answers while it rebuilds the disk tier's index and
    has scanned some slots, else None."""
    server = server_info(socket)
    if server and "disk_index" in server["loading_phase"].split(",") and \
            server["loading_disk_scanned_slots"] > 0:
        return server
    return None


def big_slot_file(directory: str) -> None:
    """A slot file of BIG_NUM_SLOTS empty slots of one page: preallocated, never written
    (4 GB of disk, no I/O), seconds of scanning."""
    disk_directory = prepare_disk_directory(directory)
    slot_file, _ = SlotFile.open(disk_directory, PAGE_BYTES, BIG_NUM_SLOTS)
    slot_file.close()
    disk_directory.close()


@pytest.mark.parametrize("stop", ["sigterm", "shutdown"])
def test_a_stop_during_a_long_index_rebuild_stops_the_daemon_cleanly(unique_name, short_tmp,
                                                                      stop):
    """SIGTERM or `lmcached stop` (SHUTDOWN) while a warm restart rebuilds the index of a
    big slot file (a million slots: seconds of scanning), the daemon answering INFO
    meanwhile: it stops before the rebuild ends, exits 0, leaves no arena in /dev/shm and
    no socket, and releases the directory's lock."""
    directory = os.path.join(short_tmp, "disk")
    big_slot_file(directory)
    socket, log_path = os.path.join(short_tmp, "d.sock"), os.path.join(short_tmp, "d.log")
    proc = serve_without_waiting(unique_name, socket, log_path, "--capacity", "1MiB",
                                 "--disk-path", directory, "--disk-capacity",
                                 str(PAGE_BYTES * (BIG_NUM_SLOTS + 1)))
    try:
        def read_log() -> str:
            with open(log_path, errors="replace") as f:
                return f.read()
        server = wait_for(lambda: rebuilding(socket), what="the index rebuild", timeout_s=60)
        assert server["loading"] == 1 and server["loading_disk_slots"] == BIG_NUM_SLOTS
        signalled = time.monotonic()
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            result = CliRunner().invoke(main, ["stop", "--socket", socket])
            assert (result.exit_code, result.stdout) == (0, "stopping\nstopped\n"), \
                result.output
        assert proc.wait(timeout=30) == 0, read_log()
        stopped_s = time.monotonic() - signalled
    finally:
        stop_daemon(proc)  # by pid, if the test failed before it stopped
    text = read_log()
    assert (f"received {'SIGTERM' if stop == 'sigterm' else 'SHUTDOWN'} during start-up: "
            "stopped") in text, text
    assert "chunks found" not in text, f"the rebuild ran to its end ({stopped_s:.1f} s):\n{text}"
    assert list_segments(unique_name) == [] and not os.path.exists(socket)
    disk_directory = prepare_disk_directory(directory)
    DirectoryLock(disk_directory).release()  # free: another daemon may start on it
    disk_directory.close()


def test_a_warm_restart_answers_loading_while_it_rebuilds_then_serves_what_disk_holds(
        daemon_factory, short_tmp):
    """The restarted daemon listens at once: while it rebuilds the index of a million
    slots, `lmcached ping` says LOADING with the phase and its progress (not "no
    daemon"), `info` answers and names the phase, a worker's HELLO is refused with
    `loading`; once rebuilt, the prompts stored before the restart hit, bit-exact."""
    from lmcached.client import CacheEngine

    directory = os.path.join(short_tmp, "disk")
    layout = KVLayout("tiny", num_layers=1, num_kv_heads=2, head_size=16, chunk_size=16)
    # A record of this layout fits a block of 4032 bytes, hence a slot of two pages (its
    # envelope page and one page of record): a preallocated file of 8 GB, fallocated.
    args = ("--capacity", "1MiB", "--block-size", "4032", "--disk-path", directory,
            "--disk-capacity", str(slot_bytes_for(4032) * BIG_NUM_SLOTS + PAGE_BYTES),
            "--disk-policy",
            "write-through", "--disk-fetch-wait", "5")
    prompts = [list(range(start, start + 100)) for start in (0, 1000)]
    daemon = daemon_factory(*args)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True,
                             data_timeout_s=10) as engine:
        for tokens in prompts:
            assert engine.store(tokens, prompt_kv(layout, tokens)) == NUM_CHUNKS
    written(daemon, 2 * NUM_CHUNKS)
    daemon.stop()
    log_path = daemon.log_path + ".2"
    proc = serve_without_waiting(daemon.name, daemon.socket, log_path, *args)
    try:
        server = wait_for(lambda: rebuilding(daemon.socket), what="the index rebuild",
                          timeout_s=60)
        assert server["loading"] == 1 and server["loading_disk_slots"] == BIG_NUM_SLOTS
        result = CliRunner().invoke(main, ["ping", "--socket", daemon.socket])
        assert result.exit_code == 1, result.output
        assert result.stdout.startswith("LOADING rebuilding the disk tier's index: "), \
            result.output
        done = int(result.stdout.split(": ", 1)[1].split(" of ")[0])
        assert done > 0 and f" of {BIG_NUM_SLOTS} slots (" in result.stdout
        result = CliRunner().invoke(main, ["info", "server", "--socket", daemon.socket])
        lines = result.stdout.splitlines()
        assert result.exit_code == 0 and "loading:1" in lines, result.output
        assert any(line.startswith("loading_phase:disk_index") for line in lines), lines
        assert result.stderr.startswith("note: the daemon is loading: it rebuilds its disk "
                                        "tier's index (")
        with Connection(daemon.socket) as conn:
            with pytest.raises(DaemonError, match="^loading: rebuilding the disk tier's index"):
                hello(conn, "worker", [layout.to_wire()])
        # The directory was locked before the daemon listened: a second daemon on it
        # fails at once, with its clear error, and takes no socket.
        second = os.path.join(short_tmp, "second.sock")
        with pytest.raises(RuntimeError, match=r"--disk-path .* is used by another lmcached "
                           r"daemon \(pid \d+\)"):
            start_daemon(f"{daemon.name}-second", second, os.path.join(short_tmp, "second.log"),
                         *args)
        assert not os.path.exists(second)

        wait_for(lambda: (server_info(daemon.socket) or {}).get("loading") == 0,
                 what="the end of the rebuild", timeout_s=60)
        with CacheEngine.connect(layout, socket=daemon.socket, strict=True,
                                 data_timeout_s=10) as engine:
            for tokens in prompts:
                kv, mask = engine.retrieve(tokens, return_tuple=False)
                assert bool(mask.all()) and torch.equal(kv, prompt_kv(layout, tokens))
        with Connection(daemon.socket) as conn:
            info = {k: v for section in conn.request(Info()).sections.values()
                    for k, v in section.items()}
        assert info["loading_phase"] == "none" and info["loading_disk_scanned_perc"] == 100.0
        assert info["disk_restored_chunks"] == 2 * NUM_CHUNKS
        assert info["disk_fetch_hit_chunks"] == 2 * NUM_CHUNKS and info["pinned_blocks"] == 0
    finally:
        assert stop_daemon(proc) == 0
    assert list_segments(daemon.name) == [] and not os.path.exists(daemon.socket)


def test_a_salted_prompt_comes_back_from_disk_under_its_own_salt_only(daemon_factory, disk_dir):
    """A salted chain's first chunk is verified from the salt's root (the request's
    `parent`), not ROOT_HASH: evicted to disk, it comes back bit-exact under its salt, and
    another salt or no salt misses it."""
    from engine_worker import chunk_kv
    from lmcached.client import CacheEngine

    daemon = daemon_factory(*disk_args(disk_dir))
    layout = small_layout()
    tokens = list(range(5000, 5100))
    hashes = hash_request_tokens(layout.chunk_size, tokens, salt="tenant-a")
    kv = torch.cat([chunk_kv(layout, h, min(layout.chunk_size, len(tokens) - i * layout.chunk_size))
                    for i, h in enumerate(hashes)], dim=layout.token_dim)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True,
                             data_timeout_s=10) as engine:
        assert engine.store(tokens, kv, cache_salt="tenant-a") == NUM_CHUNKS
        drained(daemon)
        for start in (1000, 2000, 3000):  # unsalted prompts evict the salted one to disk,
            store(daemon, start)           # its first chunk too (freed last: vLLM's order)
            drained(daemon)
        info = written(daemon, 13)
        assert info["evictions"] >= 13
        assert engine.lookup(tokens, cache_salt="tenant-b") == 0
        assert engine.lookup(tokens) == 0
        got, mask = engine.retrieve(tokens, return_tuple=False, cache_salt="tenant-a")
        assert bool(mask.all()) and torch.equal(got, kv)
    info = daemon.info()
    assert info["disk_fetch_hit_chunks"] == NUM_CHUNKS and info["disk_fetch_failures"] == 0
    assert info["pinned_blocks"] == 0


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_slot_file_that_is_not_a_regular_file_stops_the_start_at_once(unique_name, short_tmp,
                                                                       kind):
    """A FIFO in place of the slot file once blocked the start before the daemon listened
    (SIGTERM had no effect, the directory stayed locked); a symlink led to another file.
    Both are refused at once, naming the file and the fix, and leave nothing behind."""
    from test_security import serve_expecting_failure

    directory = os.path.join(short_tmp, "disk")
    os.mkdir(directory, 0o700)
    path = os.path.join(directory, FILE_NAME)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        os.symlink(os.path.join(short_tmp, "elsewhere"), path)
    sock = os.path.join(short_tmp, "d.sock")
    started = time.monotonic()
    proc = serve_expecting_failure(unique_name, sock, "--disk-path", directory,
                                   "--disk-capacity", "8MiB")  # 30 s at most
    assert time.monotonic() - started < 20
    problem = "a FIFO" if kind == "fifo" else "a symlink"
    assert f"{path} is {problem}, not a regular file" in proc.stderr, proc.stderr
    assert f"rm {path}" in proc.stderr, proc.stderr
    assert list_segments(unique_name) == [] and not os.path.exists(sock)
    assert not os.path.exists(os.path.join(short_tmp, "elsewhere"))
    checked = prepare_disk_directory(directory)
    DirectoryLock(checked).release()  # not left locked
    checked.close()


def test_a_disk_path_below_a_directory_others_can_write_is_refused(unique_name, short_tmp):
    from test_security import serve_expecting_failure

    parent = os.path.join(short_tmp, "public")
    os.mkdir(parent)
    os.chmod(parent, 0o777)  # not sticky
    proc = serve_expecting_failure(unique_name, os.path.join(short_tmp, "d.sock"),
                                   "--disk-path", os.path.join(parent, "disk"))
    assert f"{parent} is writable by every user (mode 0777, not sticky)" in proc.stderr
    assert f"chmod go-w {parent}" in proc.stderr and os.listdir(parent) == []


def test_the_slot_file_and_the_lock_are_readable_by_the_daemons_user_only(daemon_factory,
                                                                         disk_dir):
    """Both files hold what the cache holds (the slot file every prompt's token ids): 0600
    after a start, and a file found 0644 is brought to 0600 (logged)."""
    paths = [os.path.join(disk_dir, FILE_NAME), os.path.join(disk_dir, "lock")]
    daemon = daemon_factory(*disk_args(disk_dir))
    assert [os.stat(p).st_mode & 0o7777 for p in paths] == [0o600, 0o600]
    daemon.stop()
    for p in paths:
        os.chmod(p, 0o644)
    restarted = daemon_factory(*disk_args(disk_dir))
    assert [os.stat(p).st_mode & 0o7777 for p in paths] == [0o600, 0o600]
    assert f"{paths[0]} had mode 0644: set to 0600" in restarted.log()


def test_a_warm_restart_keeps_its_disk_tier_whichever_layout_attaches_first(daemon_factory,
                                                                           disk_dir):
    """No --block-size: the first layout that attaches sets the block size. Layout A's
    prompt is on disk; after a restart layout B (records 3 times larger) attaches first
    and sets larger blocks: the slot file keeps its slots and A's chunks (a warning says
    so, with the --block-size that keeps it), and A's prompt hits, bit-exact."""
    import msgspec

    args = ("--capacity", "1MiB", "--disk-path", disk_dir, "--disk-capacity", "8MiB",
            "--disk-policy", "write-through", "--disk-fetch-wait", "5")
    daemon = daemon_factory(*args)
    store(daemon, 0)
    info = written(daemon, NUM_CHUNKS)
    slot_bytes, block_bytes = info["disk_slot_bytes"], info["block_bytes"]
    daemon.stop()
    restarted = daemon_factory(*args)
    layout_a = small_layout().to_wire()
    layout_b = msgspec.structs.replace(layout_a, model_name="other-model",
                                       record_bytes=3 * layout_a.record_bytes)
    with Connection(restarted.socket) as conn:
        hello(conn, "first", [layout_b])
    info = restarted.info()
    assert info["block_bytes"] > block_bytes and info["disk_slot_bytes"] == slot_bytes
    assert info["disk_used_slots"] == NUM_CHUNKS
    assert retrieve(restarted, 0) == {"hit": 100, "mismatches": 0}
    assert restarted.info()["disk_fetch_hit_chunks"] == NUM_CHUNKS
    assert f"keeps its slots of {slot_bytes} bytes" in restarted.log()
