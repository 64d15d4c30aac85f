"""What the vLLM connector's scheduler and workers send each other once a step.

Why this file exists: vLLM pickles the scheduler's `KVConnectorMetadata` to every worker
process before a step, and carries each worker's `KVConnectorWorkerMetadata` back,
aggregated over the TP ranks, with the step's output (client/vllm/connector.py's
`build_connector_meta`, `start_load_kv`, `build_connector_worker_meta`,
`update_connector_output`). Those two messages are the only state the roles share.
"""

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from lmcached.client.serving.specs import LoadSpec, SaveSpec
from lmcached.client.vllm.blend_params import BlendSpec


@dataclasses.dataclass
class LMCachedConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers (pickled to every worker process).

    `failed_loads`: req_id -> vLLM block ids vLLM was promised but the scheduler side
    could not plan the load of (a hook failed, `HookGuard`): every worker reports them
    as load errors (vLLM recomputes them) and saves nothing of that request this step.
    """

    step: int
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    blends: list[BlendSpec] = dataclasses.field(default_factory=list)
    failed_loads: dict[str, list[int]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class LMCachedWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, aggregated over TP ranks by vLLM.

    Attributes:
        loaded_steps: step -> number of ranks that finished (or failed) its loads.
        failed_chunks: req_id -> index of the first chunk whose load failed.
    """

    loaded_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    failed_chunks: dict[str, int] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "LMCachedWorkerMetadata":
        """Sum the ranks' loaded steps; keep the earliest failed chunk per request."""
        loaded = dict(self.loaded_steps)
        for step, count in other.loaded_steps.items():
            loaded[step] = loaded.get(step, 0) + count
        failed = dict(self.failed_chunks)
        for req_id, chunk in other.failed_chunks.items():
            failed[req_id] = min(chunk, failed.get(req_id, chunk))
        return LMCachedWorkerMetadata(loaded, failed)
