"""Demotion copies into page-locked memory (lmcached/daemon/demotion.py): a device tier
whose memory offers `register_host` (CUDA's, shm/cuda_driver.py) gets the host arena's
blocks page-locked once, on the demotion worker before its first copy (never in the
loop), and unregistered at close before the memory and the arena go; when that fails,
one warning and the smaller in-flight budget of pageable copies. In one process, with
host memory standing in for the device (tests/daemon/test_tiers.py's gated device).
"""

import logging
import threading

import pytest

from lmcached.daemon import demotion
from lmcached.daemon.demotion import (
    MAX_INFLIGHT_DEMOTION_BYTES,
    MAX_INFLIGHT_PAGEABLE_DEMOTION_BYTES,
)
from lmcached.daemon.server_config import ServerConfig
from lmcached.daemon.service import CacheService
from lmcached.shm.arena import HEADER_BYTES, Arena
from test_tiers import (
    BLOCK_BYTES,
    DEVICE,
    DEVICE_BLOCKS,
    HOST_BLOCKS,
    GatedDeviceMemory,
    drain_demotions,
    hello,
    write_and_commit,
)


class RegisteringDeviceMemory(GatedDeviceMemory):
    """A gated device that page-locks host memory as CUDA's does: every registration,
    unregistration and copy is logged in order, with its thread; registering can fail."""

    def __init__(self, name: str, num_blocks: int, refuse: bool) -> None:
        super().__init__(name, num_blocks)
        self.refuse = refuse
        self.calls = []

    def register_host(self, host) -> None:
        self.calls.append(("register", host.ctypes.data, host.nbytes,
                           threading.current_thread().name))
        if self.refuse:
            raise RuntimeError("cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY (test)")

    def unregister_host(self, host) -> None:
        self.calls.append(("unregister", host.ctypes.data, host.nbytes,
                           threading.current_thread().name))

    def copy_to_host(self, block_id, nbytes, dst) -> None:
        self.calls.append(("copy", threading.current_thread().name))
        super().copy_to_host(block_id, nbytes, dst)


@pytest.fixture(params=[False, True], ids=["registered", "refused"])
def registering(request, unique_name):
    arena = Arena.create(unique_name, HEADER_BYTES + HOST_BLOCKS * BLOCK_BYTES, BLOCK_BYTES,
                         prefault=False)
    device = RegisteringDeviceMemory(unique_name + "-dev", DEVICE_BLOCKS, request.param)
    service = CacheService(ServerConfig(name=unique_name, socket="/nonexistent"), arena,
                           [device])
    yield service, device, arena
    device.gate.set()
    service.close()
    device.close()
    arena.close()


def test_the_worker_page_locks_the_host_arena_before_its_first_copy(registering, caplog):
    service, device, arena = registering
    assert device.calls == []  # nothing in the loop
    assert service.demoter.max_inflight_bytes == MAX_INFLIGHT_PAGEABLE_DEMOTION_BYTES
    gpu, _ = hello(service, [DEVICE])
    with caplog.at_level(logging.WARNING, logger="lmcached.daemon.demotion"):
        write_and_commit(service, gpu, list(range(1, DEVICE_BLOCKS + 1)))
        drain_demotions(service)
    blocks = arena.numpy_view(HEADER_BYTES, arena.capacity_bytes - HEADER_BYTES)
    kind, address, nbytes, thread = device.calls[0]
    assert (kind, address, nbytes) == ("register", blocks.ctypes.data, blocks.nbytes)
    assert thread != threading.current_thread().name  # the demotion worker
    copies = device.calls[1:]
    assert copies and all(call == ("copy", thread) for call in copies)
    assert service.demoter.stats.demotions == len(copies)
    warnings = [r.getMessage() for r in caplog.records]
    if device.refuse:
        assert service.demoter.max_inflight_bytes == MAX_INFLIGHT_PAGEABLE_DEMOTION_BYTES
        assert len(warnings) == 1 and "could not be page-locked" in warnings[0]
        assert "CUDA_ERROR_OUT_OF_MEMORY (test)" in warnings[0] and "RLIMIT_MEMLOCK" in warnings[0]
    else:
        assert service.demoter.max_inflight_bytes == MAX_INFLIGHT_DEMOTION_BYTES
        assert warnings == []
    service.close()
    if device.refuse:
        assert device.calls[-1][0] == "copy"  # nothing registered: nothing to undo
    else:
        assert device.calls[-1][:3] == ("unregister", blocks.ctypes.data, blocks.nbytes)
    assert [call[0] for call in device.calls].count("register") == 1


@pytest.fixture
def small_budgets(monkeypatch):
    """In-flight budgets of 3 values (page-locked) and 1 value (pageable) of 1000 bytes."""
    monkeypatch.setattr(demotion, "MAX_INFLIGHT_DEMOTION_BYTES", 3 * 1000)
    monkeypatch.setattr(demotion, "MAX_INFLIGHT_PAGEABLE_DEMOTION_BYTES", 1000)


def test_pageable_copies_keep_fewer_bytes_in_flight(small_budgets, registering):
    service, device, _ = registering
    gpu, _ = hello(service, [DEVICE])
    write_and_commit(service, gpu, list(range(1, DEVICE_BLOCKS + 1)))
    drain_demotions(service)  # the first demotion registered the arena (or failed to)
    device.gate.clear()
    service.demoter.plan({1: DEVICE_BLOCKS // 2})  # wants 3 more values of 1000 bytes out
    assert sum(service.demoter.demoting_blocks) == (1 if device.refuse else 3)
    device.gate.set()
    drain_demotions(service)
    assert service.tiers.pools[1].num_empty_blocks == (2 if device.refuse else 4)
