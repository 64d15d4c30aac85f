"""The engine-neutral serving core (import name `lmcached.client.serving`, folder
`client/serving/`).

Why this package exists: what a serving engine's KV connector does against the daemon is
the same whatever the engine: the scheduler side pins a request's hit at lookup, plans its
load on those pins, holds them per step until every tensor parallel rank reports the step
loaded, and bumps a request's epoch when a load failed; the worker side checks each record
before and after copying it into the engine's blocks, agrees with the other ranks on what
failed, and stores new full chunks after the forward pass. An engine's glue
(`client/vllm/`) translates its objects into these calls.

- `specs.py`: the settings every side shares and what the scheduler sends its workers
  (`ConnectorSettings`, `LoadSpec`, `SaveSpec`).
- `scheduler.py`: the scheduler side (pinned lookups, step pins, epochs, worker reports).
- `worker.py`: the worker side (load: check, copy, re-check, TP agreement; save).
- `mover.py`: `KVMover`, how an engine's blocks are copied (gather, scatter, wait).
- `hook_guard.py`: the boundary that turns an exception of a hook into a counted miss;
  `guarded_hooks.py`: a connector's per-request bookkeeping around its guarded hooks
  (blocks promised, failed loads, forgetting a request).
- `events.py`: `EventRelay`, the daemon's chunk events as the engine's block events (its
  block size and block hashes), for routers (docs/kv-events.md).

It imports no engine (no vllm, no transformers) and nothing of an engine's glue: an
import-linter contract (pyproject.toml, tests/docs/test_layers.py) says so. This `__init__`
imports nothing.
"""
