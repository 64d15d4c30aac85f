"""The daemon (import name `lmcached.daemon`): the one process that owns the arenas.

What lives here:
    server.py, connection.py   the selectors loop and one client connection's buffers;
                               server_io.py (a connection's bytes), server_clients.py
                               (accept, limits, drops) are parts of the server
    startup.py                 the start-up steps before the loop serves
    peers.py                   what a peer's credentials (SO_PEERCRED) let it reach
    server_config.py           `ServerConfig`, what the daemon runs with (built by
                               `lmcached.config`, which the daemon never imports)
    service.py, session.py     request semantics (no sockets) and what each session holds;
                               the handlers in namespaces.py, request_checks.py,
                               value_handlers.py, admin_handlers.py (replies.py: refusals)
    commands.py                the command table: one row per request type (handler,
                               privilege, cost, reply kind, loading and HELLO rules)
    keys.py                    the block pool's keys for chunks and string keys
    block_pool.py, free_queue.py  `BlockPool` and the LRU `FreeKVCacheBlockQueue` of
                               `KVCacheBlock`s (after vLLM's v1 core)
    pool_bookkeeping.py        `ValueLedger`, which each pool holds: chain parents, values
                               per namespace, the stored / removed events it publishes
    pool_invariants.py         `check_pool_invariants`: every invariant of a block pool
    memory_tiers.py, demotion.py  device memory tiers and the demotion of their LRU chunks to host
    jobs.py                    the background job runner (worker threads, completions the
                               loop applies): demotion, L2 and the disk tier are its queues
    spill/                     the tiers under the arena: their protocol (`SpillTier`, the
                               fetches in flight), the value envelope, typed counters
    l2/                        the L2 tier on Redis (--l2): keys and values, I/O, threads
    disk/                      the disk tier (--disk-path): slot file, index, threads
    stats.py                   every counter of the request semantics and the block pools,
                               one typed snapshot (INFO and the metrics read it); latency
    info.py                    INFO / CLIENTS fields
    events.py                  the chunk event feed for routers (SUBSCRIBE / EVENTS): a
                               bounded ring of chunks entering and leaving arena and disk
    event_handlers.py          the SUBSCRIBE / EVENTS requests: what a session may
                               subscribe to, each page's token ids and price
    metrics.py, metrics_http.py  the Prometheus endpoint (--metrics-port), bounded against
                               hostile local processes
    notify.py, progress.py     systemd's notify protocol, start-up progress
    ratelimit.py               a repeated warning logged at most once per interval

What it may import: `lmcached.shm` and `lmcached.wire`; never `lmcached.client`, torch,
click, transformers or vllm. prometheus_client only in metrics.py (with --metrics-port),
redis-py only in l2/redis_store.py and l2/failures.py (with --l2). The layers between
these modules are pyproject.toml's `daemon-layers` import-linter contract
(tests/docs/test_layers.py runs it).
"""
