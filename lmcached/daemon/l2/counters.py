"""The L2 tier's counters (INFO section `l2`, docs/l2.md "Counters"), typed.

Each field is INFO field `l2_<name>`; a field with a metric is also that Prometheus
counter (`lmcached.daemon.spill.counters`).
"""

import dataclasses

from lmcached.daemon.spill.counters import counter


@dataclasses.dataclass(slots=True)
class L2Stats:
    """Counters of `L2Tier`, in INFO's order (loop thread only)."""

    clears: int = counter()
    clear_failures: int = counter()
    writes: int = counter("lmcached_l2_writes", "Chunks written to L2.")
    write_bytes: int = counter("lmcached_l2_written_bytes", "Bytes of the chunks written to L2.")
    write_drops_queue_full: int = counter()
    write_drops_down: int = counter()
    write_drops_oversize: int = counter()
    write_failures: int = counter("lmcached_l2_write_failures", "Chunk writes L2 refused "
                                  "(full: OOM) or that failed.")
    fetches: int = counter("lmcached_l2_fetches", "Fetches started by lookups that missed "
                           "in the arena.")
    fetches_joined: int = counter()
    fetches_skipped: int = counter()
    fetch_hit_chunks: int = counter("lmcached_l2_hit_chunks", "Chunks fetched from L2 into "
                                    "the arena.")
    fetch_miss_chunks: int = counter("lmcached_l2_miss_chunks", "Chunks asked of L2 that it "
                                     "did not hold.")
    fetch_bytes: int = counter("lmcached_l2_fetched_bytes", "Bytes of the chunks fetched "
                               "from L2.")
    fetch_nospace: int = counter()
    fetch_oversize: int = counter()
    fetch_down: int = counter()
    fetch_errors: int = counter()
    fetch_gone: int = counter()
    fetch_waits_timed_out: int = counter("lmcached_l2_fetch_waits_timed_out", "Lookups "
                                         "answered before their fetch ended (--l2-fetch-wait).")
    fetch_verify_envelope: int = counter()
    fetch_verify_foreign: int = counter()
    fetch_verify_checksum: int = counter()
    fetch_verify_tokens: int = counter()

    def count_rejected(self, failure: str) -> None:
        """A fetched value not served: `failure` is "gone" or "verify_<reason>"
        (`envelope.VERIFY_REASONS`), as the fetch thread posts it."""
        name = "fetch_" + failure
        setattr(self, name, getattr(self, name) + 1)
