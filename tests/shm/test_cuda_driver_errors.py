"""The GPU tier's start-up errors without a GPU: shm/cuda_driver.py over a fake
`cuda.bindings.driver` whose `cuGetErrorName` takes only a CUresult (as cuda-bindings 13.5:
a string raises ValueError). Every failure becomes one `DeviceTierError` line that names
the cause and the fix, and what was created is released."""

import enum
import sys
import types

import pytest

from lmcached.config import ConfigError, load_config
from lmcached.shm import device_memory
from lmcached.shm.device_memory import DeviceTierError

MiB = 1 << 20


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_DEVICE = 100


class FakeDriver(types.ModuleType):
    """The driver calls CudaVmmMemory makes, up to the first that the test makes fail."""

    def __init__(self, granularity=2 * MiB, free=80 << 30, init=CUresult.CUDA_SUCCESS):
        super().__init__("cuda.bindings.driver")
        self.CUresult = CUresult
        self.calls = []
        self._granularity, self._free, self._init = granularity, free, init
        names = ("CUdevice_attribute", "CUmemAllocationType", "CUmemLocationType",
                 "CUmemAllocationHandleType", "CUmemAllocationGranularity_flags",
                 "CUmemAccess_flags", "CUstream_flags")
        for name in names:
            setattr(self, name, _AnyAttribute())

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append(name)
            return getattr(self, f"_{name}", lambda *a: (CUresult.CUDA_SUCCESS, 1))(*args)
        return call

    def cuGetErrorName(self, result):
        return CUresult.CUDA_SUCCESS, CUresult(int(result)).name.encode()  # int("...") raises

    def CUmemAllocationProp(self):
        return types.SimpleNamespace(location=types.SimpleNamespace())

    def _cuInit(self, flags):
        if self._init is None:  # as cuda-bindings where no libcuda.so can be found
            raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found '
                               'via system search.')
        return (self._init,)

    def _cuDeviceGetUuid(self, device):
        return CUresult.CUDA_SUCCESS, types.SimpleNamespace(bytes=bytes(range(16)))

    def _cuMemGetAllocationGranularity(self, prop, flags):
        return CUresult.CUDA_SUCCESS, self._granularity

    def _cuMemGetInfo(self):
        return CUresult.CUDA_SUCCESS, self._free, 80 << 30


class _AnyAttribute:
    def __getattr__(self, name):
        return name


@pytest.fixture
def fake_driver(monkeypatch):
    """Install a fake cuda-bindings; `fake_driver(**kwargs)` sets its behaviour."""
    def install(**kwargs):
        driver = FakeDriver(**kwargs)
        bindings = types.ModuleType("cuda.bindings")
        bindings.driver = driver
        cuda = types.ModuleType("cuda")
        cuda.bindings = bindings
        monkeypatch.setitem(sys.modules, "cuda", cuda)
        monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
        monkeypatch.delitem(sys.modules, "lmcached.shm.cuda_driver", raising=False)
        return driver
    yield install
    sys.modules.pop("lmcached.shm.cuda_driver", None)  # never keep the fake-bound module


def test_a_tier_below_the_granularity_is_one_line_naming_it(fake_driver):
    driver = fake_driver(granularity=2 * MiB)
    with pytest.raises(DeviceTierError) as caught:
        device_memory._cuda_memory(0, 1 * MiB)
    message = str(caught.value)
    assert message == ("GPU tier on CUDA device 0: cuMemCreate: 1.00M is less than the "
                       "device's CUDA VMM allocation granularity (2.00M): use "
                       "--gpu-capacity 2MiB or more")
    assert "\n" not in message
    assert "cuDevicePrimaryCtxRelease" in driver.calls  # the retained context is released
    assert "cuMemCreate" not in driver.calls


def test_too_little_free_memory_is_one_line_with_the_fix(fake_driver):
    fake_driver(free=1 * MiB)
    with pytest.raises(DeviceTierError, match=r"^GPU tier on CUDA device 0: cuMemGetInfo: "
                       r"device 0 has 1\.00M free, 64\.00M asked: lower --gpu-capacity"):
        device_memory._cuda_memory(0, 64 * MiB)


def test_a_failed_driver_call_names_the_call_and_its_curesult(fake_driver):
    fake_driver(init=CUresult.CUDA_ERROR_NO_DEVICE)
    with pytest.raises(DeviceTierError,
                       match=r"^GPU tier on CUDA device 3: cuInit failed: CUDA_ERROR_NO_DEVICE$"):
        device_memory._cuda_memory(3, 64 * MiB)


def test_no_nvidia_driver_is_one_line_not_a_loader_traceback(fake_driver):
    fake_driver(init=None)
    with pytest.raises(DeviceTierError, match=r"^GPU tier on CUDA device 0: cuInit: the NVIDIA "
                       r"driver cannot be loaded \(.*\): run where the driver is installed, "
                       r"or start without --gpu-capacity$"):
        device_memory._cuda_memory(0, 64 * MiB)


def test_cuda_error_takes_a_curesult_or_a_message(fake_driver):
    fake_driver()
    from lmcached.shm.cuda_driver import CudaError

    by_code = CudaError("cuMemCreate", CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    assert (str(by_code), by_code.code) == ("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY",
                                            "CUDA_ERROR_OUT_OF_MEMORY")
    by_message = CudaError("cuDeviceGetAttribute", "not supported")
    assert (str(by_message), by_message.code) == ("cuDeviceGetAttribute: not supported", None)


def test_the_config_refuses_a_cuda_tier_below_2mib_and_a_fake_one_takes_it():
    with pytest.raises(ConfigError, match=r"^GPU tier 1MiB \(--gpu-capacity\) is less than "
                       r"2MiB, the smallest CUDA VMM allocation granularity .*use "
                       r"--gpu-capacity 2MiB or more$"):
        load_config({"gpu_capacity": "1MiB"}, check_shm_free=False)
    assert load_config({"gpu_capacity": "2MiB"},
                       check_shm_free=False).gpu_capacity_bytes == 2 * MiB
    assert load_config({"gpu_capacity": "1MiB", "gpu_backend": "fake"},
                       check_shm_free=False).gpu_capacity_bytes == MiB
