"""The CUDA paths' ordering and error handling, on CPU through seams: the GPU tier's
header gather (client/tier_map.py), the unmap of an imported tier, the arena's
page-locking (client/cuda.py) and `RetrievedViews.copy_to` (client/views.py). What the
seams stand for runs on a GPU in tests/client/cuda/test_cuda_paths.py and
tests/system/test_gpu_window_tier.py (benchmarks/gpu_window.sh tests)."""

import gc
import sys
import types

import numpy as np
import pytest
import torch

from lmcached.client import KVLayout, hash_request_tokens
from lmcached.client import tier_map
from lmcached.client.tier_map import DeviceRecordIO

LAYOUT = KVLayout("seams", num_layers=2, num_kv_heads=2, head_size=16, chunk_size=16)
BLOCK_BYTES = 16384


class GatheredBytes(torch.Tensor):
    """A tensor that counts the bytes every `index_select` over it returns."""

    gathered: list[int] = []

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        out = super().__torch_function__(func, types_, args, kwargs or {})
        if func is torch.Tensor.index_select:
            cls.gathered.append(out.numel() * out.element_size())
        return out


def test_verify_prefix_gathers_the_header_rows_not_whole_blocks():
    tokens = np.arange(48, dtype=np.int64)
    hashes = hash_request_tokens(LAYOUT.chunk_size, tokens)
    chunks = [(0, 16), (16, 32), (32, 48)]
    tier = types.SimpleNamespace(u8=torch.zeros(8 * BLOCK_BYTES, dtype=torch.uint8),
                                 num_blocks=8, block_bytes=BLOCK_BYTES)
    records = DeviceRecordIO(tier, LAYOUT)
    for block, h, (s, e) in zip([6, 1, 4], hashes, chunks):
        kv = torch.randn(LAYOUT.chunk_shape(e - s)).to(LAYOUT.torch_dtype)
        records.write_with([block], h, tokens[s:e], lambda dst, kv=kv: dst.copy_(kv))
    records._blocks = records._blocks.as_subclass(GatheredBytes)
    GatheredBytes.gathered = []
    assert records.verify_prefix([[6], [1], [4]], hashes, tokens, chunks,
                                 LAYOUT.fingerprint) == 3
    header_bytes = records._header_bytes
    assert header_bytes < BLOCK_BYTES // 8
    assert GatheredBytes.gathered == [3 * header_bytes]  # not 3 * BLOCK_BYTES


class _Names:
    """Any attribute, e.g. `CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED`: its name."""

    def __getattr__(self, name):
        return name


class RecordingDriver(types.ModuleType):
    """cuda.bindings.driver whose every call is recorded in a shared list of events and
    succeeds with the value 1, except the call named `fails` (CUDA_ERROR_UNKNOWN, 999)."""

    def __init__(self, events: list, fails: str | None = None) -> None:
        super().__init__("cuda.bindings.driver")
        self.events = events
        self.fails = fails
        self.CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)

    def __getattr__(self, name):
        if name in ("CUmemAllocationProp", "CUmemAccessDesc"):
            return lambda: types.SimpleNamespace(location=types.SimpleNamespace())
        if name.startswith("CU"):
            return _Names()
        if name == "cuGetErrorName":
            return lambda result: (0, b"CUDA_ERROR_UNKNOWN")
        if not name.startswith("cu"):
            raise AttributeError(name)
        return lambda *args: self.events.append(name) or ((999,) if name == self.fails
                                                          else (0, 1))


def fake_cuda_bindings(monkeypatch, events: list, fails: str | None = None) -> None:
    driver = RecordingDriver(events, fails)
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, module in (("cuda", cuda), ("cuda.bindings", bindings),
                         ("cuda.bindings.driver", driver)):
        monkeypatch.setitem(sys.modules, name, module)


def test_an_imported_tier_is_unmapped_after_its_device_finished_and_in_its_context(
        monkeypatch):
    events = []
    fake_cuda_bindings(monkeypatch, events)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: events.append(f"synchronize({device})"))
    mapping = tier_map._Mapping(1 << 40, 2 << 20, 3, "dev3", "ctx3")
    del mapping
    gc.collect()
    assert events == ["synchronize(3)", "cuCtxPushCurrent", "cuMemUnmap", "cuMemAddressFree",
                      "cuCtxPopCurrent", "cuDevicePrimaryCtxRelease"]


def import_tier(monkeypatch, events: list, fails: str | None = None):
    """CudaTierMap over the recording driver, torch's CUDA calls stubbed."""
    from lmcached.wire.protocol import TierHandle, TierInfo

    fake_cuda_bindings(monkeypatch, events, fails)
    monkeypatch.delitem(sys.modules, "lmcached.shm.cuda_driver", raising=False)
    monkeypatch.setattr(tier_map, "local_device", lambda uuid: 0)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch, "as_tensor", lambda mapping, device: ("u8 of", mapping, device))
    info = types.SimpleNamespace(device="GPU-0", block_bytes=1 << 20, num_blocks=2)
    handle = types.SimpleNamespace(generation=5, size_bytes=2 << 20)
    try:
        return tier_map.CudaTierMap(info, handle, fd=9)
    finally:
        sys.modules.pop("lmcached.shm.cuda_driver", None)  # never keep the fake-bound module


def test_the_tier_is_imported_with_its_devices_primary_context_pushed(monkeypatch):
    events = []
    tier = import_tier(monkeypatch, events)
    assert events == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent",
                      "cuMemImportFromShareableHandle", "cuMemGetAllocationGranularity",
                      "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemRelease",
                      "cuCtxPopCurrent"]  # the context stays retained by the mapping
    _, mapping, device = tier.u8
    assert device == "cuda:0" and (mapping.ordinal, mapping.context) == (0, 1)
    events.clear()
    del tier, mapping
    gc.collect()  # the last view gone: unmapped in the context, which is then released
    assert events == ["cuCtxPushCurrent", "cuMemUnmap", "cuMemAddressFree", "cuCtxPopCurrent",
                      "cuDevicePrimaryCtxRelease"]


def test_a_failed_import_undoes_the_mapping_and_releases_the_context(monkeypatch):
    events = []
    with pytest.raises(Exception, match="^cuMemSetAccess failed: CUDA_ERROR_UNKNOWN$"):
        import_tier(monkeypatch, events, fails="cuMemSetAccess")
    assert events[events.index("cuMemSetAccess"):] == [
        "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease", "cuCtxPopCurrent",
        "cuDevicePrimaryCtxRelease"]


class FakeCudart:
    """torch.cuda.cudart() that records each call with the device current at the time."""

    def __init__(self, register_status: int) -> None:
        self.register_status = register_status
        self.calls = []
        self.current = None

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, self.current))
        return self.register_status

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr, self.current))
        return 0

    def cudaGetErrorString(self, status):
        return "out of memory"


class FakeRuntimeLibrary:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def cudaGetLastError(self):
        self.calls.append(("cudaGetLastError",))
        return 2


def fake_cuda_runtime(monkeypatch, register_status: int) -> FakeCudart:
    """torch.cuda as a process with 4 devices, current device 0, would show it."""
    from lmcached.client import cuda as client_cuda

    cudart = FakeCudart(register_status)

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.previous, cudart.current = cudart.current, self.index

        def __exit__(self, *exc):
            cudart.current = self.previous

    def current(index):
        cudart.calls.append(("context", index))
        return Device(index)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(client_cuda, "_device_current", current)
    monkeypatch.setattr(client_cuda, "_runtime_libraries",
                        lambda: (FakeRuntimeLibrary(cudart.calls),))
    monkeypatch.setattr(client_cuda, "_registered", {})
    return cudart


def stand_in_arena(base_ptr: int = 1 << 30):
    from lmcached.shm.arena import HEADER_BYTES

    return types.SimpleNamespace(base_ptr=base_ptr, capacity_bytes=HEADER_BYTES + (64 << 20))


def test_a_failed_registration_clears_the_runtime_error_and_is_not_unregistered(
        monkeypatch, caplog):
    from lmcached.client.cuda import register_arena, unregister_arena
    from lmcached.shm.arena import HEADER_BYTES

    cudart = fake_cuda_runtime(monkeypatch, register_status=2)  # cudaErrorMemoryAllocation
    arena = stand_in_arena()
    assert register_arena(arena, device="cuda:2") is False
    assert cudart.calls == [("context", 2), ("register", arena.base_ptr + HEADER_BYTES, 2),
                            ("cudaGetLastError",)]
    assert "cudaHostRegister of the" in caplog.text and "out of memory, 2" in caplog.text
    cudart.calls.clear()
    unregister_arena(arena)
    assert cudart.calls == []  # nothing was registered: nothing to undo


def test_registration_runs_in_the_named_devices_context_and_is_undone_there(monkeypatch):
    from lmcached.client.cuda import register_arena, unregister_arena
    from lmcached.shm.arena import HEADER_BYTES

    cudart = fake_cuda_runtime(monkeypatch, register_status=0)
    arena = stand_in_arena()
    ptr = arena.base_ptr + HEADER_BYTES
    assert register_arena(arena, device=torch.device("cuda", 3)) is True
    assert register_arena(arena, device=3) is True  # once per arena
    unregister_arena(arena)
    unregister_arena(arena)  # twice: undone once
    assert cudart.calls == [("context", 3), ("register", ptr, 3),
                            ("context", 3), ("unregister", ptr, 3)]
    other = stand_in_arena(2 << 30)
    assert register_arena(other) is True  # no device named: torch's current one
    assert cudart.calls[-1] == ("register", other.base_ptr + HEADER_BYTES, 0)


class ViewOnCuda1(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (a view of a GPU tier, for the copy's
    synchronization; the bytes are copied on the CPU)."""

    @property
    def device(self):
        return torch.device("cuda", 1)


def test_copy_to_a_host_buffer_waits_for_the_gpu_tier_views_device(monkeypatch):
    from lmcached.client.views import RetrievedViews

    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    chunks = [torch.full(LAYOUT.chunk_shape(16), float(i)).to(LAYOUT.torch_dtype)
              .as_subclass(ViewOnCuda1) for i in range(2)]
    views = RetrievedViews(chunks, [4, 9], 0, 32, release_fn=None)
    out = torch.zeros(LAYOUT.chunk_shape(32), dtype=LAYOUT.torch_dtype)  # host (pinned there)
    got = views.copy_to(out)
    assert synchronized == [torch.device("cuda", 1)]  # the source's device, once
    assert torch.equal(got.as_subclass(torch.Tensor)[:, :, 16:],
                       torch.ones(LAYOUT.chunk_shape(16), dtype=LAYOUT.torch_dtype))
