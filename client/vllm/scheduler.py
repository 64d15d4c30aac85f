"""The vLLM connector's scheduler side: vLLM's scheduler hooks as calls into the serving core.

Why this file exists: the pinned lookups, step pins, epochs and worker reports are the
engine-neutral `ServingScheduler` (client/serving/scheduler.py); what is vLLM's is here:
which requests can be cached (not LoRA, multimodal or prompt-embedding requests), where
vLLM keeps a request's block ids (`KVCacheBlocks.get_block_ids()`, the scheduler output's
`kv_connector_block_state`), and the hook names. vllm-free: vLLM objects (Request,
KVCacheBlocks, SchedulerOutput) are read through the attributes vLLM 0.32 and 0.33 give
them; a vLLM `Request` is the core's `RequestView` as it is.
"""

from lmcached.client.serving.scheduler import ServingScheduler
from lmcached.client.serving.specs import ConnectorSettings, LoadSpec, SaveSpec


def cacheable(request) -> bool:
    """Whether lmcached may cache `request` (a vLLM Request): not when it has no prompt
    token ids, a LoRA adapter, multimodal inputs or prompt embeddings (their KV is not a
    function of the token ids alone)."""
    return not (request.prompt_token_ids is None or request.lora_request is not None
                or request.mm_features
                or getattr(request, "prompt_embeds", None) is not None)


class LMCachedConnectorScheduler(ServingScheduler):
    """Scheduler-side state of LMCachedConnector: the serving core under vLLM's hook names.

    Args:
        settings: the connector's settings (layouts of every rank, sizes, daemon).
    """

    def __init__(self, settings: ConnectorSettings) -> None:
        super().__init__(settings, "vllm-scheduler")

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond vLLM's own hit that lmcached holds, pinned until vLLM allocates
        (`ServingScheduler.lookup`); 0 for a request that cannot be cached."""
        if not cacheable(request):
            return 0
        return self.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Plan the load of the chunks vLLM now expects into the blocks it allocated
        (`ServingScheduler.allocate`; `blocks` is vLLM's KVCacheBlocks, one group)."""
        if not cacheable(request):
            return
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self.allocate(request, block_ids, num_external_tokens)

    def build_step(self, scheduler_output) -> tuple[int, list[LoadSpec], list[SaveSpec]]:
        """This step's number, loads and saves for every worker (`ServingScheduler.plan_step`),
        from vLLM's SchedulerOutput."""
        block_state = scheduler_output.kv_connector_block_state
        block_ids_of = (None if block_state is None
                        else lambda req_id: block_state.get_block_ids(req_id)[0])
        return self.plan_step(scheduler_output.num_scheduled_tokens, block_ids_of)

    def request_finished(self, request) -> None:
        """Forget the request; unpin a load that never reached a step."""
        self.finish(request.request_id)
