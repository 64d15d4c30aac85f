#!/usr/bin/env bash
# The GPU checks of issue 13, on the device machine (one H100/H200; Python 3.12 with torch
# and cuda-bindings, no network), with the wheels `make gpu-wheels` put in .whl/:
#
#   run(command="bash benchmarks/gpu_window.sh tests", carry=[".whl"], timeout_s=540)
#   run(command="bash benchmarks/gpu_window.sh bench", carry=[".whl"], timeout_s=540)
#
# lmcached is installed into /tmp/site and imported from there (the repository's folders
# are not an importable package); results go to $OUT.
set -euo pipefail
what="${1:?usage: gpu_window.sh tests|bench}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
python3 -m pip install --quiet --no-index --no-deps --target /tmp/site "$repo"/.whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp
{
  nvidia-smi || true
  python3 -c 'import sys, torch, lmcached; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0)); print("lmcached", lmcached.__file__)'
  python3 -c 'import cuda.bindings; print("cuda-bindings", cuda.bindings.__version__)' || true
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
case "$what" in
  tests)
    python3 -m pytest -p no:cacheprovider --rootdir "$repo" -x -q \
      --junitxml "$out/gpu-tests.xml" \
      "$repo/tests/test_gpu_tier.py" "$repo/tests/test_cuda.py" "$repo/tests/test_checksum.py" \
      "$repo/tests/test_vllm_worker.py" "$repo/tests/test_blend_hf.py" -m cuda
    ;;
  bench)
    python3 "$repo/benchmarks/bench_cuda.py" 2>&1 | tee "$out/bench_cuda.txt" || true
    python3 "$repo/benchmarks/bench_vllm_worker.py" --device cuda 2>&1 \
      | tee "$out/bench_vllm_worker.txt" || true
    ;;
  *) echo "usage: gpu_window.sh tests|bench" >&2; exit 2 ;;
esac
