"""The GPU tier's paths that tests/system/test_gpu_tier.py does not run, on a GPU
(benchmarks/gpu_window.sh tests): KV from host memory stored into the tier and read by
another process, a store that commits only after its host-to-device copies landed, a
store of KV written on the caller's non-default stream, views of the tier copied into a
pinned host buffer, and the tier's start-up errors as one line. Skipped without a CUDA
device and cuda-bindings."""

import os
import subprocess
import sys

import pytest
import torch

from lmcached.client import CacheEngine
from lmcached.client.tier_map import DeviceRecordIO

from engine_worker import prompt_kv, small_layout
from test_gpu_tier import CHUNK, _cuda_bindings, gpu_daemon, gpu_uuid, run_worker  # noqa: F401

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (torch.cuda.is_available() and _cuda_bindings()),
                       reason="needs a CUDA device and cuda-bindings (pip install 'lmcached[gpu]')"),
]

SLEEP_CYCLES = 700_000_000  # torch.cuda._sleep: ~0.2-0.5 s of a busy stream


def test_kv_from_host_memory_stored_into_the_gpu_tier_is_read_by_another_process(gpu_daemon):
    uuid = gpu_uuid(gpu_daemon.socket)
    cpu_kv = {"LMCACHED_TEST_KV_DEVICE": "cpu"}
    assert run_worker("store", gpu_daemon.socket, 0, 8 * CHUNK, 0, 1, device=uuid,
                      env_extra=cpu_kv)["stored"] == 8
    assert gpu_daemon.info()["tier1_cached_blocks"] == 8
    got = run_worker("retrieve", gpu_daemon.socket, 0, 8 * CHUNK, 0, 1, device=uuid)
    assert (got["hit"], got["mismatches"]) == (8 * CHUNK, 0)
    views = run_worker("views", gpu_daemon.socket, 0, 8 * CHUNK, device=uuid)
    assert (views["mismatches"], views["views_in_tier"]) == (0, 8)


def test_a_store_from_pinned_host_memory_commits_after_its_copies_landed(gpu_daemon,
                                                                          monkeypatch):
    uuid = gpu_uuid(gpu_daemon.socket)
    layout = small_layout()
    tokens = list(range(4 * CHUNK))
    kv = prompt_kv(layout, tokens).pin_memory()  # host-to-device copies truly asynchronous
    streams = []
    write_with = DeviceRecordIO.write_with

    def slow_write_with(self, span, chunk_hash, chunk_tokens, fill):
        def slow_fill(dst):
            streams.append(torch.cuda.current_stream(dst.device))
            torch.cuda._sleep(SLEEP_CYCLES)  # the KV copy queued behind it
            fill(dst)
        return write_with(self, span, chunk_hash, chunk_tokens, slow_fill)

    monkeypatch.setattr(DeviceRecordIO, "write_with", slow_write_with)
    with CacheEngine.connect(layout, socket=gpu_daemon.socket, strict=True,
                             tier_device=uuid) as engine:
        assert engine.store(tokens, kv) == 4
        # COMMIT made the chunks readable by every process: their bytes must be there.
        assert streams and all(s.query() for s in streams), \
            "the store committed before its host-to-device copies landed"
    assert gpu_daemon.info()["tier1_cached_blocks"] == 4
    got = run_worker("retrieve", gpu_daemon.socket, 0, 4 * CHUNK, 0, 1, device=uuid)
    assert (got["hit"], got["mismatches"]) == (4 * CHUNK, 0)


def test_kv_written_on_the_callers_side_stream_is_stored_into_the_gpu_tier_after_it(
        gpu_daemon):
    uuid = gpu_uuid(gpu_daemon.socket)
    layout = small_layout()
    tokens = list(range(4 * CHUNK))
    expected = prompt_kv(layout, tokens).cuda()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with CacheEngine.connect(layout, socket=gpu_daemon.socket, strict=True,
                             tier_device=uuid) as engine:
        with torch.cuda.stream(side):
            kv = torch.zeros_like(expected)
            torch.cuda._sleep(SLEEP_CYCLES)
            kv.copy_(expected)  # lands only after the sleep, on `side`
            assert engine.store(tokens, kv) == 4
    got = run_worker("retrieve", gpu_daemon.socket, 0, 4 * CHUNK, 0, 1, device=uuid)
    assert (got["hit"], got["mismatches"]) == (4 * CHUNK, 0), \
        "the store read the KV before the caller's stream wrote it"


def test_views_of_the_gpu_tier_copied_into_a_pinned_host_buffer_have_landed(gpu_daemon):
    uuid = gpu_uuid(gpu_daemon.socket)
    layout = small_layout()
    tokens = list(range(8 * CHUNK))
    expected = prompt_kv(layout, tokens)
    with CacheEngine.connect(layout, socket=gpu_daemon.socket, strict=True,
                             tier_device=uuid) as engine:
        assert engine.store(tokens, expected.cuda()) == 8
        out = torch.zeros(layout.chunk_shape(len(tokens)), dtype=layout.torch_dtype,
                          pin_memory=True)
        with engine.retrieve_views(tokens) as views:
            assert {c.device.type for c in views.chunks} == {"cuda"}
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)  # the copies queue behind it
            got = views.copy_to(out)
            assert torch.equal(got, expected), "copy_to returned before the copies landed"


def test_a_gpu_tier_below_the_vmm_granularity_is_one_error_line(short_tmp, unique_name):
    from lmcached.shm import device_memory
    from lmcached.shm.device_memory import DeviceTierError

    proc = subprocess.run(
        [sys.executable, "-m", "lmcached.cli", "serve", "--name", unique_name,
         "--socket", os.path.join(short_tmp, "s.sock"), "--capacity", "16MiB",
         "--gpu-capacity", "1MiB"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "CUDA VMM allocation granularity" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    # The device's own granularity, at start (past the config's 2MiB floor).
    with pytest.raises(DeviceTierError) as caught:
        device_memory._cuda_memory(0, 1 << 20)
    message = str(caught.value)
    assert "CUDA VMM allocation granularity (" in message and "\n" not in message, message
    with pytest.raises(DeviceTierError, match="free.*lower --gpu-capacity"):
        device_memory._cuda_memory(0, 1 << 50)
