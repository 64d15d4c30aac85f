#!/usr/bin/env bash
# The GPU checks, on the device machine (one H100/H200; Python 3.12 with torch, pytest and
# cuda-bindings, no network), with the wheels `make gpu-wheels` put in .whl/. Two calls,
# each under 6 minutes:
#
#   run(command="bash benchmarks/gpu_window.sh tests", carry=[".whl"], timeout_s=420)
#   run(command="bash benchmarks/gpu_window.sh bench", carry=[".whl"], timeout_s=420)
#
# and one dry run anywhere, without a GPU and without installing (CI runs it:
# tests/ops/test_gpu_window.py):
#
#   bash benchmarks/gpu_window.sh collect
#
# tests: every test marked `cuda` in tests/, found by marker (never by a list of files),
#   each test FILE in its own pytest process under `timeout`, so one failure, hang or
#   crash hides nothing; no -x. Results: $OUT/gpu-tests.xml (every file's JUnit XML in
#   one <testsuites>: the device tool brings back at most 8 files), $OUT/tests.log,
#   $OUT/tests-summary.txt (one line per file: rc, seconds).
# bench: benchmarks.engine.bench_cuda and benchmarks.vllm.bench_vllm_worker --device cuda,
#   sized to a minute or two, run as modules (`python -m`) with the repository on PYTHONPATH
#   after /tmp/site.
# collect: the cuda-marked tests collected and the GPU benchmarks imported on this
#   machine's CPU, with whatever python $PYTHON names; fails on a stale path, a collection
#   error or an import error, and prints "cuda tests: N in F files".
#
# On the device machine lmcached is installed into /tmp/site and imported from there (the
# repository's folders are not an importable package); results go to $OUT.
set -euo pipefail
what="${1:?usage: gpu_window.sh collect|tests|bench}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-/tmp/gpu-out}"
py="${PYTHON:-python3}"
# The GPU benchmarks the bench mode runs, as modules under benchmarks/ (collect imports
# each; tests name others).
read -r -a benches <<< "${GPU_WINDOW_BENCHES:-engine.bench_cuda vllm.bench_vllm_worker}"
# Seconds: one test file at most, and every file of a tests run together (the call's
# limit is 6 minutes, the install and environment report included).
file_timeout_s="${GPU_WINDOW_FILE_TIMEOUT_S:-150}"
tests_budget_s="${GPU_WINDOW_TESTS_BUDGET_S:-290}"
bench_timeout_s="${GPU_WINDOW_BENCH_TIMEOUT_S:-150}"

# The cuda-marked test ids under tests/, one per line (pytest's own selection).
cuda_test_ids() {
  "$py" -m pytest -p no:cacheprovider --rootdir "$repo" --collect-only -q -m cuda \
    "$repo/tests" > /tmp/gpu-window-collect.txt 2>&1 || {
    cat /tmp/gpu-window-collect.txt >&2
    echo "gpu_window.sh: collecting the cuda-marked tests failed (above)" >&2
    return 1
  }
  grep '::' /tmp/gpu-window-collect.txt || true
}

case "$what" in
  collect)
    cd "$repo"
    for bench in "${benches[@]}"; do
      file="benchmarks/${bench//.//}.py"
      [ -f "$repo/$file" ] || { echo "gpu_window.sh: $file is gone" >&2; exit 1; }
      PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "import benchmarks.$bench" \
        || { echo "gpu_window.sh: $file does not import" >&2; exit 1; }
    done
    ids="$(cuda_test_ids)"
    count="$(printf '%s\n' "$ids" | grep -c '::' || true)"
    if [ "$count" -eq 0 ]; then
      echo "gpu_window.sh: no cuda-marked test collected" >&2
      exit 1
    fi
    files="$(printf '%s\n' "$ids" | cut -d: -f1 | sort -u)"
    printf '%s\n' "$ids"
    echo "benchmarks imported: ${benches[*]}"
    echo "cuda tests: $count in $(printf '%s\n' "$files" | wc -l) files"
    exit 0
    ;;
  tests|bench) ;;
  *) echo "usage: gpu_window.sh collect|tests|bench" >&2; exit 2 ;;
esac

mkdir -p "$out"
"$py" -m pip install --quiet --no-index --no-deps --target /tmp/site "$repo"/.whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp
{  # every line even when one fails: the report is what explains a failed run
  nvidia-smi || true
  "$py" -c 'import sys, torch, lmcached; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0)); print("lmcached", lmcached.__file__)' || true
  "$py" -c 'import cuda.bindings; print("cuda-bindings", cuda.bindings.__version__)' || true
  "$py" -c 'import transformers; print("transformers", transformers.__version__)' || true
  echo "id: $(id)"
  echo "ulimit -l: $(ulimit -l)"
  df -h /dev/shm || true
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

if [ "$what" = bench ]; then
  # A minute or two each: the shortest prompt lengths that still show the copy rates.
  # lmcached from /tmp/site (listed first), the benchmarks package from the repository.
  export PYTHONPATH="/tmp/site:$repo"
  timeout -k 5 "$bench_timeout_s" "$py" -m benchmarks.engine.bench_cuda --tokens 4096 16384 \
    --repeat 3 2>&1 | tee "$out/bench_cuda.txt" || echo "bench_cuda: rc ${PIPESTATUS[0]}"
  timeout -k 5 "$bench_timeout_s" "$py" -m benchmarks.vllm.bench_vllm_worker --device cuda \
    --tokens 4096 16384 --repeat 3 2>&1 | tee "$out/bench_vllm_worker.txt" \
    || echo "bench_vllm_worker: rc ${PIPESTATUS[0]}"
  exit 0
fi

# tests: one pytest process per file, each under `timeout`, within the budget. A test
# module that does not import there (another transformers, say) is listed as such, and
# every other file still runs.
start_s=$SECONDS
: > "$out/tests-summary.txt"
failed=0
"$py" -m pytest -p no:cacheprovider --rootdir "$repo" --collect-only -q -m cuda \
  --continue-on-collection-errors "$repo/tests" > /tmp/gpu-window-collect.txt 2>&1 || true
if grep -q '^ERROR ' /tmp/gpu-window-collect.txt; then
  grep '^ERROR ' /tmp/gpu-window-collect.txt | sed 's/$/ (collection error: see tests.log)/' \
    | tee -a "$out/tests-summary.txt"
  cat /tmp/gpu-window-collect.txt >> "$out/tests.log"
  failed=1
fi
# tests/client/vllm first, then tests/system, ..., the rest of tests/client
collected="$(grep '::' /tmp/gpu-window-collect.txt | cut -d: -f1 | sort -ru)"
files="$(grep '^tests/client/vllm/' <<<"$collected" || true)
$(grep -v '^tests/client/vllm/' <<<"$collected" || true)"
junit=/tmp/gpu-window-junit
rm -rf "$junit" && mkdir -p "$junit"
for file in $files; do
  left_s=$((tests_budget_s - (SECONDS - start_s)))
  if [ "$left_s" -lt 20 ]; then
    echo "$file rc=- not run: the ${tests_budget_s}s budget is spent" | tee -a "$out/tests-summary.txt"
    failed=1
    continue
  fi
  limit_s=$((left_s < file_timeout_s ? left_s : file_timeout_s))
  name="$(echo "$file" | tr '/' '_')"
  began_s=$SECONDS
  set +e
  timeout -k 5 "$limit_s" "$py" -m pytest -p no:cacheprovider --rootdir "$repo" -q -rA \
    -m cuda --junitxml "$junit/$name.xml" "$repo/$file" 2>&1 | tee -a "$out/tests.log"
  rc=${PIPESTATUS[0]}
  set -e
  echo "$file rc=$rc $((SECONDS - began_s))s$([ "$rc" -ge 124 ] && echo " (timed out at ${limit_s}s)")" \
    | tee -a "$out/tests-summary.txt"
  [ "$rc" -eq 0 ] || failed=1
done
"$py" - "$junit" "$out/gpu-tests.xml" <<'EOF'
import glob, sys
import xml.etree.ElementTree as ET

merged = ET.Element("testsuites")
for path in sorted(glob.glob(f"{sys.argv[1]}/*.xml")):
    root = ET.parse(path).getroot()
    for suite in ([root] if root.tag == "testsuite" else list(root)):
        suite.set("name", path.rsplit("/", 1)[-1].removesuffix(".xml"))
        merged.append(suite)
ET.ElementTree(merged).write(sys.argv[2], encoding="utf-8", xml_declaration=True)
EOF
cat "$out/tests-summary.txt"
exit "$failed"
