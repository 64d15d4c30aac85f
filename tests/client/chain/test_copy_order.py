"""The order of the engine's copies, on CPU through seams: copies into a device tier land
before the COMMIT whatever the KV's device (`Chain.store` synchronizes the destination
records), copy threads of a store or of a retrieve into `out` wait for the caller's CUDA
stream (`kv_io.after_caller_stream`, with a stand-in for torch.cuda), and device-tier
records carry the chain's fingerprint.

The device tier is a memfd (`--gpu-backend fake`), whose records need no
synchronization: the tests log the calls a real CUDA tier would need, in order.
"""

import threading
import types

import numpy as np
import pytest
import torch

from engine_worker import prompt_kv, small_layout
from lmcached.client import CacheEngine
from lmcached.client import engine as engine_module
from lmcached.client import engine_retrieve, retrieve
from lmcached.client.chain import Chain
from lmcached.client.kv_io import after_caller_stream
from lmcached.client.records import RecordIO
from lmcached.client.tiered_records import TieredRecords
from lmcached.client.tier_map import DeviceRecordIO
from lmcached.shm.arena import HEADER_BYTES, Arena
from lmcached.wire.protocol import tier_of

DEVICE = "fake-0"
CHUNK = 16


@pytest.fixture
def tiered_daemon(daemon_factory):
    """A 16 MiB arena and a 1 MiB fake device tier, both of 64 KiB blocks."""
    return daemon_factory("--capacity", "16MiB", "--block-size", "64KiB",
                          "--gpu-capacity", "1MiB", "--gpu-backend", "fake")


def test_a_store_of_cpu_kv_into_a_device_tier_synchronizes_it_before_the_commit(
        tiered_daemon, monkeypatch):
    layout = small_layout()
    tokens = list(range(3 * CHUNK))
    kv = prompt_kv(layout, tokens)  # CPU KV: the source needs no wait
    calls = []
    write, synchronize = TieredRecords.write, TieredRecords.synchronize

    def logged_write(self, span, *args):
        calls.append(("write", tier_of(span[0])))
        write(self, span, *args)

    def logged_synchronize(self):
        calls.append(("synchronize",))
        synchronize(self)

    monkeypatch.setattr(TieredRecords, "write", logged_write)
    monkeypatch.setattr(TieredRecords, "synchronize", logged_synchronize)
    with CacheEngine.connect(layout, socket=tiered_daemon.socket, strict=True,
                             tier_device=DEVICE, copy_threads=2) as engine:
        request = engine.link.request

        def logged_request(message, *args, **kwargs):
            calls.append((type(message).__name__,))
            return request(message, *args, **kwargs)

        monkeypatch.setattr(engine.link, "request", logged_request)
        assert engine.store(tokens, kv) == 3
    assert tiered_daemon.info()["tier1_cached_blocks"] == 3
    writes = [i for i, call in enumerate(calls) if call[0] == "write"]
    assert [calls[i] for i in writes] == [("write", 1)] * 3  # into the device tier
    syncs = [i for i, call in enumerate(calls) if call == ("synchronize",)]
    commits = [i for i, call in enumerate(calls) if call == ("Commit",)]
    assert len(commits) == 1 and syncs, calls
    assert max(writes) < syncs[0] < commits[0], calls


class StandInCuda:
    """What `after_caller_stream` uses of torch.cuda; each thread has its own current
    stream (as each thread's default stream), named after the thread."""

    def __init__(self) -> None:
        self.log = []
        cuda = self

        class Event:
            def record(self, stream) -> None:
                cuda.log.append(("record", stream.thread, self))

        self.Event = Event

    def current_stream(self, device):
        cuda, thread = self, threading.current_thread().name

        class Stream:
            def wait_event(self, event) -> None:
                cuda.log.append(("wait", thread, event, device))

        stream = Stream()
        stream.thread = thread
        self.log.append(("current_stream", thread, device))
        return stream


def test_copy_threads_wait_for_an_event_recorded_on_the_callers_stream():
    cuda = StandInCuda()
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 1))
    wait = after_caller_stream(None, torch.zeros(1), on_gpu, cuda=cuda)
    caller = threading.current_thread().name
    assert [entry[:2] for entry in cuda.log] == [("current_stream", caller), ("record", caller)]
    event = cuda.log[1][2]
    thread = threading.Thread(target=wait, name="copy-thread")
    thread.start()
    thread.join()
    assert cuda.log[2:] == [("current_stream", "copy-thread", torch.device("cuda", 1)),
                            ("wait", "copy-thread", event, torch.device("cuda", 1))]


def test_cpu_tensors_need_no_stream_order():
    cuda = types.SimpleNamespace()  # any use of it would raise AttributeError
    wait = after_caller_stream(torch.zeros(1), None, cuda=cuda)
    wait()


def test_a_background_store_waits_for_the_callers_stream_on_each_copy_thread(
        daemon, monkeypatch):
    layout = small_layout()
    tokens = list(range(4 * CHUNK))
    log = []

    def stand_in_order(*tensors):
        log.append(("record", threading.current_thread().name))

        def wait() -> None:
            log.append(("wait", threading.current_thread().name))
        return wait

    write = RecordIO.write

    def logged_write(self, *args):
        log.append(("write", threading.current_thread().name))
        write(self, *args)

    monkeypatch.setattr(engine_module, "after_caller_stream", stand_in_order)
    monkeypatch.setattr(RecordIO, "write", logged_write)
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True,
                             copy_threads=2) as engine:
        assert engine.store(tokens, prompt_kv(layout, tokens), blocking=False) == 0
        assert engine.flush() == 4
    caller = threading.current_thread().name
    assert log[0] == ("record", caller) and [e for e in log if e[0] == "record"] == [log[0]]
    writes = [i for i, (kind, _) in enumerate(log) if kind == "write"]
    assert len(writes) == 4
    for i in writes:  # each chunk's copy thread waited just before it copied
        thread = log[i][1]
        assert thread != caller
        before = [entry for entry in log[:i] if entry[1] == thread]
        assert before[-1] == ("wait", thread), log


def test_a_retrieve_into_out_waits_for_the_callers_stream_on_each_copy_thread(
        daemon, monkeypatch):
    layout = small_layout()
    tokens = list(range(4 * CHUNK))
    expected = prompt_kv(layout, tokens)
    log = []

    def stand_in_order(*tensors):
        log.append(("record", threading.current_thread().name, tensors))

        def wait() -> None:
            log.append(("wait", threading.current_thread().name))
        return wait

    copy_record = retrieve.copy_record

    def logged_copy_record(*args):
        log.append(("copy", threading.current_thread().name))
        copy_record(*args)

    with CacheEngine.connect(layout, socket=daemon.socket, strict=True,
                             copy_threads=2) as engine:
        assert engine.store(tokens, expected) == 4
        monkeypatch.setattr(engine_retrieve, "after_caller_stream", stand_in_order)
        monkeypatch.setattr(retrieve, "copy_record", logged_copy_record)
        out = torch.empty_like(expected)
        kv, mask = engine.retrieve(tokens, return_tuple=False, out=out)
    assert int(mask.sum()) == len(tokens) and torch.equal(kv, expected)
    caller = threading.current_thread().name
    assert len(log[0]) == 3 and log[0][:2] == ("record", caller) and log[0][2][0] is out
    copies = [i for i, entry in enumerate(log) if entry[0] == "copy"]
    assert len(copies) == 4
    for i in copies:  # each chunk's copy thread waited just before it copied
        thread = log[i][1]
        before = [entry for entry in log[:i] if entry[1] == thread]
        assert before[-1] == ("wait", thread), log


def test_device_tier_records_carry_the_chains_fingerprint(unique_name):
    layout = small_layout()
    arena = Arena.create(unique_name, HEADER_BYTES + 4 * 65536, 65536, prefault=False)
    try:
        tier = types.SimpleNamespace(u8=torch.zeros(4 * 65536, dtype=torch.uint8),
                                     num_blocks=4, block_bytes=65536)
        chain = Chain(link=None, layout=layout, fingerprint=layout.fingerprint ^ 0x5A5A)
        records = chain.records(types.SimpleNamespace(arena=arena, tiers={1: tier}))
        assert isinstance(records.by_tier[1], DeviceRecordIO)
        assert records.by_tier[1].fingerprint == records.by_tier[0].fingerprint \
            == layout.fingerprint ^ 0x5A5A
        tokens = np.arange(CHUNK, dtype=np.int64)
        records.by_tier[1].write_with([2], b"\x01" * 16, tokens, lambda dst: dst.zero_())
        assert records.by_tier[1].verify([2], b"\x01" * 16, tokens, chain.fingerprint)
    finally:
        arena.close()
