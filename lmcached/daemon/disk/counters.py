"""The disk tier's counters (INFO section `disk`, docs/operator.md "The disk tier"), typed.

Each field is INFO field `disk_<name>`; a field with a metric is also that Prometheus
counter, a field with a family one sample of that labelled family
(`lmcached.daemon.spill.counters`).
"""

import dataclasses

from lmcached.daemon.spill.counters import LabelledFamily, counter

WRITE_DROPS = LabelledFamily("lmcached_disk_write_drops", "Chunk writes to disk dropped, "
                             "by reason.", "reason")
FETCH_REJECTS = LabelledFamily("lmcached_disk_fetch_rejects", "Slots read back and not "
                               "served, by reason (verify_*: failed verification).", "reason")
ERRORS = LabelledFamily("lmcached_disk_errors", "Disk tier I/O errors by kind.", "kind")


@dataclasses.dataclass(slots=True)
class DiskStats:
    """Counters of `DiskTier`, in INFO's order (loop thread only). `errors_<kind>`: one
    per `slots.ERROR_KINDS`; `fetch_verify_<reason>`: one per `envelope.VERIFY_REASONS`."""

    writes: int = counter("lmcached_disk_writes", "Chunks written to the disk tier.")
    write_bytes: int = counter("lmcached_disk_written_bytes", "Bytes of the chunks written "
                               "to disk.")
    write_busy_us: int = counter("lmcached_disk_write_busy_seconds", "Time the disk "
                                 "writers spent writing chunks.", divisor=1e6)
    write_drops_queue_full: int = counter(family=WRITE_DROPS, label="queue_full")
    write_drops_oversize: int = counter(family=WRITE_DROPS, label="oversize")
    write_drops_busy: int = counter(family=WRITE_DROPS, label="busy")
    write_drops_late: int = counter(family=WRITE_DROPS, label="late")
    write_failures: int = counter("lmcached_disk_write_failures", "Chunk writes to disk "
                                  "that failed (an I/O error: lmcached_disk_errors).")
    spills_present: int = counter()
    spills_ahead: int = counter()
    fetches: int = counter("lmcached_disk_fetches", "Disk fetches started by lookups that "
                           "missed in the arena.")
    fetches_joined: int = counter()
    fetches_skipped: int = counter("lmcached_disk_fetches_skipped", "Disk fetches not "
                                   "started (too many in flight): answered as misses.")
    fetch_hit_chunks: int = counter("lmcached_disk_hit_chunks", "Chunks read from disk into "
                                    "the arena.")
    fetch_bytes: int = counter("lmcached_disk_fetched_bytes", "Bytes of the chunks read from "
                               "disk.")
    read_busy_us: int = counter("lmcached_disk_read_busy_seconds", "Time the disk readers "
                                "spent reading chunks.", divisor=1e6)
    fetch_nospace: int = counter("lmcached_disk_fetch_nospace", "Disk fetches stopped "
                                 "because the arena had no evictable room.")
    fetch_failures: int = counter("lmcached_disk_fetch_failures", "Chunk reads from disk "
                                  "that failed (an I/O error: lmcached_disk_errors).")
    fetch_waits_timed_out: int = counter("lmcached_disk_fetch_waits_timed_out", "Lookups "
                                         "answered before their disk fetch ended "
                                         "(--disk-fetch-wait).")
    errors_nospace: int = counter(family=ERRORS, label="nospace")
    errors_io: int = counter(family=ERRORS, label="io")
    errors_readonly: int = counter(family=ERRORS, label="readonly")
    errors_other: int = counter(family=ERRORS, label="other")
    fetch_verify_checksum: int = counter(family=FETCH_REJECTS, label="verify_checksum")
    fetch_verify_envelope: int = counter(family=FETCH_REJECTS, label="verify_envelope")
    fetch_verify_foreign: int = counter(family=FETCH_REJECTS, label="verify_foreign")
    fetch_verify_tokens: int = counter(family=FETCH_REJECTS, label="verify_tokens")

    def count_error(self, kind: str, count: int = 1) -> None:
        """I/O errors of `kind` (`slots.error_kind`: "nospace", "io", "readonly", "other")."""
        name = "errors_" + kind
        setattr(self, name, getattr(self, name) + count)

    def count_rejected(self, reason: str) -> None:
        """A slot read back that failed verification (`envelope.VERIFY_REASONS`)."""
        name = "fetch_verify_" + reason
        setattr(self, name, getattr(self, name) + 1)
