"""A serving engine connector's boundary: an exception of a hook becomes a counted miss.

Why this file exists: an engine calls its connector's hooks inside its scheduler loop
(vLLM's EngineCore) and inside every worker's forward step; an exception there kills the
engine. lmcached is a cache: whatever goes wrong in it (a bug, a daemon answer out of
protocol, a request it did not foresee) must cost a miss, never a request or the engine.
A connector (e.g. client/vllm/connector.py) wraps each hook it implements and hands what
it caught to `HookGuard`, which counts it per hook and logs it with its traceback at most
once per `log_interval_s` per hook. What a failed hook falls back to (0 tokens matched,
its claimed blocks reported as load errors so that the engine recomputes them, a save
skipped) is written at each hook. Engine-neutral.
"""

import collections
import time

from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

LOG_INTERVAL_S = 60.0


class HookGuard:
    """Counts the exceptions caught at an engine integration's hooks (the vLLM connector,
    the SGLang storage backend); logs them, rate limited.

    Args:
        log_interval_s: at most one log line per hook in this many seconds (the others
            are counted, and the next line says how many were not logged).

    Attributes:
        failures: hook name -> exceptions caught in it (each served as a miss).
    """

    def __init__(self, log_interval_s: float = LOG_INTERVAL_S) -> None:
        self.log_interval_s = log_interval_s
        self.failures: collections.Counter = collections.Counter()
        self._logged_at: dict[str, float] = {}
        self._unlogged: collections.Counter = collections.Counter()

    @property
    def num_failures(self) -> int:
        """Exceptions caught in every hook together."""
        return sum(self.failures.values())

    def caught(self, hook: str, exc: BaseException, fallback: str) -> None:
        """Count an exception `hook` raised; log it (with its traceback) unless this hook
        logged one less than `log_interval_s` ago.

        Args:
            hook: the hook's name (e.g. "get_num_new_matched_tokens").
            exc: what it raised.
            fallback: what the connector did instead, for the log line.
        """
        self.failures[hook] += 1
        now = time.monotonic()
        last = self._logged_at.get(hook)
        if last is not None and now - last < self.log_interval_s:
            self._unlogged[hook] += 1
            return
        self._logged_at[hook] = now
        unlogged = self._unlogged.pop(hook, 0)
        logger.error("lmcached: %s failed (%s: %s); %s. lmcached is a cache: the "
                     "engine serves on (%d such failures in this hook, %d not logged since the "
                     "last line)", hook, type(exc).__name__, exc, fallback,
                     self.failures[hook], unlogged, exc_info=exc)


def claimed_block_ids(block_ids: list[int], num_local_tokens: int, num_external_tokens: int,
                      block_size: int) -> list[int]:
    """The engine block ids that hold the claimed tokens `[num_local_tokens, num_local_tokens
    + num_external_tokens)` of a request whose blocks are `block_ids` (the blocks a
    failed hook reports as load errors, so that the engine recomputes them)."""
    first = num_local_tokens // block_size
    end = -(-(num_local_tokens + num_external_tokens) // block_size)
    return list(block_ids[first:end])
