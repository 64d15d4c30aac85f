"""The scheduler side of CacheBlend inside vLLM: which prompts to claim, and when.

Why this file exists: a blend request (client/vllm/blend_params.py) is split after each
separator; when any of its segments but the last is cached (one LOOKUP per segment, in
the segment namespace), the connector claims the prompt up to the start of its last
segment as a synchronous external hit (`get_num_new_matched_tokens` returning `(n,
False)`; vLLM then calls `start_load_kv` before the forward and computes only the tail:
vllm/v1/core/sched/scheduler.py ~l.979 in 0.32.0), and the workers blend it
(client/vllm/blend_worker.py). A request none of whose segments is cached yet is served
normally and its workers store the segments, for later requests in any process. Blend
work is invisible to vLLM's token budget, so the claimed tokens of one step are bounded
(`blend_tokens_per_step`): beyond it the connector answers None ("ask again next step").

Requests that asked for blending and are served normally have their reason counted in
`refusals` (one warning per reason). The counters reach vLLM's connector stats
(`counters`, client/vllm/connector_stats.py). vllm-free.
"""

import collections
import dataclasses
from typing import Any

import numpy as np

from lmcached.client.blend.retriever import split_on_spt
from lmcached.client.engine import CacheEngine
from lmcached.client.layout import KVLayout
from lmcached.client.vllm.blend_params import (
    BLEND_KEY,
    BlendParams,
    BlendSpec,
    blend_params,
    blend_params_problem,
)
from lmcached.client.vllm.specs import ConnectorSettings
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

DEFAULT_BLEND_TOKENS_PER_STEP = 16384


@dataclasses.dataclass
class _BlendRequest:
    request: Any  # vllm.v1.request.Request
    params: BlendParams
    end: int  # start of the prompt's last segment: the claim ends there
    num_local_tokens: int = 0
    claimed: bool = False  # False: store the segments only
    block_ids: list[int] = dataclasses.field(default_factory=list)
    sent: bool = False


class BlendScheduler:
    """Decides, per request, whether the workers blend it, store its documents, or
    neither (a normal request).

    Args:
        settings: the connector's settings (daemon, chunk size).
        segment_layout: rank 0's namespace of document segments.
        refuse_all: a reason every blend request is refused for (no blend-aware
            model, a RoPE that cannot be re-rotated), or None.
        tokens_per_step: claimed tokens one step may blend before "ask again".

    Attributes:
        refusals: reason -> requests that asked for blending and were served normally.
        num_claimed_requests / num_claimed_tokens: blends planned.
        num_store_only_requests: requests whose segments were only stored.
        num_deferred: "ask again" answers (the step's blend budget was spent).
    """

    def __init__(self, settings: ConnectorSettings, segment_layout: KVLayout,
                 refuse_all: str | None = None,
                 tokens_per_step: int = DEFAULT_BLEND_TOKENS_PER_STEP) -> None:
        self.settings = settings
        self.refuse_all = refuse_all
        self.tokens_per_step = tokens_per_step
        self.refusals: collections.Counter = collections.Counter()
        self.num_claimed_requests = 0
        self.num_claimed_tokens = 0
        self.num_store_only_requests = 0
        self.num_deferred = 0
        self._engine = (None if refuse_all else
                        CacheEngine.connect(segment_layout, settings.socket, settings.daemon_name,
                                            timeout_s=settings.timeout_s))
        self._requests: dict[str, _BlendRequest] = {}
        self._refused: set[str] = set()
        self._step_tokens = 0

    def handles(self, request) -> bool:
        """Whether this request is a blend (or store-only) request of ours."""
        return request.request_id in self._requests

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[bool, int | None]:
        """Claim a blend request's documents.

        Args:
            request: the vLLM Request.
            num_computed_tokens: vLLM's local prefix-cache hit.

        Returns:
            (False, 0): not a blend request we serve (the caller serves it normally);
            (True, n): n tokens claimed (0: store-only); (True, None): ask again.
        """
        req_id = request.request_id
        if req_id in self._refused:
            return False, 0
        state = self._requests.get(req_id)
        if state is None:
            state, reason = self._admit(request)
            if state is None:
                if reason is not None:
                    detail = (blend_params_problem(request.kv_transfer_params[BLEND_KEY])
                              if reason == "bad_params" else None)
                    self._refuse(req_id, reason, detail)
                return False, 0
        state.num_local_tokens = num_computed_tokens
        # vLLM asks again only for a request it schedules from scratch (new, waiting, or
        # preempted and recomputed): blend (or store) it again in the step it runs.
        state.sent = False
        if num_computed_tokens >= state.end:
            self._requests.pop(req_id)
            self._refuse(req_id, "local_hit")
            return False, 0
        claim = state.end - num_computed_tokens
        if not state.claimed:
            return True, 0
        if self._step_tokens and self._step_tokens + claim > self.tokens_per_step:
            self.num_deferred += 1
            return True, None
        self._step_tokens += claim
        return True, claim

    def _admit(self, request) -> tuple[_BlendRequest | None, str | None]:
        """A new request: its state, or (None, the reason it is served normally)."""
        params, reason = blend_params(request)
        if params is None:
            return None, reason
        if self.refuse_all:
            return None, self.refuse_all
        tokens = np.asarray(request.prompt_token_ids, dtype=np.int64)
        segments = split_on_spt(tokens, params.separator)
        if len(segments) < 2:
            return None, "one_segment"
        end = segments[-1][0]
        link = self._engine.link
        if link.snapshot() is None:
            return None, "daemon_unavailable"
        salt = request.cache_salt  # documents are keyed under it: never shared across tenants
        cached = any(self._engine.lookup(tokens[start:stop], cache_salt=salt)
                     for start, stop in segments[:-1])
        if link.generation is None:  # it went away during the lookups
            return None, "daemon_unavailable"
        state = _BlendRequest(request, params, end, claimed=cached)
        self._requests[request.request_id] = state
        return state, None

    def _refuse(self, req_id: str, reason: str, detail: str | None = None) -> None:
        """Serve `req_id` normally from now on; count `reason` (one warning per reason,
        with `detail`, e.g. which blend parameter is out of range)."""
        self._refused.add(req_id)
        if not self.refusals[reason]:
            logger.warning("lmcached blend: a request asking for blending is served normally "
                           "(%s%s); further ones are counted in the connector's refusals",
                           reason, f": {detail}" if detail else "")
        self.refusals[reason] += 1

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Record the request's blocks; vLLM may have accepted fewer tokens than claimed."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        (state.block_ids,) = blocks.get_block_ids()[:1]
        state.block_ids = list(state.block_ids)
        if state.claimed:
            if num_external_tokens == 0:  # vLLM took nothing: a store-only request now
                state.claimed = False
            else:
                state.end = state.num_local_tokens + num_external_tokens

    def build_step(self, scheduler_output) -> list[BlendSpec]:
        """The blend work of this step: each request the first step it is scheduled."""
        self._step_tokens = 0
        specs = []
        for req_id in scheduler_output.num_scheduled_tokens:
            state = self._requests.get(req_id)
            if state is None or state.sent:
                continue
            state.sent = True
            tokens = np.asarray(state.request.prompt_token_ids[: state.end], dtype=np.int64)
            specs.append(BlendSpec(req_id, state.params, tokens, state.num_local_tokens,
                                   state.block_ids, store_only=not state.claimed,
                                   cache_salt=state.request.cache_salt))
            if state.claimed:
                self.num_claimed_requests += 1
                self.num_claimed_tokens += state.end - state.num_local_tokens
            else:
                self.num_store_only_requests += 1
        return specs

    def counters(self) -> dict[str, Any]:
        """The counters so far, as vLLM's connector stats carry them
        (client/vllm/connector_stats.py): "claimed_requests", "claimed_tokens",
        "store_only_requests", "deferred" and "refusals" (by reason)."""
        return {"claimed_requests": self.num_claimed_requests,
                "claimed_tokens": self.num_claimed_tokens,
                "store_only_requests": self.num_store_only_requests,
                "deferred": self.num_deferred,
                "refusals": dict(self.refusals)}

    def request_finished(self, request) -> None:
        """Forget the request."""
        self._requests.pop(request.request_id, None)
        self._refused.discard(request.request_id)

    def shutdown(self) -> None:
        """Close the daemon session."""
        if self._engine is not None:
            self._engine.close()
