"""The vLLM connector, measured (under the vLLM venv, except the worker's copy benchmark)."""
