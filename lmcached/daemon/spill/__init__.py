"""The spill tiers under the host arena (disk, L2): what every one of them shares.

What lives here (import name `lmcached.daemon.spill`, folder `lmcached/daemon/spill/`):

- `envelope`: pure functions, no I/O. The 64-byte envelope written before a chunk's record
  wherever it leaves the arena (an L2 value, a disk tier slot), built, parsed and verified
  once for every tier.
- `tier`: the `SpillTier` protocol, `FetchRequest`, and `FetchJobs` (the fetches in
  flight, keyed and joined once for every tier).
- `counters`: typed counter fields, and the INFO fields and metric families generated
  from them.

What it may import: `lmcached.wire` and the daemon's lower layers (pyproject.toml's
`daemon-layers` contract); never a tier's own package (`disk`, `l2`): the tiers import it.
"""
