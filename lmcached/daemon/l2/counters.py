"""The L2 tier's counters (INFO section `l2`, docs/l2.md "Counters"), typed.

Each field is INFO field `l2_<name>`; a field with a metric is also that Prometheus
counter, a field with a family one sample of that labelled family
(`lmcached.daemon.spill.counters`). The store's errors are counted by kind in a dict
(`RedisStore.errors`, on its threads): INFO fields `l2_errors_<kind>` and family
`ERRORS`, both named by `error_fields` / `ERROR_SAMPLES`.
"""

import dataclasses

from lmcached.daemon.spill.counters import LabelledFamily, counter

WRITE_DROPS = LabelledFamily("lmcached_l2_write_drops", "Chunk writes dropped, by reason.",
                             "reason")
FETCH_REJECTS = LabelledFamily("lmcached_l2_fetch_rejects", "Fetched values not served, by "
                               "reason (verify_*: failed verification).", "reason")
# What `RedisStore.errors` counts, by kind (docs/l2.md, "Counters").
ERROR_KINDS = ("connection", "timeout", "full", "response", "protocol", "auth", "readonly")
ERRORS = LabelledFamily("lmcached_l2_errors", "L2 errors by kind.", "kind")
ERRORS_PREFIX = "l2_errors_"
_ERROR_ORDER = tuple(sorted(ERROR_KINDS))  # INFO's order of the l2_errors_<kind> fields
ERROR_SAMPLES = ERRORS.samples_of_counts(ERRORS_PREFIX, _ERROR_ORDER)


def error_fields(errors: dict[str, int]) -> dict[str, int]:
    """INFO fields `l2_errors_<kind>` of the store's errors by kind (`RedisStore.errors`),
    one per `ERROR_KINDS`, sorted by kind."""
    return ERRORS.counts_fields(ERRORS_PREFIX, errors, _ERROR_ORDER)


@dataclasses.dataclass(slots=True)
class L2Stats:
    """Counters of `L2Tier`, in INFO's order (loop thread only)."""

    clears: int = counter()
    clear_failures: int = counter("lmcached_l2_clear_failures", "CLEARs whose INCR of the "
                                  "L2's clear generation failed (retried; no fetch from L2 "
                                  "meanwhile).")
    writes: int = counter("lmcached_l2_writes", "Chunks written to L2.")
    write_bytes: int = counter("lmcached_l2_written_bytes", "Bytes of the chunks written to L2.")
    write_drops_queue_full: int = counter(family=WRITE_DROPS, label="queue_full")
    write_drops_down: int = counter(family=WRITE_DROPS, label="down")
    write_drops_oversize: int = counter(family=WRITE_DROPS, label="oversize")
    write_failures: int = counter("lmcached_l2_write_failures", "Chunk writes L2 refused "
                                  "(full: OOM) or that failed.")
    fetches: int = counter("lmcached_l2_fetches", "Fetches started by lookups that missed "
                           "in the arena.")
    fetches_joined: int = counter()
    fetches_skipped: int = counter("lmcached_l2_fetches_skipped", "Fetches not started "
                                   "(L2 down, too many in flight): answered as misses.")
    fetch_hit_chunks: int = counter("lmcached_l2_hit_chunks", "Chunks fetched from L2 into "
                                    "the arena.")
    fetch_miss_chunks: int = counter("lmcached_l2_miss_chunks", "Chunks asked of L2 that it "
                                     "did not hold.")
    fetch_bytes: int = counter("lmcached_l2_fetched_bytes", "Bytes of the chunks fetched "
                               "from L2.")
    fetch_nospace: int = counter(family=FETCH_REJECTS, label="nospace")
    fetch_oversize: int = counter(family=FETCH_REJECTS, label="oversize")
    fetch_down: int = counter("lmcached_l2_fetch_down", "Fetches that failed because L2 "
                              "was down.")
    fetch_errors: int = counter("lmcached_l2_fetch_errors", "Fetches that failed for "
                                "another reason (the daemon log says which).")
    fetch_gone: int = counter(family=FETCH_REJECTS, label="gone")
    fetch_waits_timed_out: int = counter("lmcached_l2_fetch_waits_timed_out", "Lookups "
                                         "answered before their fetch ended (--l2-fetch-wait).")
    fetch_verify_envelope: int = counter(family=FETCH_REJECTS, label="verify_envelope")
    fetch_verify_foreign: int = counter(family=FETCH_REJECTS, label="verify_foreign")
    fetch_verify_checksum: int = counter(family=FETCH_REJECTS, label="verify_checksum")
    fetch_verify_tokens: int = counter(family=FETCH_REJECTS, label="verify_tokens")

    def count_rejected(self, failure: str) -> None:
        """A fetched value not served: `failure` is "gone" or "verify_<reason>"
        (`envelope.VERIFY_REASONS`), as the fetch thread posts it."""
        name = "fetch_" + failure
        setattr(self, name, getattr(self, name) + 1)
