"""One CacheEngine per instance id in a process (after LMCache's LMCacheEngineBuilder)."""

import threading

from lmcached.client.engine import CacheEngine
from lmcached.client.layout import KVLayout


class CacheEngineBuilder:
    """Process-wide registry of engines by instance id (seed: LMCacheEngineBuilder).

    A vLLM worker and its connector, or several modules of one process, get the same
    engine (one session, one arena mapping) by asking for the same id.
    """

    _instances: dict[str, CacheEngine] = {}
    _lock = threading.Lock()

    @classmethod
    def get_or_create(cls, instance_id: str, layout: KVLayout, **connect_options) -> CacheEngine:
        """The engine of `instance_id`, connecting one with `CacheEngine.connect` if new.

        Raises:
            ValueError: `instance_id` exists with a different layout.
        """
        with cls._lock:
            engine = cls._instances.get(instance_id)
            if engine is not None:
                if engine.layout != layout:
                    raise ValueError(
                        f"engine {instance_id!r} exists with layout {engine.layout}, "
                        f"not {layout}: destroy it first or use another instance id"
                    )
                return engine
            engine = CacheEngine.connect(layout, **connect_options)
            cls._instances[instance_id] = engine
            return engine

    @classmethod
    def get(cls, instance_id: str) -> CacheEngine | None:
        """The engine of `instance_id`, or None."""
        return cls._instances.get(instance_id)

    @classmethod
    def destroy(cls, instance_id: str) -> None:
        """Close and forget the engine of `instance_id` (no-op when unknown)."""
        with cls._lock:
            engine = cls._instances.pop(instance_id, None)
        if engine is not None:
            engine.close()
