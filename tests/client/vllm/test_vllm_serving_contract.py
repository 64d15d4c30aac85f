"""The serving core's contract (tests/client/serving/serving_contract.py) through the vLLM glue:
the scheduler driven by vLLM's hook names with stand-ins for Request, KVCacheBlocks and
SchedulerOutput, the workers copying through `PagedBlocks`. Runs without vllm installed.
"""

import dataclasses
import types

import torch

from lmcached.client.vllm.scheduler import LMCachedConnectorScheduler
from lmcached.client.vllm.worker import LMCachedConnectorWorker
from serving_contract import (
    CHUNK,
    PAGE_BYTES,
    EngineHarness,
    FakeRequest,
    ServingContract,
    make_settings,
    random_caches,
)


@dataclasses.dataclass
class VllmRequest(FakeRequest):
    """The attributes of vllm.v1.request.Request the scheduler side reads."""

    lora_request: object = None
    mm_features: list | None = None


class VllmGlue(EngineHarness):
    """The contract's calls as vLLM makes them."""

    def request(self, req_id, tokens, cache_salt=None):
        return VllmRequest(req_id, [int(t) for t in tokens], cache_salt)

    def scheduler(self, settings):
        return LMCachedConnectorScheduler(settings)

    def lookup(self, scheduler, request, num_computed_tokens):
        return scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def allocate(self, scheduler, request, block_ids, num_external_tokens):
        blocks = types.SimpleNamespace(get_block_ids=lambda: ([*block_ids],))
        scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def plan_step(self, scheduler, num_scheduled_tokens, block_ids):
        block_state = (None if block_ids is None else types.SimpleNamespace(
            get_block_ids=lambda req_id: ([*block_ids[req_id]],)))
        return scheduler.build_step(types.SimpleNamespace(
            num_scheduled_tokens=num_scheduled_tokens, kv_connector_block_state=block_state))

    def report(self, scheduler, loaded_steps, failed_chunks):
        scheduler.on_worker_report(loaded_steps, failed_chunks)

    def finish(self, scheduler, request):
        scheduler.request_finished(request)

    def worker(self, settings, rank, caches: list[torch.Tensor]):
        worker = LMCachedConnectorWorker(settings, rank)
        names = [f"model.layers.{i}.attn" for i in range(len(caches))]
        worker.register(dict(zip(names, caches)), names, {name: "TEST" for name in names},
                        PAGE_BYTES)
        return worker


class TestVllmGlue(ServingContract):
    harness = VllmGlue()


def test_lora_multimodal_and_embedding_requests_are_not_cached(daemon):
    # Their KV is not a function of the token ids alone: no lookup, no pins, no plan.
    tokens = list(range(2 * CHUNK + 1))
    harness = VllmGlue()
    TestVllmGlue().compute_and_save(daemon.socket, tokens, [random_caches(0)], list(range(5)))
    scheduler = harness.scheduler(make_settings(daemon.socket, 1))
    try:
        requests = [harness.request("lora", tokens), harness.request("mm", tokens),
                    harness.request("embeds", tokens)]
        requests[0].lora_request = object()
        requests[1].mm_features = [object()]
        requests[2].prompt_embeds = torch.zeros(len(tokens), 4)
        for request in requests:
            assert harness.lookup(scheduler, request, 0) == 0
            harness.allocate(scheduler, request, list(range(5)), 0)
        assert daemon.pins_held() == 0
        assert harness.plan_step(scheduler, {r.request_id: 1 for r in requests}, None)[1] == []
        plain = harness.request("plain", tokens)
        assert harness.lookup(scheduler, plain, 0) == 2 * CHUNK  # the same prompt, cacheable
        harness.finish(scheduler, plain)
    finally:
        scheduler.shutdown()
