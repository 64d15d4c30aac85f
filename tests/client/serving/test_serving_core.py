"""The serving core (`lmcached.client.serving`) against a real daemon, driven by a fake
engine: the contract every engine's glue is held to (tests/client/serving/serving_contract.py),
and the core importing no engine. Runs without vllm installed.
"""

import subprocess
import sys

from serving_contract import EngineHarness, ServingContract

SERVING_MODULES = ("lmcached.client.serving.scheduler", "lmcached.client.serving.worker",
                   "lmcached.client.serving.specs", "lmcached.client.serving.mover",
                   "lmcached.client.serving.hook_guard")


class TestFakeEngine(ServingContract):
    harness = EngineHarness()


def test_the_serving_core_loads_no_engine_and_no_engine_glue():
    code = (f"import sys; import {', '.join(SERVING_MODULES)}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'transformers')"
            " or m.startswith(('lmcached.client.vllm', 'lmcached.client.hf'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout
