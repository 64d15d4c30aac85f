"""The L2 tier: chunk values kept in Redis (standalone or cluster), shared by every node.

What lives here (import name `lmcached.daemon.l2`, folder `lmcached/daemon/l2/`):

- `values`: pure functions, no I/O. The L2 key of a chunk; the value stored under it
  is a 64-byte envelope (`lmcached.daemon.spill.envelope`), then the record as in the arena.
- `redis_store`: the I/O. `RedisL2` talks to Redis through redis-py (with hiredis),
  pipelined, from several threads at once, and backs off while Redis is down.
- `url`: `parse_l2_url`, the `--l2` URL's servers (pure, no redis-py).
- `failures`: what the store raises (`L2Unavailable`, `L2Misconfigured`) and how it
  describes a misconfigured server.
- `tier`: the daemon's side. Writer and fetch threads, the bounded write queue, and the
  completions that the selector loop applies to the block pool.
- `counters`: the tier's counters (`L2Stats`, INFO `l2_*`), typed.
- `fetch`: the read half: a fetch thread's work (`fetch_chain`: STRLEN, GET, verify) and
  the loop's install of verified records into arena blocks.

What it may import: the daemon's modules (`lmcached.wire.record_format`, `protocol`,
`logger`, `lmcached.shm`) and numpy, xxhash, msgspec. Never torch and never
`lmcached.client`: the daemon runs without them. redis-py is imported by
`redis_store.py` and `failures.py` only, so the daemon imports it only when `--l2` is set.
"""
