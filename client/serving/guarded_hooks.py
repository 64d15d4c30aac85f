"""A connector's per-request bookkeeping around its guarded hooks.

Why this file exists: a hook that fails must cost a miss (`HookGuard`, hook_guard.py), and
what the failed hook had promised the engine must then be undone or reported, whatever the
engine. This module holds that bookkeeping, apart from any engine's glue:

- `guarded(hook, call, *args)`: run one call of a hook; an exception is counted and
  logged by `hook_guard` and served as None.
- the state a connector keeps between its hooks: the engine's own prefix hit per request
  at the last lookup (`local_hits`), the blocks promised to the engine in this step
  (`claims`), the promised blocks of a failed plan, sent to the workers as load errors
  with the next step's metadata (`failed_loads`), and, on a worker, the blocks to report
  as load errors (`failed_blocks`).
- `forget(req_id, sides)`: drop what the scheduler sides keep for a request (and its
  pins), never raising.
- `counters()`: what the hooks recorded so far, as an engine's stats carry it (the local
  hit tokens, the blocks claimed, the claimed blocks of failed plans, the blocks reported
  as load errors, the failures caught per hook).

`GuardedHooks` is an object an engine's connector holds (client/vllm/connector.py's
`LMCachedConnector.hooks`); the scheduler sides it forgets a request in are passed to
`forget`, each None or an object with `request_finished(request)` that reads only
`request.request_id`. Engine-neutral: it imports no engine and no engine's glue.
"""

import dataclasses
from typing import Any, Iterable

from lmcached.client.serving.hook_guard import HookGuard


class GuardedHooks:
    """The guarded-hook bookkeeping of an engine's connector (see the module docstring).

    Starts with no failure counted and nothing promised, claimed or failed.

    Attributes:
        hook_guard: exceptions caught in the hooks, per hook (`HookGuard.failures`).
        local_hits: req_id -> the engine's own prefix hit at the last lookup, tokens.
        claims: req_id -> engine block ids promised in this step.
        failed_loads: req_id -> promised block ids of a failed plan, for the next step's
            metadata.
        failed_blocks: worker: engine block ids to report as load errors.
        num_local_hit_tokens: the engine's own prefix hits, summed over lookups, tokens.
        num_claimed_blocks: engine blocks promised to the engine (`claim`).
        num_failed_load_blocks: promised blocks of failed plans, sent to the workers as
            load errors (`count_failed_loads`).
        num_load_error_blocks: worker: engine blocks reported as load errors, any cause
            (`count_load_errors`).
    """

    def __init__(self) -> None:
        self.hook_guard = HookGuard()
        self.local_hits: dict[str, int] = {}
        self.claims: dict[str, list[int]] = {}
        self.failed_loads: dict[str, list[int]] = {}
        self.failed_blocks: set[int] = set()
        self.num_local_hit_tokens = 0
        self.num_claimed_blocks = 0
        self.num_failed_load_blocks = 0
        self.num_load_error_blocks = 0

    def note_local_hit(self, req_id: str, num_tokens: int) -> None:
        """Record the engine's own prefix hit of request `req_id` at a lookup, tokens."""
        self.local_hits[req_id] = num_tokens
        self.num_local_hit_tokens += num_tokens

    def claim(self, req_id: str, block_ids: list[int]) -> None:
        """Record the engine blocks promised to request `req_id` in this step."""
        self.claims[req_id] = block_ids
        self.num_claimed_blocks += len(block_ids)

    def fail_claim(self, req_id: str) -> None:
        """The plan of request `req_id` failed: its claimed blocks (if any) go to the
        workers as load errors with the next step's metadata (`failed_loads`)."""
        claimed = self.claims.pop(req_id, None)
        if claimed:
            self.failed_loads[req_id] = claimed

    def count_failed_loads(self, failed_loads: dict[str, list[int]]) -> dict[str, list[int]]:
        """Count the promised blocks of failed plans a step's metadata sends to the
        workers (req_id -> engine block ids); returns them."""
        self.num_failed_load_blocks += sum(len(block_ids) for block_ids in failed_loads.values())
        return failed_loads

    def count_load_errors(self, block_ids: set[int]) -> set[int]:
        """Count the engine blocks a worker reports as load errors; returns them."""
        self.num_load_error_blocks += len(block_ids)
        return block_ids

    def counters(self, with_blocks: bool = True) -> dict[str, Any]:
        """The counts so far (cumulative), as an engine's connector stats carry them:
        "local_hit_tokens", "claimed_blocks", "failed_load_blocks", "load_error_blocks"
        and "hook_failures" ({hook: exceptions caught}).

        Args:
            with_blocks: False leaves the four block and token counts out (a TP rank
                other than 0: every rank reports the same blocks, and an engine sums the
                workers'); the failures caught are each rank's own.
        """
        counts: dict[str, Any] = {}
        if with_blocks:
            counts.update(local_hit_tokens=self.num_local_hit_tokens,
                          claimed_blocks=self.num_claimed_blocks,
                          failed_load_blocks=self.num_failed_load_blocks,
                          load_error_blocks=self.num_load_error_blocks)
        counts["hook_failures"] = dict(self.hook_guard.failures)
        return counts

    def forget(self, req_id: str, sides: Iterable, request=None) -> None:
        """Drop what each scheduler side in `sides` (None: skipped) keeps for request
        `req_id` (and its pins), and its local hit; never raises.

        Args:
            req_id: the request's id.
            sides: the connector's scheduler sides, in order.
            request: the engine's request, when at hand (else one carrying `req_id`).
        """
        self.local_hits.pop(req_id, None)
        if request is None:
            request = _RequestId(req_id)
        for side in sides:
            if side is not None:
                self.guarded("request_finished", side.request_finished, request)

    def guarded(self, hook: str, call, *args) -> Any:
        """`call(*args)`, or None (counted, logged) when it raises."""
        try:
            return call(*args)
        except Exception as exc:  # noqa: BLE001 - never into the engine
            self.hook_guard.caught(hook, exc, "skipped")
            return None


@dataclasses.dataclass(frozen=True)
class _RequestId:
    """What the scheduler sides' `request_finished` read of a request: its id."""

    request_id: str
