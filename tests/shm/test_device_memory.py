"""The daemon's device tier memory and its settings: --gpu-capacity, --gpu-device,
--gpu-backend; the fake (memfd) tier that CI runs; the one-line start-up error without
cuda-bindings; CUDA is never imported unless asked for."""

import os
import subprocess
import sys

import numpy as np
import pytest

from lmcached.shm import device_memory
from lmcached.config import ConfigError, load_config
from lmcached.shm.device_memory import DeviceTierError, FakeTierMemory, open_device_tiers
from lmcached.shm.arena import HEADER_BYTES, Arena


def config(**options):
    return load_config(options, check_shm_free=False)


def test_gpu_settings_default_to_device_0_and_read_lists():
    assert config().gpu_capacity_bytes == 0 and config().gpu_devices == ()
    cfg = config(gpu_capacity="64MiB")
    assert (cfg.gpu_capacity_bytes, cfg.gpu_devices, cfg.gpu_backend) == (64 << 20, (0,), "cuda")
    cfg = config(gpu_capacity="1GiB", gpu_device="1, 0", gpu_backend="fake")
    assert (cfg.gpu_devices, cfg.gpu_backend) == ((1, 0), "fake")
    assert cfg.as_dict()["gpu_devices"] == "1,0"


@pytest.mark.parametrize("options, message", [
    ({"gpu_device": "0"}, "without a GPU tier size: add --gpu-capacity"),
    ({"gpu_capacity": "64MiB", "gpu_device": "0,0"}, "distinct"),
    ({"gpu_capacity": "64MiB", "gpu_device": "gpu0"}, "device numbers"),
    ({"gpu_capacity": "64MiB", "gpu_device": ",".join(map(str, range(17)))}, "at most 16"),
    ({"gpu_capacity": "100KiB"}, "less than 1MiB"),
    ({"gpu_capacity": "64MiB", "gpu_backend": "rocm"}, "cuda"),
])
def test_bad_gpu_settings_are_refused_with_the_fix(options, message):
    with pytest.raises(ConfigError, match=message):
        config(**options)


def test_the_gpu_settings_come_from_the_environment_too(monkeypatch):
    monkeypatch.setenv("LMCACHED_GPU_CAPACITY", "2GiB")
    monkeypatch.setenv("LMCACHED_GPU_DEVICE", "3")
    cfg = config()
    assert (cfg.gpu_capacity_bytes, cfg.gpu_devices) == (2 << 30, (3,))


def test_a_fake_tier_is_an_anonymous_arena_shared_by_descriptor(unique_name):
    memory = FakeTierMemory(unique_name, 42, 0, HEADER_BYTES + 8 * 4096)
    try:
        assert (memory.kind, memory.device, memory.num_blocks) == ("fake", "fake-0", 0)
        memory.set_block_bytes(4096)
        assert memory.num_blocks == 8
        # Another process maps the descriptor and writes block 5.
        code = ("import os, sys; from lmcached.shm.arena import Arena; "
                f"a = Arena.from_fd(int(sys.argv[1]), 42, 4096, {HEADER_BYTES + 8 * 4096}); "
                "a.numpy_view(a.block_offset(5), 100)[:] = 7; a.close()")
        fd = memory.export_fd()
        subprocess.run([sys.executable, "-c", code, str(fd)], pass_fds=[fd], check=True)
        host = np.zeros(100, np.uint8)
        memory.copy_to_host(5, 100, host)
        assert (host == 7).all()
        assert not [n for n in os.listdir("/dev/shm") if unique_name in n]  # no name
    finally:
        memory.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_open_device_tiers_makes_one_per_device_and_undoes_a_failure(unique_name, monkeypatch):
    cfg = config(gpu_capacity="1MiB", gpu_device="0,1", gpu_backend="fake")
    memories = open_device_tiers(cfg, unique_name, 7)
    assert [m.device for m in memories] == ["fake-0", "fake-1"]
    fds = [m.export_fd() for m in memories]
    for memory in memories:
        memory.close()
    made = []

    class FailsOnSecond(FakeTierMemory):
        def __init__(self, name, generation, index, size_bytes):
            if index == 1:
                raise OSError("no memory for tier 1")
            super().__init__(name, generation, index, size_bytes)
            made.append(self)

    monkeypatch.setattr(device_memory, "FakeTierMemory", FailsOnSecond)
    with pytest.raises(OSError, match="tier 1"):
        open_device_tiers(cfg, unique_name, 7)
    assert len(made) == 1 and made[0].arena._mmap is None  # the first one was closed
    assert all(not os.path.exists(f"/proc/self/fd/{fd}") or fd in
               [m.arena._memfd for m in made] for fd in fds)


def test_without_cuda_bindings_the_cuda_backend_says_what_to_install(monkeypatch):
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):  # imported earlier, or not
        monkeypatch.setitem(sys.modules, name, None)  # import cuda... -> ImportError
    monkeypatch.delitem(sys.modules, "lmcached.shm.cuda_driver", raising=False)
    with pytest.raises(DeviceTierError, match=r"pip install '\.\[gpu\]' in a checkout of "
                       r"lmcached, or pip install 'lmcached\[gpu\]' from a package index"):
        open_device_tiers(config(gpu_capacity="64MiB"), "x", 1)


def test_serve_with_a_gpu_tier_but_no_cuda_bindings_is_one_error_line(short_tmp, unique_name):
    env = {**os.environ, "PYTHONPATH": short_tmp}
    with open(os.path.join(short_tmp, "cuda.py"), "w") as f:  # shadow any cuda-bindings
        f.write("raise ImportError('cuda-bindings is not installed (test)')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "lmcached.cli", "serve", "--name", unique_name,
         "--socket", os.path.join(short_tmp, "s.sock"), "--capacity", "16MiB",
         "--gpu-capacity", "64MiB"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "pip install '.[gpu]'" in errors[0], proc.stderr
    assert "pip install 'lmcached[gpu]'" in errors[0], proc.stderr
    assert not [n for n in os.listdir("/dev/shm") if unique_name in n]
    assert not os.path.exists(os.path.join(short_tmp, "s.sock"))


def test_the_daemon_imports_no_cuda_module_unless_a_cuda_tier_is_asked_for(unique_name):
    code = (
        "import sys\n"
        "from lmcached.config import load_config\n"
        "from lmcached.shm.device_memory import open_device_tiers\n"
        "import lmcached.daemon.server, lmcached.daemon.service\n"
        f"cfg = load_config({{'gpu_capacity': '1MiB', 'gpu_backend': 'fake'}}, "
        "check_shm_free=False)\n"
        f"for m in open_device_tiers(cfg, '{unique_name}', 1): m.close()\n"
        "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith(('cuda.', 'torch'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_an_arena_from_a_descriptor_refuses_another_generation(unique_name):
    arena = Arena.create_memfd(unique_name, 5, HEADER_BYTES + 4096, 4096)
    try:
        with pytest.raises(ValueError, match="generation 6"):
            Arena.from_fd(arena.export_fd(), 6, 4096, HEADER_BYTES + 4096)
        named = Arena.create(unique_name + "-named", HEADER_BYTES + 4096, prefault=False)
        with pytest.raises(ValueError, match="no descriptor to export"):
            named.export_fd()
        named.close()
    finally:
        arena.close()
