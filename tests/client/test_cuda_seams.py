"""The CUDA paths' ordering and error handling, on CPU through seams: the GPU tier's
header gather (client/tier_map.py), the unmap of an imported tier, the arena's
page-locking (client/cuda.py) and `RetrievedViews.copy_to` (client/views.py). What the
seams stand for runs on a GPU in tests/client/test_cuda_paths.py and
tests/system/test_gpu_window_tier.py (benchmarks/gpu_window.sh tests)."""

import gc
import sys
import types

import numpy as np
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


class RecordingDriver(types.ModuleType):
    """cuda.bindings.driver whose every call is recorded in a shared list of events."""

    def __init__(self, events: list) -> None:
        super().__init__("cuda.bindings.driver")
        self.events = events

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)
        return lambda *args: self.events.append(name) or (0,)


def fake_cuda_bindings(monkeypatch, events: list) -> None:
    driver = RecordingDriver(events)
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
