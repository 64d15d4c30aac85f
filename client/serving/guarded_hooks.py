"""A connector's per-request bookkeeping around its guarded hooks.

Why this file exists: a hook that fails must cost a miss (`HookGuard`, hook_guard.py), and
what the failed hook had promised the engine must then be undone or reported, whatever the
engine. This module holds that bookkeeping, apart from any engine's glue:

- `_guarded(hook, call, *args)`: run one call of a hook; an exception is counted and
  logged by `hook_guard` and served as None.
- the state a connector keeps between its hooks (`_init_guarded_hooks`): the engine's own
  prefix hit per request at the last lookup (`_local_hits`), the blocks promised to the
  engine in this step (`_claims`), the promised blocks of a failed plan, sent to the
  workers as load errors with the next step's metadata (`_failed_loads`), and, on a
  worker, the blocks to report as load errors (`_failed_blocks`).
- `_forget(request)` / `_forget_id(req_id)`: drop what the scheduler sides keep for a
  request (and its pins), never raising.

`GuardedHooks` is a part of an engine's connector (client/vllm/connector.py's
`LMCachedConnector`): the connector calls `_init_guarded_hooks()` in its `__init__` and
has the attributes `scheduler_side` and `blend_scheduler`, each None or an object with
`request_finished(request)` that reads only `request.request_id`. Engine-neutral: it
imports no engine and no engine's glue.
"""

import dataclasses
from typing import Any

from lmcached.client.serving.hook_guard import HookGuard


class GuardedHooks:
    """The guarded-hook bookkeeping of an engine's connector (see the module docstring).

    Attributes:
        hook_guard: exceptions caught in the hooks, per hook (`HookGuard.failures`).
    """

    def _init_guarded_hooks(self) -> None:
        """Start with no failure counted and nothing promised, claimed or failed."""
        self.hook_guard = HookGuard()
        self._local_hits: dict[str, int] = {}  # req_id -> the engine's own hit at the last lookup
        self._claims: dict[str, list[int]] = {}  # req_id -> blocks promised in this step
        self._failed_loads: dict[str, list[int]] = {}  # for the next step's metadata
        self._failed_blocks: set[int] = set()  # worker: blocks to report as load errors

    def _forget(self, request) -> None:
        """Drop what either scheduler side keeps for `request` (and its pins); never raises."""
        self._forget_id(request.request_id, request)

    def _forget_id(self, req_id: str, request=None) -> None:
        self._local_hits.pop(req_id, None)
        if request is None:
            request = _RequestId(req_id)
        if self.scheduler_side is not None:
            self._guarded("request_finished", self.scheduler_side.request_finished, request)
        if self.blend_scheduler is not None:
            self._guarded("request_finished", self.blend_scheduler.request_finished, request)

    def _guarded(self, hook: str, call, *args) -> Any:
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
