"""`CudaVmmMemory.register_host` / `unregister_host` (shm/cuda_driver.py) without a GPU:
over a stand-in `cuda.bindings.driver` with cuda-bindings 13.5's signatures
(`cuMemHostRegister(p, bytesize, Flags)`, `cuMemHostUnregister(p)`, each returning a
`(CUresult,)` tuple), the calls made, their arguments and order (the tier's context made
current first: the demotion worker and the loop have none), and a refusal as a CudaError."""

import enum
import importlib
import sys
import types

import numpy as np
import pytest

import lmcached.shm


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2


class StandInDriver(types.ModuleType):
    """The calls `register_host` and `unregister_host` make, logged; the registration
    answers `register_result`."""

    CU_MEMHOSTREGISTER_PORTABLE = 1

    def __init__(self) -> None:
        super().__init__("cuda.bindings.driver")
        self.CUresult = CUresult
        self.calls = []
        self.register_result = CUresult.CUDA_SUCCESS

    def cuGetErrorName(self, result):
        return CUresult.CUDA_SUCCESS, CUresult(int(result)).name.encode()

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("cuCtxSetCurrent", ctx))
        return (CUresult.CUDA_SUCCESS,)

    def cuMemHostRegister(self, p, bytesize, flags):
        self.calls.append(("cuMemHostRegister", p, bytesize, flags))
        return (self.register_result,)

    def cuMemHostUnregister(self, p):
        self.calls.append(("cuMemHostUnregister", p))
        return (CUresult.CUDA_SUCCESS,)


@pytest.fixture
def driver(monkeypatch):
    """shm/cuda_driver.py imported over the stand-in (and forgotten after the test)."""
    stand_in = StandInDriver()
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = stand_in
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, module in (("cuda", cuda), ("cuda.bindings", bindings),
                         ("cuda.bindings.driver", stand_in)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(lmcached.shm, "cuda_driver", None, raising=False)  # undone after
    previous = sys.modules.pop("lmcached.shm.cuda_driver", None)
    try:
        yield importlib.import_module("lmcached.shm.cuda_driver"), stand_in
    finally:
        sys.modules.pop("lmcached.shm.cuda_driver", None)
        if previous is not None:
            sys.modules["lmcached.shm.cuda_driver"] = previous


def memory_of(module):
    """A CudaVmmMemory as `_create` leaves it, as far as host registration reads it."""
    memory = module.CudaVmmMemory.__new__(module.CudaVmmMemory)
    memory._ctx = "primary-context-of-device-0"
    return memory


def test_register_host_page_locks_the_array_for_every_context(driver):
    module, cu = driver
    memory = memory_of(module)
    host = np.zeros(3 << 20, dtype=np.uint8)[4096:]  # the arena's blocks after its header
    memory.register_host(host)
    memory.unregister_host(host)
    assert cu.calls == [
        ("cuCtxSetCurrent", "primary-context-of-device-0"),
        ("cuMemHostRegister", host.ctypes.data, host.nbytes, cu.CU_MEMHOSTREGISTER_PORTABLE),
        ("cuCtxSetCurrent", "primary-context-of-device-0"),
        ("cuMemHostUnregister", host.ctypes.data),
    ]


def test_a_refused_registration_is_a_cuda_error_naming_the_call(driver):
    module, cu = driver
    cu.register_result = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(module.CudaError, match="cuMemHostRegister") as caught:
        memory_of(module).register_host(np.zeros(4096, dtype=np.uint8))
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(caught.value)
