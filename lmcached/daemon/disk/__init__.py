"""The disk tier: chunks the arena evicts spill to a local slot file, misses are fetched
back, and a restarted daemon finds them again (`--disk-path`, docs/operator.md).

What lives here (import name `lmcached.daemon.disk`, folder `lmcached/daemon/disk/`):

- `directory`: the directory's safety checks (its ancestors too), the open directory that
  every file in it is opened relative to, and the lock that keeps a second daemon out.
- `slots`: the I/O. The preallocated slot file, O_DIRECT reads and writes of whole slots,
  the envelope written last.
- `scan`: the scan of every slot's envelope that rebuilds the index (threads, progress).
- `counters`: the tier's counters (`DiskStats`, INFO `disk_*`), typed.
- `index`: which slot holds which chunk, LRU order, the slots being read (loop thread).
- `tier`: the daemon's side. The file's geometry, the writer and reader threads (the
  daemon's job runner), INFO `disk`; its parts `writes` (writes ahead of eviction from the
  arena's blocks, what an eviction finds or drops, write-through, erasures), `fetch` (reads
  into arena blocks), `save` (the arena's chunks written at a graceful stop, hottest first,
  within --disk-save-on-stop) and `prewarm` (after a restart, the hottest disk chunks read
  back into the arena's empty blocks in the background).
- `recency`: the index's LRU order written at a graceful stop and applied at the next
  start (a small file next to the slot file).

What it may import: the daemon's modules (the spill tiers' envelope and checks in
`lmcached.daemon.spill.envelope`, which import no redis-py), `lmcached.wire`, `lmcached.shm`,
numpy and xxhash. Never torch and never `lmcached.client`.
"""
