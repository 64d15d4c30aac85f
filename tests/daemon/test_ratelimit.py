"""RateLimitedLog: a repeated warning goes to its user's logger at most once per
LOG_INTERVAL_S, with the count of those left out; the disk tier's faults are logged
under the disk tier's name, the connections' limits under the connection's."""

import errno
import logging
import os

from lmcached.daemon import ratelimit
from lmcached.daemon.disk.slots import SlotFile
from lmcached.daemon.ratelimit import RateLimitedLog
from test_disk_tier import disk_service, stored_and_settled  # noqa: F401 (a fixture)


def test_repeats_within_the_interval_are_counted_then_reported(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(ratelimit.time, "monotonic", lambda: now[0])
    log = RateLimitedLog(logging.getLogger("lmcached.test.ratelimit"))
    with caplog.at_level(logging.WARNING, logger="lmcached.test.ratelimit"):
        log.warning("read failed: %s", "EIO")
        log.warning("read failed: %s", "EIO")
        log.warning("read failed: %s", "EIO")
        now[0] += ratelimit.LOG_INTERVAL_S
        log.warning("read failed: %s", "EIO")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("lmcached.test.ratelimit", "read failed: EIO"),
        ("lmcached.test.ratelimit", "read failed: EIO (2 more since the last report)"),
    ]


def test_a_disk_fault_is_logged_under_the_disk_tiers_name(disk_service, monkeypatch, caplog):
    def fail(self, *args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(SlotFile, "write_record", fail)
    with caplog.at_level(logging.WARNING, logger="lmcached"):
        stored_and_settled(disk_service)
    faults = [r.name for r in caplog.records if "a write failed" in r.getMessage()]
    assert faults and set(faults) == {"lmcached.daemon.disk.tier"}, caplog.records


def test_the_connections_limits_are_logged_under_the_connections_name():
    from lmcached.daemon import connection, server

    assert server.connection_logger is connection.logger
    assert connection.logger.name == "lmcached.daemon.connection"
